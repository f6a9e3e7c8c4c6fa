"""Routes of Anthropic's Messages API: create (whole or streamed) and count_tokens. Errors on
these paths take Anthropic's shape (server.errors); `x-api-key` is accepted as a key and the
`anthropic-version` header is tolerated, not required."""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response

from server.messages.protocol import CountTokensRequest, MessagesRequest
from server.messages.serving import AnthropicServingMessages
from server.openai.serving import Stream
from server.request_body import json_body

MessagesBody = Annotated[MessagesRequest, Depends(json_body(MessagesRequest))]
CountBody = Annotated[CountTokensRequest, Depends(json_body(CountTokensRequest))]


def messages_routes(
    serving: Callable[[Request], AnthropicServingMessages],
    sse: Callable[[AnthropicServingMessages, Stream], Response],
) -> APIRouter:
    router = APIRouter()
    Serving = Depends(serving)  # a default: an Annotated alias local to here would not resolve

    @router.post("/v1/messages")
    async def create(
        req: MessagesBody, raw: Request, s: AnthropicServingMessages = Serving
    ) -> Response:
        s.check_model(req.model)
        chat, jobs = await s.prepare(req)  # admitted there (chat_jobs), or a 429
        if req.stream:
            return sse(s, s.stream_message(chat, jobs))
        return JSONResponse((await s.create_message(chat, jobs, raw)).model_dump())

    @router.post("/v1/messages/count_tokens")
    async def count_tokens(req: CountBody, s: AnthropicServingMessages = Serving) -> dict[str, int]:
        s.check_model(req.model)
        return s.count_tokens(req)

    return router
