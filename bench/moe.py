"""A mixture-of-experts model of Qwen3-30B-A3B's shape on the native kernels: plain decode tok/s
and the verify cost curve (seconds of one request's forward of 1, 2, 4, 8 rows).

The file is written here by the `gguf` package with random weights, as llama.cpp's converter
lays out a Qwen3-MoE (`qwen3moe`: stacked `ffn_{gate,up,down}_exps`, router `ffn_gate_inp` in
F32): hidden 2048, 32 query heads and 4 KV heads of 128, 128 experts of width 768, 8 a token,
vocabulary 151,936 (the tokenizer copied from the bundled Qwen2.5 draft's file); matrices in
Q4_K, the head in Q6_K (as a Q4_K_M file has them). The real model has 48 layers (about 17 GB
in Q4_K); `--layers` writes fewer so that it fits a shared host, and the report says how many.
Random weights route tokens about uniformly, so a verify's rows choose more distinct experts
than a real model's correlated neighbours would: the curve is an upper bound on its slope.

Decode is measured through `LLMEngine` (as `specserve serve --model FILE.gguf`: quantization
auto, bfloat16, no speculation), tokens after the first over the time since the first; the
curve through the engine's own runner, each row count timed `--repeats` times at the same
context (rejected rows are overwritten: nothing advances), the median kept. Where llama.cpp's
Python binding is installed (`make llamacpp`), the same file's decode is timed there in the
same run (bench.decode_vs_llamacpp's loop).

    python -m bench.moe --layers 8 --max-tokens 32 --rounds 3
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import time
from pathlib import Path

import gguf
import numpy as np
import torch
from gguf import GGMLQuantizationType as T

from bench.decode_vs_llamacpp import llamacpp_rate, specserve_engine, specserve_rate
from bench.engine_args import cpu_flags

HIDDEN, HEADS, KV_HEADS, HEAD_DIM = 2048, 32, 4, 128
EXPERTS, TOP_K, EXPERT_WIDTH, VOCAB = 128, 8, 768, 151_936
TOKENIZER_SOURCE = Path("~/.cache/specserve/models/qwen2.5-coder-0.5b-instruct.gguf")
PROMPT = "def quicksort(items: list[int]) -> list[int]:\n"
_SCALE_OFFSETS = {T.Q4_K: (0, 2), T.Q6_K: (208,)}  # f16 d (and dmin) per block


def random_blocks(qtype: T, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """[rows, bytes per row]: random quants, small f16 scales, so that activations stay sane."""
    values, nbytes = gguf.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, size=(rows, cols // values, nbytes), dtype=np.uint8)
    for offset in _SCALE_OFFSETS[qtype]:
        d = rng.uniform(1e-4, 2e-3, raw.shape[:2]).astype(np.float16)
        raw[:, :, offset : offset + 2] = d.view(np.uint8).reshape(*raw.shape[:2], 2)
    return raw.reshape(rows, -1)


def write_model(path: Path, layers: int, seed: int = 0) -> Path:
    """The Qwen3-30B-A3B-shaped file with `layers` layers (kept: written once per path)."""
    if path.exists():
        return path
    rng = np.random.default_rng(seed)
    tmp = path.with_suffix(".tmp")
    writer = gguf.GGUFWriter(str(tmp), "qwen3moe")
    _hparams(writer, layers)
    _copy_tokenizer(writer, TOKENIZER_SOURCE.expanduser())

    def matrix(name: str, qtype: T, rows: int, cols: int, stack: int = 1) -> None:
        blocks = random_blocks(qtype, stack * rows, cols, rng)
        data = blocks.reshape(stack, rows, -1) if stack > 1 else blocks
        writer.add_tensor(name, data, raw_dtype=qtype)

    def vector(name: str, *shape: int, scale: float = 0.0) -> None:
        values = rng.standard_normal(shape).astype(np.float32) * scale
        writer.add_tensor(name, values if scale else np.ones(shape, np.float32))

    matrix("token_embd.weight", T.Q4_K, VOCAB, HIDDEN)
    matrix("output.weight", T.Q6_K, VOCAB, HIDDEN)
    vector("output_norm.weight", HIDDEN)
    for i in range(layers):
        b = f"blk.{i}"
        for name in ("attn_norm", "ffn_norm"):
            vector(f"{b}.{name}.weight", HIDDEN)
        for name in ("attn_q_norm", "attn_k_norm"):
            vector(f"{b}.{name}.weight", HEAD_DIM)
        matrix(f"{b}.attn_q.weight", T.Q4_K, HEADS * HEAD_DIM, HIDDEN)
        matrix(f"{b}.attn_k.weight", T.Q4_K, KV_HEADS * HEAD_DIM, HIDDEN)
        matrix(f"{b}.attn_v.weight", T.Q4_K, KV_HEADS * HEAD_DIM, HIDDEN)
        matrix(f"{b}.attn_output.weight", T.Q4_K, HIDDEN, HEADS * HEAD_DIM)
        vector(f"{b}.ffn_gate_inp.weight", EXPERTS, HIDDEN, scale=HIDDEN**-0.5)
        matrix(f"{b}.ffn_gate_exps.weight", T.Q4_K, EXPERT_WIDTH, HIDDEN, EXPERTS)
        matrix(f"{b}.ffn_up_exps.weight", T.Q4_K, EXPERT_WIDTH, HIDDEN, EXPERTS)
        matrix(f"{b}.ffn_down_exps.weight", T.Q4_K, HIDDEN, EXPERT_WIDTH, EXPERTS)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    tmp.rename(path)
    return path


def _hparams(writer: gguf.GGUFWriter, layers: int) -> None:
    writer.add_context_length(4096)
    writer.add_embedding_length(HIDDEN)
    writer.add_block_count(layers)
    writer.add_feed_forward_length(6144)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_key_length(HEAD_DIM)
    writer.add_value_length(HEAD_DIM)
    writer.add_rope_freq_base(1_000_000.0)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_expert_count(EXPERTS)
    writer.add_expert_used_count(TOP_K)
    writer.add_expert_feed_forward_length(EXPERT_WIDTH)
    writer.add_vocab_size(VOCAB)


def _copy_tokenizer(writer: gguf.GGUFWriter, source: Path) -> None:
    """Every tokenizer.* key of `source` (a Qwen2.5 file: the vocabulary Qwen3 extends)."""
    reader = gguf.GGUFReader(str(source))
    for name, field in reader.fields.items():
        if not name.startswith("tokenizer."):
            continue
        kind = field.types[0]
        sub = field.types[1] if kind == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(name, field.contents(), kind, sub_type=sub)


def verify_curve(
    engine: object, rows: tuple[int, ...], context: int, repeats: int
) -> dict[int, float]:
    """Median seconds of one request's forward of n rows (n - 1 drafts) at `context` tokens."""
    from engine.model.runner import ForwardInput

    runner = engine.target  # type: ignore[attr-defined]
    block_size = runner.block_size
    table = list(range(-(-(context + max(rows)) // block_size)))
    ids = list(range(1000, 1000 + context + max(rows)))
    runner.forward([ForwardInput(ids[:context], 0, table, 1)])  # the context's K/V
    curve = {}
    for n in rows:
        times = []
        for _ in range(repeats + 1):  # the first: warm-up
            started = time.perf_counter()
            runner.forward([ForwardInput(ids[context : context + n], context, table, n, n - 1)])
            times.append(time.perf_counter() - started)
        curve[n] = statistics.median(times[1:])
    return curve


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=8, help="of the real model's 48")
    parser.add_argument("--path", type=Path, default=None)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    default = Path(f"~/.cache/specserve/bench/qwen3moe-30b-a3b-shape-{args.layers}l.gguf")
    path = (args.path or default).expanduser()
    path.parent.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    write_model(path, args.layers)
    print(f"file {path} ({path.stat().st_size / 2**30:.2f} GiB, {args.layers} of 48 layers), "
          f"ready in {time.perf_counter() - started:.0f}s", flush=True)  # fmt: skip
    engine = specserve_engine(str(path), args.threads)
    prompt = engine.tokenizer.encode(PROMPT)
    specserve_rate(engine, prompt, 4)  # warm-up
    llm = _llamacpp(path, args.threads)
    if llm is not None:
        llamacpp_rate(llm, prompt, 4)  # warm-up
    ours, theirs = [], []
    for r in range(args.rounds):
        ours.append(specserve_rate(engine, prompt, args.max_tokens)[0])
        line = f"round {r}: specserve {ours[-1]:.2f} tok/s"
        if llm is not None:
            theirs.append(llamacpp_rate(llm, prompt, args.max_tokens)[0])
            line += f", llama.cpp {theirs[-1]:.2f} tok/s"
        print(line, flush=True)
    curve = verify_curve(engine, (1, 2, 4, 8), len(prompt) + args.max_tokens, args.repeats)
    print(f"{args.layers} layers, {args.threads} threads, {args.max_tokens} tokens x "
          f"{args.rounds} rounds; cpu {cpu_flags()}")  # fmt: skip
    print(f"median plain decode: specserve {statistics.median(ours):.2f} tok/s" + (
        f", llama.cpp {statistics.median(theirs):.2f} tok/s, ratio "
        f"{statistics.median(ours) / statistics.median(theirs):.2f}x" if theirs else
        " (llama.cpp: llama_cpp not installed, `make llamacpp`)"))  # fmt: skip
    base = curve[1]
    print("verify cost: " + ", ".join(
        f"{n} rows {t * 1000:.1f} ms ({t / base:.2f}x)" for n, t in curve.items()))  # fmt: skip


def _llamacpp(path: Path, threads: int) -> object | None:
    if importlib.util.find_spec("llama_cpp") is None:
        return None
    from llama_cpp import Llama

    return Llama(str(path), n_ctx=4096, n_threads=threads, n_threads_batch=threads, verbose=False)


if __name__ == "__main__":
    main()
