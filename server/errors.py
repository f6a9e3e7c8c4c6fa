"""Errors for every failure: OpenAI's shape `{"error": {"message", "type", "param", "code"}}`,
or Anthropic's `{"type": "error", "error": {"type", "message"}}` on the Messages API's paths."""

from __future__ import annotations

import uuid
from typing import Any

from fastapi.responses import JSONResponse
from pydantic import BaseModel


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo


_TYPES = {
    400: "invalid_request_error",
    401: "invalid_request_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "service_unavailable",
}

# Anthropic's error types by status (its Messages API answers in these).
_ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    503: "overloaded_error",
}
ANTHROPIC_PATHS = ("/v1/messages",)

# Seconds a client (or router) should wait before retrying here, where the error carries no
# advice of its own: `server/admission.py` advises each 429 and each loading or draining 503 from
# the queue's state, spread per response.
RETRY_AFTER = {429: "1", 503: "5"}


class APIError(Exception):
    """Raised anywhere in request handling; the app turns it into an error response."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        retry_after: int | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.retry_after = retry_after  # seconds, for the Retry-After header (429, 503)

    def body(self) -> ErrorResponse:
        kind = _TYPES.get(self.status, "invalid_request_error")
        return ErrorResponse(
            error=ErrorInfo(message=self.message, type=kind, param=self.param, code=self.code)
        )

    def anthropic_body(self) -> dict[str, Any]:
        kind = _ANTHROPIC_TYPES.get(self.status, "invalid_request_error")
        error = {"type": kind, "message": self.message}
        return {"type": "error", "error": error, "request_id": f"req_{uuid.uuid4().hex}"}

    def response(self, path: str = "") -> JSONResponse:
        """OpenAI's shape, or Anthropic's for the Messages API's paths."""
        headers = {"WWW-Authenticate": "Bearer"} if self.status == 401 else {}
        if self.retry_after is not None:
            headers["Retry-After"] = str(self.retry_after)
        elif self.status in RETRY_AFTER:
            headers["Retry-After"] = RETRY_AFTER[self.status]
        if path.startswith(ANTHROPIC_PATHS):
            body = self.anthropic_body()
        else:
            body = self.body().model_dump()
        return JSONResponse(body, status_code=self.status, headers=headers)


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param, code)


def not_ready(message: str = "the engine is not ready", retry_after: int | None = None) -> APIError:
    return APIError(503, message, code="engine_not_ready", retry_after=retry_after)
