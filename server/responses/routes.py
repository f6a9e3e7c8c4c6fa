"""Routes of the Responses API: create (whole, streamed or background), get, delete, list input
items, cancel. Every stored response belongs to the API key that created it."""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Depends, Query, Request
from fastapi.responses import JSONResponse, Response

from server.openai.serving import Stream
from server.request_body import json_body
from server.responses.protocol import DeletedResponse, ResponseItemList, ResponsesRequest
from server.responses.serving import OpenAIServingResponses
from server.responses.store import owner_of

ResponsesBody = Annotated[ResponsesRequest, Depends(json_body(ResponsesRequest))]


def presented_key(request: Request) -> str | None:
    """The API key the client sent: `Authorization: Bearer <key>` or `x-api-key: <key>`."""
    auth = request.headers.get("authorization", "")
    if auth.lower().startswith("bearer "):
        return auth[7:].strip()
    return request.headers.get("x-api-key")


def responses_routes(
    serving: Callable[[Request], OpenAIServingResponses],
    sse: Callable[[OpenAIServingResponses, Stream], Response],
    keyed: bool,
) -> APIRouter:
    """`serving` gives the ready endpoint (or raises 503); `keyed`: an API key is required, so
    stored responses are kept apart by key."""
    router = APIRouter()

    def owner(request: Request) -> str:
        return owner_of(presented_key(request)) if keyed else ""

    # Dependencies as defaults: an Annotated alias local to this function would not resolve.
    Serving, Owner = Depends(serving), Depends(owner)

    @router.post("/v1/responses")
    async def create(
        req: ResponsesBody, raw: Request, s: OpenAIServingResponses = Serving, who: str = Owner
    ) -> Response:
        s.check_model(req.model)
        prepared = await s.prepare(req, who)
        if req.stream:
            return sse(s, s.stream_response(prepared))
        return JSONResponse((await s.create_response(prepared, raw)).model_dump())

    @router.get("/v1/responses/{response_id}")
    async def get(
        response_id: str, s: OpenAIServingResponses = Serving, who: str = Owner
    ) -> dict[str, Any]:
        return s.get(response_id, who).response

    @router.delete("/v1/responses/{response_id}")
    async def delete(
        response_id: str, s: OpenAIServingResponses = Serving, who: str = Owner
    ) -> DeletedResponse:
        s.delete(response_id, who)
        return DeletedResponse(id=response_id)

    @router.get("/v1/responses/{response_id}/input_items")
    async def input_items(
        response_id: str,
        s: OpenAIServingResponses = Serving,
        who: str = Owner,
        limit: Annotated[int, Query(ge=1, le=100)] = 20,
        order: Literal["asc", "desc"] = "desc",
        after: str | None = None,
    ) -> ResponseItemList:
        return s.input_items(response_id, who, limit, order, after)

    @router.post("/v1/responses/{response_id}/cancel")
    async def cancel(
        response_id: str, s: OpenAIServingResponses = Serving, who: str = Owner
    ) -> dict[str, Any]:
        return await s.cancel(response_id, who)

    return router
