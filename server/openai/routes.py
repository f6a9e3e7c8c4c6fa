"""Routes of OpenAI's completions and chat, and the model's own information: `/v1/models`,
`/tokenize`, `/detokenize`, `/tokenizer_info`. Handlers parse (pydantic), check the model name and
hand over to the serving objects; nothing else happens here."""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response

from server.errors import bad_request
from server.openai.chat import OpenAIServingChat
from server.openai.completions import OpenAIServingCompletion
from server.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from server.openai.protocol_out import ModelCard, ModelList
from server.openai.serving import OpenAIServing, Stream
from server.request_body import json_body

CompletionBody = Annotated[CompletionRequest, Depends(json_body(CompletionRequest))]
ChatBody = Annotated[ChatCompletionRequest, Depends(json_body(ChatCompletionRequest))]
TokenizeBody = Annotated[TokenizeRequest, Depends(json_body(TokenizeRequest))]
DetokenizeBody = Annotated[DetokenizeRequest, Depends(json_body(DetokenizeRequest))]


def openai_routes(
    completions: Callable[[Request], OpenAIServingCompletion],
    chat: Callable[[Request], OpenAIServingChat],
    sse: Callable[[OpenAIServing, Stream], Response],
    model_card: Callable[[OpenAIServing], ModelCard],
) -> APIRouter:
    """`completions` and `chat` give the ready endpoints (or raise 503); `model_card` describes
    the served model for `/v1/models`."""
    router = APIRouter()
    Completions = Depends(
        completions
    )  # defaults: an Annotated alias local to here would not resolve
    Chat = Depends(chat)

    @router.post("/v1/completions")
    async def create_completion(
        req: CompletionBody, raw: Request, s: OpenAIServingCompletion = Completions
    ) -> Response:
        s.check_model(req.model)
        s.refuse_early(req)
        if req.stream:
            return sse(s, await s.create_stream(req))
        return JSONResponse((await s.create(req, raw)).model_dump())

    @router.post("/v1/chat/completions")
    async def create_chat(req: ChatBody, raw: Request, s: OpenAIServingChat = Chat) -> Response:
        s.check_model(req.model)
        if req.stream:
            return sse(s, await s.create_stream(req))
        return JSONResponse((await s.create(req, raw)).model_dump())

    @router.get("/v1/models")
    async def models(s: OpenAIServingChat = Chat) -> ModelList:
        return ModelList(data=[model_card(s)])

    @router.post("/tokenize")
    async def tokenize(req: TokenizeBody, s: OpenAIServingChat = Chat) -> dict[str, Any]:
        s.check_model(req.model)
        if req.messages is not None:
            ids = s.tokenizer.encode(s.chat_prompt(req), add_special_tokens=False)
        else:
            ids = s.tokenizer.encode(req.prompt, add_special_tokens=req.add_special_tokens)
        return {"tokens": ids, "count": len(ids), "max_model_len": s.max_model_len}

    @router.post("/detokenize")
    async def detokenize(req: DetokenizeBody, s: OpenAIServingChat = Chat) -> dict[str, Any]:
        s.check_model(req.model)
        try:
            return {"prompt": s.tokenizer.decode(req.tokens)}
        except (ValueError, IndexError, TypeError, OverflowError) as exc:
            raise bad_request(f"cannot decode these tokens: {exc}", "tokens") from None

    @router.get("/tokenizer_info")
    async def tokenizer_info(s: OpenAIServingChat = Chat) -> dict[str, Any]:
        return _tokenizer_info(s)

    return router


def _tokenizer_info(s: OpenAIServing) -> dict[str, Any]:
    tok = s.tokenizer
    return {
        "tokenizer_class": type(tok).__name__,
        "vocab_size": s.vocab_size,
        "model_max_length": s.max_model_len,
        "eos_token": tok.eos_token,
        "eos_token_id": tok.eos_token_id,
        "bos_token": tok.bos_token,
        "bos_token_id": tok.bos_token_id,
        "pad_token": tok.pad_token,
        "pad_token_id": tok.pad_token_id,
        "chat_template": getattr(tok, "chat_template", None),
        "add_bos_token": getattr(tok, "add_bos_token", None),
    }
