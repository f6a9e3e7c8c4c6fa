"""An EAGLE-3 head with a GGUF target on the native kernels: the target's one-call layer stack
keeps the head's streams, and the head's own linear layers run as Q8_0 blocks
(engine/model/eagle3.py `NativeLinear`) where the draft's quantization is `gguf` or `auto`."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from engine_utils import greedy, hf_model, make_engine, outputs, random_prompts
from gguf import GGMLQuantizationType as Q
from gguf_blocks import write_random_gguf
from test_eagle3 import MAX_TOKENS, _drafted, eagle3_engine, write_head
from tiny import make_tiny_model

from engine.kernels import gguf_ops
from engine.model.eagle3 import NativeLinear, load_eagle3_head
from engine.model.head_kv import HeadSpan

pytestmark = pytest.mark.skipif(not gguf_ops.available(), reason="native kernels not built")


def test_a_gguf_target_keeps_its_native_stack_and_changes_no_output(tmp_path: Path) -> None:
    """With eagle3 the target's decodes and verifies still take the one-call native layer stack,
    which now keeps the streams the head reads, and the output is plain decoding's."""
    src = make_tiny_model(tmp_path / "src", hidden_size=256, intermediate_size=512, num_layers=3)
    target = tmp_path / "tiny.gguf"
    write_random_gguf(target, src, [Q.Q4_K, Q.Q8_0, Q.Q6_K, Q.Q5_0])
    head = write_head(tmp_path / "head", src, list(range(0, 300, 3)))
    kw: dict[str, object] = dict(quantization="gguf", dtype="bfloat16", block_size=16)
    plain = make_engine(target, **kw)
    assert plain.target.model.native_stack is not None
    engine = eagle3_engine(target, head, **kw)
    prompts = random_prompts(4, (5, 30), 300, seed=3)
    seqs = engine.generate(prompts, greedy(MAX_TOKENS))
    assert [s.output_token_ids for s in seqs] == outputs(plain, prompts, greedy(MAX_TOKENS))
    assert _drafted(seqs)[0] > 0
    stack = engine.target.model.native_stack
    assert stack is not None and stack.aux_layers == engine.target.model.aux_layers  # it ran
    assert engine._eagle3 is not None and isinstance(engine._eagle3.head.fc, NativeLinear)


def test_a_native_head_drafts_as_its_float_one(tiny_model_dir: Path, tmp_path: Path) -> None:
    """The head's linear layers as Q8_0 blocks on the native kernel: logits within the rounding
    of 8-bit weights and activations of the float head's, and the same picks where the float
    head is sure."""
    vocab = hf_model(tiny_model_dir).config.vocab_size
    folder = write_head(tmp_path / "head", tiny_model_dir, list(range(0, vocab, 2)))
    embed = hf_model(tiny_model_dir).get_input_embeddings()
    heads = [
        load_eagle3_head(str(folder), embed, 64, vocab, 256, torch.device("cpu"), torch.float32, n)
        for n in (False, True)
    ]
    assert isinstance(heads[1].lm_head, NativeLinear) and not isinstance(heads[0].fc, NativeLinear)
    gen = torch.Generator().manual_seed(2)
    aux = torch.randn(10, heads[0].feature_width, generator=gen)
    tokens = torch.randint(3, vocab, (10,), generator=gen)
    logits = []
    with torch.no_grad():
        for head in heads:
            normed, _ = head(head.fuse(aux), tokens, [HeadSpan(head.new_cache(), 0, 10)])
            logits.append(head.logits(normed)[:, head.target_ids])  # [10, draft]
    spread, error = logits[0].std(), (logits[1] - logits[0]).abs()
    assert error.mean() < 0.03 * spread and error.max() < 0.25 * spread, (error.mean(), spread)
    top2 = logits[0].topk(2).values
    sure = (top2[:, 0] - top2[:, 1]) > 0.5 * spread
    assert sure.any() and torch.equal(logits[1].argmax(-1)[sure], logits[0].argmax(-1)[sure])
