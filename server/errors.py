"""OpenAI-shaped errors: `{"error": {"message", "type", "param", "code"}}` for every failure."""

from __future__ import annotations

from fastapi.responses import JSONResponse

from server.protocol import ErrorInfo, ErrorResponse

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


# Seconds a client (or router) should wait before retrying here: the queue drains in about a
# step; a loading or draining server takes longer, and a router retries elsewhere meanwhile.
RETRY_AFTER = {429: "1", 503: "5"}


class APIError(Exception):
    """Raised anywhere in request handling; the app turns it into an error response."""

    def __init__(
        self, status: int, message: str, param: str | None = None, code: str | None = None
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code

    def body(self) -> ErrorResponse:
        kind = _TYPES.get(self.status, "invalid_request_error")
        return ErrorResponse(
            error=ErrorInfo(message=self.message, type=kind, param=self.param, code=self.code)
        )

    def response(self) -> JSONResponse:
        headers = {"WWW-Authenticate": "Bearer"} if self.status == 401 else {}
        if self.status in RETRY_AFTER:
            headers["Retry-After"] = RETRY_AFTER[self.status]
        return JSONResponse(self.body().model_dump(), status_code=self.status, headers=headers)


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param, code)


def not_ready(message: str = "the engine is not ready") -> APIError:
    return APIError(503, message, code="engine_not_ready")
