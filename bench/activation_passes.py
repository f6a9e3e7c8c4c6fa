"""What `w8a8`'s second activation pass buys and costs, per kind of matrix: greedy agreement and
perplexity against the float32 reference (as bench.quant_quality), and the forward's time at one
row (a decode) and four (a k = 3 verify). One runner; each variant switches the named kinds of
matrix to one pass (7-bit activations) and leaves the others at two:

    python -m bench.activation_passes --positions 2000 \\
        --variant qkv_proj,gate_up_proj --variant qkv_proj,gate_up_proj,o_proj,down_proj,lm_head

The first row is always `w8a8` as served (every matrix two passes).
"""

from __future__ import annotations

import argparse
import statistics
import sys

import torch

from bench.quant_forward import forward_ms
from bench.quant_quality import agreement, perplexity, quality_prompts, reference_scores, score
from engine.model.loader import load_model
from engine.model.quant.kernels import Int8DynamicKernel
from engine.model.runner import ModelRunner


def dynamic_kernels(runner: ModelRunner) -> dict[str, list[Int8DynamicKernel]]:
    """The model's fbgemm kernels by the name of their module (qkv_proj, down_proj, lm_head...)."""
    found: dict[str, list[Int8DynamicKernel]] = {}
    for name, module in runner.model.named_modules():
        for kernel in [*getattr(module, "kernels", []), getattr(module, "head", None)]:
            if isinstance(kernel, Int8DynamicKernel):
                found.setdefault(name.rsplit(".", 1)[-1], []).append(kernel)
    return found


def set_one_pass(kernels: dict[str, list[Int8DynamicKernel]], kinds: set[str]) -> None:
    for kind, group in kernels.items():
        for kernel in group:
            kernel.passes = 1 if kind in kinds else 2  # an instance attribute over the class's


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default="bundled:qwen2.5-coder-1.5b-instruct", help="a .gguf model")
    ap.add_argument("--positions", type=int, default=2000, help="next-token positions to score")
    ap.add_argument("--variant", action="append", default=[], help="kinds run with one pass")
    ap.add_argument("--rounds", type=int, default=4, help="timing rounds (variants alternate)")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    loaded = load_model(args.model, "w8a8")
    seqs = quality_prompts(loaded, args.positions)
    ref = reference_scores(loaded, seqs)
    runner = ModelRunner(loaded, "cpu", "bfloat16", 16)
    kernels = dynamic_kernels(runner)
    variants = {"two passes everywhere": set()} | {
        "one pass: " + v: set(v.split(",")) for v in args.variant
    }
    unknown = set().union(*variants.values()) - set(kernels)
    if unknown:
        raise SystemExit(f"no such matrices {sorted(unknown)}; known: {sorted(kernels)}")
    quality: dict[str, tuple[float, float]] = {}
    for name, kinds in variants.items():
        set_one_pass(kernels, kinds)
        ours = score(runner, seqs, name)
        quality[name] = agreement(ours, ref), perplexity(ours) / perplexity(ref) - 1
    times: dict[tuple[str, int], list[float]] = {(n, m): [] for n in variants for m in (1, 4)}
    for done in range(args.rounds):
        print(f"timing round {done + 1}/{args.rounds}", file=sys.stderr)
        for name, kinds in variants.items():
            set_one_pass(kernels, kinds)
            forward_ms(runner, 4, 1)
            for m in (1, 4):
                times[name, m].append(forward_ms(runner, m, 4))
    print("| activations | top-1 agreement | perplexity vs f32 | 1 row ms | 4 rows ms | 4 ÷ 1 |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, (agree, ppl) in quality.items():
        one, four = (statistics.median(times[name, m]) for m in (1, 4))
        print(f"| {name} | {agree:.2%} | {ppl:+.2%} | {one:.0f} | {four:.0f} | {four / one:.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
