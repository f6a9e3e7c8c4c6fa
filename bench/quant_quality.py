"""Quality of quantized weights on real text: greedy top-1 agreement and perplexity against the
float32 dequantized GGUF (gguf's own reference dequantization), over HumanEval and MT-Bench
prompts. Prints progress; the machine's other work only slows it down.

    python -m bench.quant_quality --model bundled:qwen2.5-coder-1.5b-instruct --positions 2000
    python -m bench.quant_quality --quantization gguf --decode-kernel   # every row as decode runs it

With `quantization: gguf` a prompt chunk of many rows may run the dense bf16 path
(engine.model.quant.native), so the plain run scores a mix of prompt and decode arithmetic;
`--decode-kernel` sends every row through the native kernel that decode and verify rows take.

Aims (issue 9): top-1 agreement >= 98%, perplexity within 1% of the float32 reference.
"""

from __future__ import annotations

import argparse
import hashlib
import math
import sys
import time
from dataclasses import dataclass

import torch

from bench.serving.datasets import Prompt, load_category
from engine.config import QUANTIZATIONS
from engine.model.loader import LoadedModel, cache_root, load_model
from engine.model.quant import native
from engine.model.runner import ForwardInput, ModelRunner


@dataclass(frozen=True)
class Scored:
    top1: torch.Tensor  # [positions] the model's greedy pick after each prefix
    nll: torch.Tensor  # [positions] -log p(actual next token)


class _ExactGguf(LoadedModel):
    """The GGUF's weights dequantized to float32 by gguf's reference code, as plain tensors."""

    def iter_weights(self):  # type: ignore[no-untyped-def, override]
        from engine.model.quant.gguf_weights import read_gguf_weights

        assert self.gguf_file is not None
        yield from read_gguf_weights(self.gguf_file, self.hf_config, exact=True)


def token_ids(prompts: list[Prompt], loaded: LoadedModel, positions: int) -> list[list[int]]:
    """Tokenized prompts (chat ones through the template) until `positions` next tokens."""
    out: list[list[int]] = []
    total = 0
    for p in prompts:
        if total >= positions:
            break
        if p.is_chat:
            text = loaded.tokenizer.apply_chat_template(p.message_dicts(), tokenize=False)
        else:
            text = p.prompt or ""
        ids = list(loaded.tokenizer(text, add_special_tokens=False)["input_ids"])[:512]
        if len(ids) >= 8:
            out.append(ids)
            total += len(ids) - 1
    return out


def quality_prompts(loaded: LoadedModel, positions: int) -> list[list[int]]:
    """HumanEval and MT-Bench prompts, alternating, tokenized until `positions` next tokens."""
    code, chat = load_category("code", 200, {}), load_category("chat", 200, {})
    prompts = [p for pair in zip(code, chat, strict=False) for p in pair]
    return token_ids(prompts, loaded, positions)


def agreement(ours: Scored, ref: Scored) -> float:
    """The share of positions where both models' greedy picks agree."""
    return (ours.top1 == ref.top1).float().mean().item()


def perplexity(scored: Scored) -> float:
    return math.exp(scored.nll.mean().item())


def score(runner: ModelRunner, seqs: list[list[int]], label: str) -> Scored:
    runner.allocate_kv_cache(512 // runner.block_size + 1)
    top1, nll = [], []
    started = time.monotonic()
    done = 0
    for i, ids in enumerate(seqs):
        table = list(range(-(-len(ids) // runner.block_size)))
        logits = runner.forward([ForwardInput(ids, 0, table, len(ids))])[:-1]  # [T-1, V]
        target = torch.tensor(ids[1:])
        top1.append(logits.argmax(-1))
        nll.append(-torch.log_softmax(logits, -1).gather(1, target[:, None])[:, 0])
        done += len(ids) - 1
        rate = done / (time.monotonic() - started)
        print(f"\r{label}: {i + 1}/{len(seqs)} prompts, {done} positions, {rate:.0f} tok/s",
              end="", file=sys.stderr, flush=True)  # fmt: skip
    print(file=sys.stderr)
    return Scored(torch.cat(top1), torch.cat(nll))


def reference_scores(loaded: LoadedModel, seqs: list[list[int]]) -> Scored:
    """The float32 reference, computed once per model file and prompt set (it is the slow part)."""
    assert loaded.gguf_file is not None
    key = hashlib.sha256(repr((str(loaded.gguf_file), seqs)).encode()).hexdigest()[:16]
    path = cache_root() / "quality" / f"{loaded.gguf_file.stem}-{key}.pt"
    if path.exists():
        print(f"float32 reference from {path}", file=sys.stderr)
        return Scored(**torch.load(path))
    exact = _ExactGguf(**{**loaded.__dict__, "quantization": "none"})
    ref = score(ModelRunner(exact, "cpu", "float32", 16), seqs, "float32 reference")
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"top1": ref.top1, "nll": ref.nll}, path)
    return ref


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default="bundled:qwen2.5-coder-1.5b-instruct", help="a .gguf model")
    choices = [q for q in QUANTIZATIONS if q != "none"]  # "none": the reference's own weights
    ap.add_argument("--quantization", default="auto", choices=choices)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--positions", type=int, default=2000, help="next-token positions to score")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument(
        "--decode-kernel",
        action="store_true",
        help="gguf: every row through the native kernel (no dense prompt path)",
    )
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.decode_kernel:
        native.PREFILL_CANDIDATES = ()  # the dense path is then never measured faster
    quantized = load_model(args.model, args.quantization)
    if quantized.gguf_file is None:
        raise SystemExit(
            f"{args.model}: not a GGUF file; the reference is its float32 dequantization"
        )
    seqs = quality_prompts(quantized, args.positions)
    print(f"{len(seqs)} prompts, {sum(len(s) - 1 for s in seqs)} positions", file=sys.stderr)
    ref = reference_scores(quantized, seqs)
    runner = ModelRunner(quantized, "cpu", args.dtype, 16)
    ours = score(runner, seqs, f"{runner.weights.label} ({args.dtype})")
    agree = agreement(ours, ref)
    ppl_ref, ppl = perplexity(ref), perplexity(ours)
    print(
        f"model {args.model}: {runner.weights.label}, {runner.weights.weight_bytes / 2**30:.2f} GiB"
    )
    print(f"positions {ref.top1.numel()}  top-1 agreement {agree:.2%} (aim >= 98%)")
    print(f"perplexity {ppl:.4f} vs float32 reference {ppl_ref:.4f}: {ppl / ppl_ref - 1:+.2%} (aim within 1%)")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
