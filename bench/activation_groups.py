"""How finely the GGUF kernels' int8 activation rounding must go: simulated, on real text.

    python -m bench.activation_groups 256:1 32:1 16:1 256:2 16:0

Each argument is GROUP:PASSES: one scale per GROUP activation values, rounded PASSES times (the
second time what the first left; 0: not rounded at all, the ceiling). Every `quantization: gguf`
GEMM is replaced by its activations fake-quantized that way (amax / 127 per group, round to
nearest, clamp to +-127) times the float32 dequantized weights, so the numbers are the rounding's
alone, with the engine's bf16 stream and attention around it. Scored as `bench.quant_quality`
does: greedy top-1 agreement and perplexity against the float32 reference. The kernels themselves
round per 16 (`python -m bench.quant_quality --quantization gguf --decode-kernel` checks them).
"""

from __future__ import annotations

import argparse

import torch

from bench import quant_quality
from engine.kernels import gguf_ops
from engine.model.loader import load_model
from engine.model.quant import native
from engine.model.runner import ModelRunner

_rounding = {"group": 16, "passes": 1}


def fake_quantized(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] float32 -> (its int8 rounding per group, dequantized; what that rounding left)."""
    m, k = x.shape
    xg = x.view(m, k // group, group)
    amax = xg.abs().amax(-1, keepdim=True)
    inverse = torch.where(amax > 0, 127 / amax, torch.zeros_like(amax))
    rounded = torch.round(xg * inverse).clamp(-127, 127) * (amax / 127)
    return rounded.view(m, k), (xg - rounded).view(m, k)


def simulated_gemm(kernel: native.GgufKernel, x: torch.Tensor) -> torch.Tensor:  # [M, K] -> [M, N]
    weight = getattr(kernel, "_float32", None)
    if weight is None:
        weight = kernel._float32 = gguf_ops.dequantize(kernel.blocks, kernel.qtype)  # type: ignore[attr-defined]
    rest, total = x.float(), torch.zeros(x.shape, dtype=torch.float32)
    if _rounding["passes"] == 0:
        return rest @ weight.T
    for _ in range(_rounding["passes"]):
        part, rest = fake_quantized(rest, _rounding["group"])
        total += part
    return total @ weight.T


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("roundings", nargs="+", help="GROUP:PASSES, e.g. 256:1 16:1")
    ap.add_argument("--model", default="bundled:qwen2.5-coder-1.5b-instruct", help="a .gguf model")
    ap.add_argument("--positions", type=int, default=2000)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    native.PREFILL_CANDIDATES = ()  # no dense prompt path: every GEMM is simulated
    native.GgufKernel.__call__ = simulated_gemm  # type: ignore[method-assign]
    with torch.inference_mode():
        loaded = load_model(args.model, "gguf")
        seqs = quant_quality.quality_prompts(loaded, args.positions)
        ref = quant_quality.reference_scores(loaded, seqs)
        runner = ModelRunner(loaded, "cpu", "bfloat16", 16)
        for spec in args.roundings:
            group, passes = (int(v) for v in spec.split(":"))
            _rounding.update(group=group, passes=passes)
            ours = quant_quality.score(runner, seqs, f"per {group}, {passes} pass(es)")
            ppl = quant_quality.perplexity(ours) / quant_quality.perplexity(ref) - 1
            print(f"per {group} values, {passes} pass(es): top-1 "
                  f"{quant_quality.agreement(ours, ref):.2%}, perplexity {ppl:+.2%}", flush=True)  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
