"""The measurements of scripts/gpu_check.sh: the device, the linear kernels, the forward costs.

    python -m bench.gpu_check env
    python -m bench.gpu_check kernels --device cuda --out kernels.md
    python -m bench.gpu_check shapes --device cuda --out shapes.md

`kernels` times one linear layer at the bundled target's shapes (Qwen2.5-1.5B) for M = 1, 16, 64
and 512 rows: bf16 `F.linear` against the int4 and int8 kernels the device has. `shapes` builds
the bundled pair's shapes with random bf16 weights (no download: the speed of a forward does not
depend on the values) and times `ModelRunner.forward` at 1..16 rows behind a 512-token context,
next to the weight-bandwidth bound of the device, and the speculative speedup those costs imply at
a given acceptance (a projection, not a measurement). On `--device cpu` every step runs at small
shapes in float32 (the dry run CI takes).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, PretrainedConfig, Qwen2Config

from engine.model import device as devices
from engine.model.loader import LoadedModel
from engine.model.quant.formats import quantize_int4, quantize_int8
from engine.model.quant.kernels import Int4CpuKernel, Int4CudaKernel, Int8Kernel, Kernel
from engine.model.runner import ForwardInput, ModelRunner

# (name, N, K) of the bundled target's matrices, Qwen2.5-1.5B: fused q/k/v, o, fused gate/up,
# down and the head over its 151,936-token vocabulary.
TARGET_SHAPES = (
    ("qkv", 2048, 1536), ("o", 1536, 1536), ("gate_up", 17920, 1536), ("down", 1536, 8960),
    ("head", 151936, 1536),
)  # fmt: skip
KERNEL_ROWS = (1, 16, 64, 512)
STEP_ROWS = (1, 2, 4, 8, 16)
CONTEXT = 512
ACCEPTANCE = (0.6, 0.8)  # per-draft acceptance rates the projection is shown at
K = 3


@dataclass(frozen=True)
class Plan:
    """What to run on this device: the real shapes on a GPU, small ones in the CPU dry run."""

    device: torch.device
    dtype: torch.dtype
    scale: int  # matrix sides divided by this
    repeats: int
    kernel_rows: tuple[int, ...]
    step_rows: tuple[int, ...]

    @staticmethod
    def for_device(device: str) -> Plan:
        if devices.is_cuda(device):
            return Plan(torch.device(device), torch.bfloat16, 1, 20, KERNEL_ROWS, STEP_ROWS)
        return Plan(torch.device(device), torch.float32, 16, 1, (1,), (1, 4))


def log(msg: str) -> None:
    print(f"[gpu-check] {msg}", file=sys.stderr, flush=True)


def time_call(
    fn: Callable[[], object], device: torch.device, repeats: int, chained: int = 1
) -> float:
    """Median seconds of one call after a warm-up, the device idle before and finished after
    each sample. `chained`: calls per sample, back to back (a kernel inside a forward follows
    others without a sync: its launch overlaps the previous kernel's work)."""
    fn()
    samples = []
    for _ in range(repeats):
        devices.synchronize(device)
        started = time.perf_counter()
        for _ in range(chained):
            fn()
        devices.synchronize(device)
        samples.append((time.perf_counter() - started) / chained)
    return statistics.median(samples)


# ---- env -----------------------------------------------------------------------------------


def env_lines() -> list[str]:
    lines = [f"python {sys.version.split()[0]}", f"torch {torch.__version__}"]
    lines.append(f"torch.version.cuda {torch.version.cuda}")
    lines.append(f"cuda available {torch.cuda.is_available()}")
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        free, total = devices.mem_get_info("cuda:0")
        lines += [
            f"device {props.name}, capability {props.major}.{props.minor}, "
            f"{props.multi_processor_count} SMs",
            f"memory {free / 2**30:.1f} GiB free of {total / 2**30:.1f} GiB",
            f"bf16 supported {torch.cuda.is_bf16_supported()}",
            f"flash SDPA on a causal GQA prefill: {flash_prefill_runs()}",
        ]
    return lines


def flash_prefill_runs() -> str:
    """Whether the flash kernel takes the prefill attention's call (is_causal, GQA, no mask)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q = torch.randn(1, 12, 512, 128, device="cuda", dtype=torch.bfloat16)
    kv = torch.randn(1, 2, 512, 128, device="cuda", dtype=torch.bfloat16)
    try:
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            F.scaled_dot_product_attention(q, kv, kv, is_causal=True, enable_gqa=True)
        return "yes"
    except RuntimeError as err:
        return f"no ({str(err).splitlines()[0][:120]})"


# ---- kernels -------------------------------------------------------------------------------


def kernel_candidates(
    w: torch.Tensor, plan: Plan
) -> dict[str, Callable[[torch.Tensor], torch.Tensor]]:
    """bf16 (or the dry run's float32) F.linear, and each quantized kernel that builds here."""
    dense = w.to(plan.device, plan.dtype)
    out: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {"dense": lambda x: F.linear(x, dense)}
    int4 = Int4CudaKernel if plan.device.type == "cuda" else Int4CpuKernel
    makers: dict[str, Callable[[], Kernel]] = {
        "int4 g32": lambda: int4(quantize_int4(w, 32), plan.device),
        "int8 weight-only": lambda: Int8Kernel(quantize_int8(w), plan.device),
    }
    for name, make in makers.items():
        try:
            out[name] = make()
        except (RuntimeError, NotImplementedError, ValueError) as err:  # op or shape missing
            log(f"{name}: {type(err).__name__}: {str(err)[:100]}")
    return out


def kernel_table(plan: Plan) -> str:
    header = "| matrix | N x K | M | " + " | ".join(["dense ms", "int4 g32 ms", "int8 ms"]) + " |"
    rows = [header, "|---|---|---|---|---|---|"]
    for name, n, k in TARGET_SHAPES:
        n, k = n // plan.scale, k // plan.scale
        w = torch.randn(n, k, generator=torch.Generator().manual_seed(0)) * 0.02
        kernels = kernel_candidates(w, plan)
        for m in plan.kernel_rows:
            x = torch.randn(m, k).to(plan.device, plan.dtype)
            cells = []
            for label in ("dense", "int4 g32", "int8 weight-only"):
                kernel = kernels.get(label)
                cost = "n/a" if kernel is None else _ms(kernel, x, plan)
                cells.append(cost)
            rows.append(f"| {name} | {n} x {k} | {m} | " + " | ".join(cells) + " |")
        log(f"kernels: {name} done")
    return "\n".join(rows) + "\n"


def _ms(kernel: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, plan: Plan) -> str:
    xin = x if plan.dtype == torch.float32 else x.to(torch.bfloat16)
    try:
        chained = 10 if plan.device.type == "cuda" else 1
        return f"{1000 * time_call(lambda: kernel(xin), plan.device, plan.repeats, chained):.3f}"
    except (RuntimeError, NotImplementedError) as err:
        log(f"kernel failed: {type(err).__name__}: {str(err)[:100]}")
        return "failed"


# ---- forward costs at the bundled pair's shapes ----------------------------------------------


def pair_configs(scale: int) -> dict[str, PretrainedConfig]:
    """Qwen2.5-Coder-1.5B and -0.5B shapes (the dry run: 2 layers, sides / scale)."""
    shapes = {  # hidden, layers, heads, kv heads, intermediate
        "target 1.5B": (1536, 28, 12, 2, 8960),
        "draft 0.5B": (896, 24, 14, 2, 4864),
    }
    configs: dict[str, PretrainedConfig] = {}
    for name, (hidden, layers, heads, kv_heads, inter) in shapes.items():
        small = scale > 1
        configs[name] = Qwen2Config(
            vocab_size=151936 // scale, hidden_size=hidden // scale if not small else 64,
            num_hidden_layers=2 if small else layers, num_attention_heads=4 if small else heads,
            num_key_value_heads=kv_heads, intermediate_size=inter // scale,
            max_position_embeddings=4096 if small else 32768, tie_word_embeddings=True,
        )  # fmt: skip
    return configs


@dataclass(frozen=True)
class RandomModel(LoadedModel):
    """A LoadedModel whose weights are drawn at load, N(0, 0.02), under transformers' names,
    on the device that will hold them (no host work for a 1.5B model's 3 GB)."""

    draw_on: str = "cpu"

    def iter_weights(self) -> Iterator[tuple[str, torch.Tensor]]:  # type: ignore[override]
        with torch.device("meta"):
            names = AutoModelForCausalLM.from_config(self.hf_config).named_parameters()
        for name, param in names:
            yield name, torch.randn(param.shape, device=self.draw_on).mul_(0.02)


def random_runner(name: str, config: PretrainedConfig, plan: Plan) -> ModelRunner:
    no_tokenizer: Any = None  # a forward needs none
    loaded = RandomModel(
        name, config, no_tokenizer, Path("."), "Qwen2ForCausalLM", draw_on=str(plan.device)
    )
    dtype = "bfloat16" if plan.dtype == torch.bfloat16 else "float32"
    runner = ModelRunner(loaded, str(plan.device), dtype, block_size=16)
    runner.allocate_kv_cache(-(-(CONTEXT + max(plan.step_rows)) // 16))
    return runner


def forward_ms(runner: ModelRunner, rows: int, plan: Plan) -> float:
    blocks = list(range(-(-(CONTEXT + rows) // 16)))
    inputs = [
        ForwardInput([(7 * j + 11) % runner.vocab_size for j in range(rows)], CONTEXT, blocks, rows)
    ]
    return 1000 * time_call(lambda: runner.forward(inputs), plan.device, plan.repeats)


def copy_bandwidth(plan: Plan) -> float:
    """Bytes per second of a device-to-device copy, counting bytes read and written."""
    n = (1 << 30) if plan.device.type == "cuda" else (1 << 24)
    src = torch.empty(n, dtype=torch.uint8, device=plan.device)
    dst = torch.empty_like(src)
    return 2 * n / time_call(lambda: dst.copy_(src), plan.device, plan.repeats)


def shapes_report(plan: Plan) -> str:
    bandwidth = copy_bandwidth(plan)
    lines = [f"device-to-device copy: {bandwidth / 1e12:.2f} TB/s (read + write)", ""]
    rows = plan.step_rows
    header = " | ".join(f"{m} rows ms" for m in rows)
    lines += [
        f"| model | weights GiB | bound ms | {header} |",
        "|---|---|---|" + "---|" * len(rows),
    ]
    costs: dict[str, dict[int, float]] = {}
    for name, config in pair_configs(plan.scale).items():
        runner = random_runner(name, config, plan)
        costs[name] = {m: forward_ms(runner, m, plan) for m in rows}
        size = runner.weights.weight_bytes
        bound = 1000 * size / bandwidth  # one read of every weight
        cells = " | ".join(f"{costs[name][m]:.2f}" for m in rows)
        lines.append(f"| {name} | {size / 2**30:.2f} | {bound:.2f} | {cells} |")
        log(f"shapes: {name} done")
        del runner
    lines += ["", projection(costs["target 1.5B"], costs["draft 0.5B"])]
    return "\n".join(lines) + "\n"


def projection(target: dict[int, float], draft: dict[int, float]) -> str:
    """Speedup of k drafts at acceptance a over plain decode, batch 1, from the costs above:
    E[tokens] = (1 - a^(k+1)) / (1 - a) per (a verify of k+1 rows + k draft forwards)."""
    verify = min((m for m in target if m >= K + 1), default=max(target))
    out = [f"Projected batch-1 speedup, k = {K} (not measured: acceptance assumed):"]
    for a in ACCEPTANCE:
        tokens = (1 - a ** (K + 1)) / (1 - a)
        step = target[verify] + K * draft[1]
        out.append(f"- acceptance {a}: {tokens * target[1] / step:.2f}x")
    return "\n".join(out)


PARTS: dict[str, tuple[str, Callable[[Plan], str]]] = {  # name: (file, what writes it)
    "env": ("env.txt", lambda plan: "\n".join(env_lines()) + "\n"),
    "kernels": ("kernels.md", kernel_table),
    "shapes": ("shapes.md", shapes_report),
}


def run_part(name: str, plan: Plan, out_dir: Path | None, report: Path | None) -> bool:
    """One part, its text appended to its file under out_dir; one line in the report."""
    file, make = PARTS[name]
    started = time.perf_counter()
    try:
        text, ok = make(plan), True
    except Exception as err:  # noqa: BLE001 - a failed part is reported, the others still run
        text, ok = f"{name} failed: {type(err).__name__}: {err}\n", False
    print(text, end="")
    if out_dir is not None:
        with open(out_dir / file, "a") as f:
            f.write(text)
    if report is not None:
        with open(report, "a") as f:
            state = "ok" if ok else "FAILED"
            f.write(f"  - {name}: {state} ({time.perf_counter() - started:.0f} s)\n")
    return ok


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("what", choices=(*PARTS, "all"))
    p.add_argument("--device", default="cuda")
    p.add_argument("--out-dir", type=Path, help="append each part to its file here")
    p.add_argument("--report", type=Path, help="append a line per part to this file")
    args = p.parse_args(argv)
    plan = Plan.for_device(args.device)
    devices.make_current(plan.device)
    names = list(PARTS) if args.what == "all" else [args.what]
    failed = [n for n in names if not run_part(n, plan, args.out_dir, args.report)]
    return len(failed)


if __name__ == "__main__":
    sys.exit(main())
