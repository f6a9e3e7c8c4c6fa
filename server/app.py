"""The FastAPI app: the engine's life (load, start, drain), one room of routes per API
(`server/openai`, `server/responses`, `server/messages`) and the playground, the open routes
(`/health`, `/live`, `/metrics`, `/version`), errors in each API's shape, and the API key."""

from __future__ import annotations

import asyncio
import logging
import secrets
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from functools import partial
from importlib.metadata import PackageNotFoundError, version
from typing import TYPE_CHECKING, Annotated, Any, TypeVar

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from sse_starlette import EventSourceResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Receive, Scope, Send

from engine.sample import structured
from server.admission import Admission, AdmissionConfig
from server.errors import APIError, not_ready
from server.messages.routes import messages_routes
from server.messages.serving import AnthropicServingMessages
from server.metrics import CONTENT_TYPE, Metrics
from server.openai.chat import OpenAIServingChat
from server.openai.completions import OpenAIServingCompletion
from server.openai.protocol_out import ModelCard, ModelWeights
from server.openai.routes import openai_routes
from server.openai.serving import ClientDisconnected, OpenAIServing, Stream, as_api_error
from server.playground import add_playground, is_open_path
from server.request_body import validation_error
from server.responses.routes import responses_routes
from server.responses.serving import OpenAIServingResponses
from server.settings import Settings

if TYPE_CHECKING:
    from engine.core.async_engine import AsyncLLM

logger = logging.getLogger("specserve.server")
OPEN_PATHS = ("/health", "/live", "/metrics")
# Liveness: the process can serve or is draining; a dead engine or failed load wants a restart.
LIVE_STATUSES = ("loading", "ready", "shutting_down")
T = TypeVar("T")


@dataclass(frozen=True)
class Endpoints:
    """One serving object per endpoint, all on the same engine."""

    completions: OpenAIServingCompletion
    chat: OpenAIServingChat
    responses: OpenAIServingResponses
    messages: AnthropicServingMessages

    @classmethod
    def build(
        cls, engine: AsyncLLM, settings: Settings, metrics: Metrics, admission: Admission
    ) -> Endpoints:
        endpoints = cls(
            OpenAIServingCompletion(engine, settings, metrics),
            OpenAIServingChat(engine, settings, metrics),
            OpenAIServingResponses(engine, settings, metrics),
            AnthropicServingMessages(engine, settings, metrics),
        )
        for serving in (endpoints.completions, endpoints.chat, endpoints.responses):
            serving.admission = admission  # one queue, whichever API a request came through
        endpoints.messages.admission = admission
        return endpoints


@dataclass
class ServerState:
    """What the routes share; `serving` is set once the engine is loaded and started."""

    settings: Settings
    metrics: Metrics
    admission: Admission
    engine: AsyncLLM | None = None
    serving: Endpoints | None = None
    shutting_down: bool = False
    load_error: str | None = None
    background: set[asyncio.Task[Any]] = field(default_factory=set)
    on_ready: Callable[[], None] | None = None

    @property
    def status(self) -> str:
        if self.shutting_down:
            return "shutting_down"
        if self.load_error is not None:
            return "failed"
        if self.serving is None or self.engine is None:
            return "loading"
        return "ready" if self.engine.is_alive else "dead"

    def cut_unfinished(self) -> None:
        """The grace period is over: a stored response cut from now on ends failed."""
        if self.serving is not None:
            self.serving.responses.stopping = True


def create_app(
    engine: AsyncLLM | None,
    settings: Settings,
    load: Callable[[], AsyncLLM] | None = None,
    on_load_error: Callable[[BaseException], None] | None = None,
    on_ready: Callable[[], None] | None = None,
) -> FastAPI:
    """The app owns the engine's life: it starts it (after `load()` in a thread if `engine` is None,
    answering 503 meanwhile) and shuts it down."""
    metrics = Metrics(settings.model_name, settings.metrics_compat)
    admission = Admission(AdmissionConfig.from_settings(settings), metrics)
    state = ServerState(settings, metrics, admission, on_ready=on_ready)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if engine is not None:
            await _attach(state, engine)
        elif load is not None:
            task = asyncio.create_task(_load_and_attach(state, load, on_load_error))
            state.background.add(task)
        yield
        state.shutting_down = True
        state.cut_unfinished()
        for task in state.background:
            task.cancel()
        if state.engine is not None:
            await state.engine.shutdown(grace_s=settings.shutdown_grace_s)
        if state.serving is not None:
            await state.serving.responses.close()

    app = FastAPI(title="specserve", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.server = state
    _add_error_handlers(app)
    sse = partial(_sse, settings=settings)
    card = partial(_model_card, state)
    app.include_router(
        openai_routes(_ready(lambda e: e.completions), _ready(lambda e: e.chat), sse, card)
    )
    app.include_router(responses_routes(_ready(lambda e: e.responses), sse, bool(settings.api_key)))
    app.include_router(messages_routes(_ready(lambda e: e.messages), sse))
    app.include_router(_open_routes(state))
    if settings.playground:
        add_playground(app)
    if settings.api_key:
        app.add_middleware(BearerAuth, api_key=settings.api_key)
    return app


async def _attach(state: ServerState, engine: AsyncLLM) -> None:
    engine.add_step_listener(state.metrics.on_step)
    num_blocks = getattr(engine, "num_kv_blocks", None)
    if isinstance(num_blocks, int):
        state.metrics.set_cache_config(state.settings.block_size, num_blocks)
    warm = asyncio.create_task(asyncio.to_thread(structured.warm_up, engine.tokenizer))
    state.background.add(warm)
    await engine.start()
    state.engine = engine
    serving = Endpoints.build(engine, state.settings, state.metrics, state.admission)
    # Before /health reports ready: the responses an earlier process left unfinished end failed.
    await asyncio.to_thread(serving.responses.fail_interrupted)
    state.serving = serving
    if state.on_ready is not None:
        state.on_ready()


async def _load_and_attach(
    state: ServerState,
    load: Callable[[], AsyncLLM],
    on_error: Callable[[BaseException], None] | None,
) -> None:
    try:
        await _attach(state, await asyncio.to_thread(load))
    except Exception as exc:
        state.load_error = f"{type(exc).__name__}: {exc}"
        logger.error("loading the engine failed: %s", state.load_error)
        if on_error is not None:
            on_error(exc)


# ---------------------------------------------------------------------------- routes


def ready_serving(request: Request) -> Endpoints:
    state: ServerState = request.app.state.server
    advice = state.admission.retry_after_unavailable
    if state.shutting_down:
        raise not_ready("the server is shutting down", advice())
    if state.serving is None:
        raise not_ready(state.load_error or "the model is still loading", advice())
    return state.serving


Serving = Annotated[Endpoints, Depends(ready_serving)]


def _ready(pick: Callable[[Endpoints], T]) -> Callable[[Request], T]:
    """A dependency giving one endpoint's serving object once the server is ready."""

    def serving(request: Request) -> T:
        return pick(ready_serving(request))

    return serving


def _open_routes(state: ServerState) -> APIRouter:
    router = APIRouter()

    @router.get("/health")
    async def health() -> Response:
        """Readiness: 200 only while new requests are taken."""
        return _status_response(state, state.status == "ready")

    @router.get("/live")
    async def live() -> Response:
        """Liveness: 200 while loading, serving or draining."""
        return _status_response(state, state.status in LIVE_STATUSES)

    @router.get("/version")
    async def version_route() -> dict[str, str]:
        return {"version": _version()}

    @router.get("/metrics")
    async def metrics() -> Response:
        if state.engine is not None and state.status == "ready":
            state.metrics.refresh_from(state.engine)
        return Response(state.metrics.render(), media_type=CONTENT_TYPE)

    return router


def _status_response(state: ServerState, ok: bool) -> Response:
    headers = {} if ok else {"Retry-After": str(state.admission.retry_after_unavailable())}
    return JSONResponse({"status": state.status}, status_code=200 if ok else 503, headers=headers)


def _sse(s: OpenAIServing, stream: Stream, settings: Settings) -> EventSourceResponse:
    async def on_close(_: Any) -> None:
        for request_id in stream.request_ids:
            await s.abort(request_id)

    return EventSourceResponse(
        stream.events,
        sep="\n",
        client_close_handler_callable=on_close,
        shutdown_grace_period=settings.shutdown_grace_s,
    )


def _version() -> str:
    try:
        return version("specserve")
    except PackageNotFoundError:
        return "0.1.0"


# ---------------------------------------------------------------------------- errors and auth


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError) -> Response:
        return exc.response(request.url.path)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError) -> Response:
        return validation_error(exc.errors()).response(request.url.path)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> Response:
        return APIError(exc.status_code, str(exc.detail)).response(request.url.path)

    @app.exception_handler(ClientDisconnected)
    async def disconnected(_: Request, exc: ClientDisconnected) -> Response:
        return Response(status_code=499)

    @app.exception_handler(Exception)
    async def anything(request: Request, exc: Exception) -> Response:
        return as_api_error(exc).response(request.url.path)


class BearerAuth:
    """401 unless `Authorization: Bearer <api_key>` or `x-api-key: <api_key>` (Anthropic's
    clients); /health, /live and /metrics stay open."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self.bearer = f"Bearer {api_key}".encode()
        self.key = api_key.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "")
        if scope["type"] != "http" or path in OPEN_PATHS or is_open_path(path):
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        bearer_ok = secrets.compare_digest(headers.get(b"authorization", b""), self.bearer)
        key_ok = secrets.compare_digest(headers.get(b"x-api-key", b""), self.key)
        if bearer_ok or key_ok:
            await self.app(scope, receive, send)
            return
        error = APIError(401, "invalid or missing API key", code="invalid_api_key")
        await error.response(scope["path"])(scope, receive, send)


def _model_card(state: ServerState, s: OpenAIServing) -> ModelCard:
    weights = _model_weights(state.engine)
    return ModelCard(
        id=s.model_name,
        root=state.settings.model,
        max_model_len=s.max_model_len,
        quantization=weights[0].quantization if weights else None,
        weights=weights or None,
    )


def _model_weights(engine: AsyncLLM | None) -> list[ModelWeights]:
    """The target's and the draft's weight formats and sizes (empty before the engine loads)."""
    core = getattr(engine, "engine", None)  # the LLMEngine inside AsyncLLM (test fakes have none)
    if core is None:
        return []
    runners = [core.target, core.draft]
    return [
        ModelWeights(
            model=r.loaded.name,
            quantization=r.weights.label,
            weight_bytes=r.weights.weight_bytes,
        )
        for r in runners
        if r is not None
    ]
