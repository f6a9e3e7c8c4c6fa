"""The engine thread: loading, calibration and every step on one thread, and one OpenMP pool."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest

from engine.config import EngineConfig, SpeculativeConfig
from engine.core.async_engine import AsyncLLM
from engine.core.engine_thread import EngineThread
from engine.core.llm_engine import LLMEngine
from engine.model.runner import ModelRunner
from engine.sample.sampling_params import SamplingParams

ROOT = Path(__file__).resolve().parents[3]


def _config(model_dir: Path, **kw: object) -> EngineConfig:
    base: dict[str, object] = dict(
        model=str(model_dir), dtype="float32", block_size=4, num_kv_blocks=128,
        speculative=SpeculativeConfig(method="ngram", num_speculative_tokens=2),
    )  # fmt: skip
    return EngineConfig(**(base | kw))  # type: ignore[arg-type]


async def _generate(engine: AsyncLLM, n: int) -> list[int]:
    await engine.start()
    params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
    out: list[int] = []
    async for item in engine.generate("r0", [5, 6, 7, 8, 9, 10], params):
        out += item.new_token_ids
    await engine.shutdown()
    return out


def test_load_calibration_and_steps_run_on_one_engine_thread(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: dict[str, set[int]] = {"init": set(), "forward": set(), "step": set()}

    def record(name: str, fn):  # type: ignore[no-untyped-def]
        def wrapper(*args, **kwargs):  # type: ignore[no-untyped-def]
            seen[name].add(threading.get_ident())
            return fn(*args, **kwargs)

        return wrapper

    monkeypatch.setattr(LLMEngine, "__init__", record("init", LLMEngine.__init__))
    monkeypatch.setattr(LLMEngine, "step", record("step", LLMEngine.step))
    monkeypatch.setattr(ModelRunner, "forward", record("forward", ModelRunner.forward))
    engine = AsyncLLM.from_config(_config(tiny_model_dir))  # adaptive k: calibrates at load
    tokens = asyncio.run(_generate(engine, 4))
    assert len(tokens) == 4
    threads = seen["init"] | seen["forward"] | seen["step"]
    assert len(threads) == 1 and seen["step"], seen
    assert threading.get_ident() not in threads


def test_engine_built_elsewhere_still_steps_on_a_thread_of_its_own(tiny_model_dir: Path) -> None:
    engine = AsyncLLM(LLMEngine(_config(tiny_model_dir)))
    assert not engine.is_alive
    assert len(asyncio.run(_generate(engine, 3))) == 3
    assert not engine.is_alive


def test_a_failed_build_raises_on_the_caller() -> None:
    def build() -> int:
        raise FileNotFoundError("no such model")

    with pytest.raises(FileNotFoundError, match="no such model"):
        EngineThread(build).start_and_build()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/task")
def test_the_process_holds_one_openmp_pool(tiny_model_dir: Path) -> None:
    """With 2 torch threads, loading and stepping start the engine thread and its OpenMP worker
    (named after it) and no thread on the caller's side: no second pool (see engine_thread)."""
    script = textwrap.dedent(f"""
        import asyncio, os, sys
        sys.path[:0] = [{str(Path(__file__).resolve().parent)!r}, {str(ROOT / "tests")!r}]
        from test_engine_thread import _config, _generate
        from engine.core.async_engine import AsyncLLM
        def names():
            return [open(f"/proc/self/task/{{t}}/comm").read().strip()
                    for t in os.listdir("/proc/self/task")]
        def others():
            return sum(not n.startswith("specserve-engi") for n in names())
        before = others()
        engine = AsyncLLM.from_config(_config({str(tiny_model_dir)!r}, num_threads=2))
        async def run():
            await engine.start()
            from engine.sample.sampling_params import SamplingParams
            params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
            async for _ in engine.generate("r", list(range(5, 60)), params):
                pass
            print(others() - before, sum(n.startswith("specserve-engi") for n in names()))
        asyncio.run(run())
    """)
    out = subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr[-2000:]
    new_elsewhere, engine_threads = map(int, out.stdout.split()[-2:])
    assert engine_threads >= 2  # the engine thread and its pool's worker (torch may add one)
    assert new_elsewhere == 0
