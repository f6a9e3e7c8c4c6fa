"""`specserve serve`: one flag per settings key; flags override SPECSERVE_* and the --config file.

uvicorn starts first and answers /health with 503 while the engine loads in a thread. SIGTERM stops
admission (503 on /health and new requests; /live stays 200) and keeps listening while the running
requests finish, within shutdown_grace_s; then uvicorn closes its socket and the engine stops.
A stored response it cuts ends `failed` (server/responses/interrupted.py). A second signal skips
the wait.
"""

from __future__ import annotations

import argparse
import gc
import logging
import os
import signal
import sys
import threading
import time
import types
import typing
from pathlib import Path
from typing import Any

from server.settings import Settings, SettingsError

logger = logging.getLogger("specserve.serve")
# With no model named anywhere, `specserve serve` runs what `make serve` runs: the shipped default
# config (a checkout: the target and its EAGLE-3 head), or, in an installed package without configs/
# and heads/, the bundled pair of configs/pair.yaml.
DEFAULT_CONFIG = Path(__file__).resolve().parent.parent / "configs" / "default.yaml"
BUNDLED_PAIR: dict[str, Any] = {
    "model": "bundled:qwen2.5-coder-1.5b-instruct",
    "draft_model": "bundled:qwen2.5-coder-0.5b-instruct",
    "quantization": "gguf",
    "draft_quantization": "gguf",
    "draft_vocab_size": 65536,
    "draft_compile": False,
    "served_model_name": "qwen2.5-coder-1.5b-instruct",
    "speculative_method": "hybrid",
    "num_speculative_tokens": 3,
    "ngram_min": 2,
}


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "serve", help="run the OpenAI-compatible server", description=__doc__,
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )  # fmt: skip
    p.add_argument("--config", metavar="FILE", help="YAML file of settings (keys as the flags)")
    for name, info in Settings.model_fields.items():
        p.add_argument("--" + name.replace("_", "-"), dest=name, **_flag_kwargs(info))
    p.set_defaults(func=run)


def _flag_kwargs(info: Any) -> dict[str, Any]:
    """Flags keep strings (pydantic converts and names the key in errors); unset flags stay out."""
    kwargs: dict[str, Any] = {"default": argparse.SUPPRESS, "help": info.description}
    args = [a for a in typing.get_args(info.annotation) if a is not type(None)]
    base = args[0] if isinstance(info.annotation, types.UnionType) and len(args) == 1 else None
    annotation = base or info.annotation
    if annotation is bool:
        kwargs["action"] = argparse.BooleanOptionalAction
    elif typing.get_origin(annotation) is typing.Literal:
        kwargs["choices"] = typing.get_args(annotation)
    if not info.is_required() and info.default is not None:
        kwargs["help"] = f"{info.description} (default: {info.default})"
    return kwargs


def run(args: argparse.Namespace) -> int:
    flags = {k: v for k, v in vars(args).items() if k in Settings.model_fields}
    try:
        settings = load_settings(args.config, flags)
    except SettingsError as exc:
        print(f"specserve serve: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(
        level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    return serve(settings)


def load_settings(config: str | None, flags: dict[str, Any]) -> Settings:
    if config is not None or "model" in flags or "SPECSERVE_MODEL" in os.environ:
        return Settings.load(config, **flags)
    if DEFAULT_CONFIG.is_file():
        return Settings.load(DEFAULT_CONFIG, **flags)
    return Settings.load(None, **(BUNDLED_PAIR | flags))


def serve(settings: Settings) -> int:
    import uvicorn

    from engine.model.parallel.launch import torchrun_rank
    from engine.model.parallel.worker import torchrun_worker
    from server.app import create_app

    rank = torchrun_rank()
    if rank not in (None, 0):
        return torchrun_worker(settings.engine_config(), rank)
    failed: list[BaseException] = []
    groups: list[Any] = []  # the tensor-parallel group, once launched
    url = f"http://{settings.host}:{settings.port}"

    def on_rank_failure(reason: str) -> None:
        """A dead rank: stop serving (503, drain what can finish) and exit non-zero, for sure."""
        failed.append(RuntimeError(reason))
        os.kill(os.getpid(), signal.SIGTERM)
        backstop = threading.Timer(settings.shutdown_grace_s + 15, os._exit, args=(1,))
        backstop.daemon = True
        backstop.start()

    def load() -> Any:
        logger.info(
            "loading target model %s (%s on %s)", settings.model, settings.dtype, settings.device
        )
        if settings.speculative_method in ("draft", "hybrid"):
            logger.info(
                "speculation: %s, draft model %s", settings.speculative_method, settings.draft_model
            )
        if settings.speculative_method in ("ngram", "hybrid", "hybrid-eagle3"):
            logger.info(
                "speculation: n-gram proposer, n in [%d, %d]",
                settings.ngram_min,
                settings.ngram_max,
            )
        from engine.core.async_engine import AsyncLLM

        config = settings.engine_config()
        if config.tensor_parallel_size > 1:
            from engine.model.parallel.launch import launch

            groups.append(launch(config, on_rank_failure))
        engine = AsyncLLM.from_config(config, settings.model_name)
        _freeze_heap()
        return engine

    def on_load_error(exc: BaseException) -> None:
        failed.append(exc)
        server.should_exit = True

    app = create_app(
        None, settings, load=load, on_load_error=on_load_error,
        on_ready=lambda: logger.info("ready on %s (model %s)", url, settings.model_name),
    )  # fmt: skip
    config = uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        log_level=settings.log_level,
        timeout_graceful_shutdown=settings.shutdown_grace_s,  # type: ignore[arg-type]
        # A retry storm connects thousands of clients at once; connections beyond the listen
        # backlog lose their SYN and time out client-side (the openai SDK waits 5 s), so ask for
        # as much as the kernel allows (it caps this at net.core.somaxconn).
        backlog=65535,
    )
    server = _graceful_server(config, app.state.server)
    logger.info("listening on %s; /health answers 503 until the model is loaded", url)
    # uvicorn re-raises the signal after its graceful shutdown; a no-op handler underneath
    # turns that into a normal exit with status 0.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: None)
    server.run()
    if groups and not failed:
        groups[0].stop()
    if groups and failed:
        logging.shutdown()
        os._exit(1)  # skip gloo's teardown, which aborts when a peer is already gone
    return 1 if failed else 0


def _freeze_heap() -> None:
    """Leave the loaded engine's Python objects out of every later garbage collection.

    They live as long as the process (~580,000 of them with the bundled pair), and a full
    collection walks them all: 630-670 ms measured on this project's CPU host, with the engine's
    step and the event loop stalled, whenever enough long-lived objects (say, n-gram indexes of
    long requests) pile up to trigger one. Frozen, a full collection takes under a millisecond.
    vLLM freezes its start-up heap the same way. Only the server does this: a process that
    builds and drops engines (the tests) would never free a dropped engine's cycles."""
    gc.collect()
    frozen_before = gc.get_freeze_count()
    gc.freeze()
    logger.info(
        "froze %d start-up objects out of garbage collection", gc.get_freeze_count() - frozen_before
    )


def _graceful_server(config: Any, state: Any) -> Any:
    """uvicorn's server, but the app answers 503 from the moment a signal arrives and keeps its
    socket open while it drains, so probes and routers get answers instead of refused connections."""
    import uvicorn

    class Server(uvicorn.Server):
        def handle_exit(self, sig: int, frame: Any) -> None:
            if state.shutting_down:
                state.cut_unfinished()
                super().handle_exit(sig, frame)
                return
            logger.info("signal %d: no new requests; finishing the running ones", sig)
            state.shutting_down = True
            threading.Thread(
                target=self._exit_when_drained,
                args=(sig, frame),
                name="specserve-drain",
                daemon=True,
            ).start()

        def _exit_when_drained(self, sig: int, frame: Any) -> None:
            _wait_drained(state)
            state.cut_unfinished()  # what runs still is cut: its stored responses end failed
            super().handle_exit(sig, frame)

    return Server(config)


def _wait_drained(state: Any) -> None:
    deadline = time.monotonic() + state.settings.shutdown_grace_s
    while time.monotonic() < deadline:
        engine = state.engine
        if engine is None or not engine.is_alive or engine.num_unfinished_requests == 0:
            return
        time.sleep(0.05)
