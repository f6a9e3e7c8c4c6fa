"""Train an EAGLE-3 head for a target and write it in the public format (engine/model/eagle3.py).

    python -m tools.train_eagle3 --target bundled:qwen2.5-coder-1.5b-instruct --out heads/qwen \
        --answers 176 --chat-prompts 700 --answer-config configs/default.yaml --tokens 128000 \
        --steps 480 --cache /tmp/qwen-features.pt

(the shipped head's whole recipe is in its README.json and docs/BENCHMARKS.md).

The head is the module the engine serves (`Eagle3Head`), so what is trained is what loads: its
state_dict is the format's names. Training follows EAGLE-3's training-time test in a simple form:
step 0 predicts, at each position i, the target's greedy token after t_{i+1} from the target's
fused features h_i; each of `--ttt-steps` further steps feeds the head's own output back one
position further, as drafting does, and is scored against the target's greedy token there. The
loss is cross-entropy to that token over the draft vocabulary (positions whose token it lacks are
skipped), step j weighted 0.8^j as EAGLE-3 does. Everything random follows `--seed`; the
learning rate falls linearly to zero at `--steps`, so the step budget, not the clock, ends it.

The head's output side starts as the target's own (`--init-from-target`): its lm_head is the
target's rows of the draft vocabulary and its final norm the target's, so training starts from
the target's map of hidden states to tokens instead of learning one from a few hundred thousand
tokens. The data (tools/eagle3_data.py) is the target's own answers to training prompts first,
then offline code and docs, then its answers to `--chat-prompts` chat requests with the features
kept as they were answered; `--cache FILE` keeps the extracted features (the answers in FILE with
the suffix .answers.json, the chat part with .chat.pt) for a rerun.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from torch import nn

from engine.config import EngineConfig
from engine.core.llm_engine import LLMEngine
from engine.model.bundled import sha256_file
from engine.model.decoder import RMSNorm
from engine.model.eagle3 import Eagle3Config, Eagle3Head, quantized_int8
from engine.model.loader import LoadedModel, load_model
from engine.model.rope import Rotary, apply_rope
from engine.model.runner import ModelRunner
from tools.eagle3_data import (
    UNKNOWN,
    Features,
    captured_answers,
    default_sources,
    draft_vocabulary,
    native_features,
    sample_texts,
    target_answers,
    token_chunks,
    training_prompts,
)
from tools.eagle3_prompts import chat_prompts
from tools.eagle3_recipe import Recipe, parse

STEP_DECAY = 0.8  # EAGLE-3's weight of the j-th unrolled step: later drafts matter less
IGNORE = -100


@dataclass(frozen=True)
class Result:
    losses: list[float]  # the training loss of every step
    first_eval: float  # the loss over all the training data before training and after
    last_eval: float
    seconds: float


def head_config(target: dict, recipe: Recipe, layer_ids: tuple[int, ...], draft: int) -> dict:
    """config.json of the head: a Llama layer of the target's sizes, the format's fields."""
    return {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "hidden_size": target["hidden_size"],
        "intermediate_size": recipe.intermediate_size or target["intermediate_size"],
        "num_attention_heads": target["num_attention_heads"],
        "num_key_value_heads": target.get("num_key_value_heads") or target["num_attention_heads"],
        "head_dim": target.get("head_dim")
        or target["hidden_size"] // target["num_attention_heads"],
        "num_hidden_layers": 1,
        "hidden_act": "silu",
        "rms_norm_eps": target.get("rms_norm_eps", 1e-6),
        "rope_theta": _rope_theta(target),
        "max_position_embeddings": target["max_position_embeddings"],
        "vocab_size": target["vocab_size"],
        "draft_vocab_size": draft,
        "target_hidden_size": target["hidden_size"],
        "tie_word_embeddings": False,
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(layer_ids)},
    }


def _rope_theta(target: dict) -> float:
    """The public format's field; transformers 5 keeps it in rope_parameters."""
    return float(
        target.get("rope_theta") or (target.get("rope_parameters") or {}).get("rope_theta", 10000.0)
    )


def new_head(
    config: Eagle3Config, target: TargetOutput, draft_ids: torch.Tensor, recipe: Recipe
) -> Eagle3Head:
    """A freshly initialised head over the target's (frozen) embedding, float32 for AdamW; its
    lm_head and final norm the target's where `init_from_target`."""
    torch.manual_seed(recipe.seed)
    rotary = Rotary(
        config.rope_config(config.raw["max_position_embeddings"]),
        config.head_dim,
        torch.device("cpu"),
    )
    head = Eagle3Head(config, nn.Embedding.from_pretrained(target.embed), rotary, own_embed=False)
    for module in head.modules():
        if isinstance(module, RMSNorm):  # the norms start as the identity
            nn.init.ones_(module.weight)
    if recipe.init_from_target:
        with torch.no_grad():
            head.lm_head.weight.copy_(target.lm_head[draft_ids])
            head.norm.weight.copy_(target.norm)
    return head


@dataclass(frozen=True)
class TargetOutput:
    """The target's dense input and output weights, float32: what the head shares or starts as."""

    embed: torch.Tensor  # [vocab, hidden]
    lm_head: torch.Tensor  # [vocab, hidden] (the embedding where tied)
    norm: torch.Tensor  # [hidden]: the final norm's weight

    @classmethod
    def read(cls, loaded: LoadedModel) -> TargetOutput:
        wanted = ("model.embed_tokens.weight", "lm_head.weight", "model.norm.weight")
        found: dict[str, torch.Tensor] = {}
        for name, value in loaded.iter_weights():
            if name in wanted:
                assert isinstance(value, torch.Tensor), f"{name} is not a dense tensor"
                found[name] = value.float()
        embed = found["model.embed_tokens.weight"]
        return cls(embed, found.get("lm_head.weight", embed), found["model.norm.weight"])


def _attention(
    head: Eagle3Head,
    x: torch.Tensor,  # [B, T, 2 * hidden]: this step's rows, row i at position i + step
    step: int,
    kv: list[tuple[torch.Tensor, torch.Tensor]],  # earlier steps' keys, values [B, T, kv, d]
) -> torch.Tensor:  # [B, T, hidden]
    """Row i of step j sees step 0's keys of positions [0, i] (the target's features, as after a
    catch-up) and its own keys of steps 1..j (the drafts written at i + 1 .. i + j)."""
    attn, c = head.midlayer.self_attn, head.config
    b, t, _ = x.shape
    cos, sin = head.rotary.tables(torch.arange(t) + step, x.dtype)  # [T, 1, d]
    q = apply_rope(attn.q_proj(x).view(b, t, c.num_heads, c.head_dim), cos, sin)
    k = apply_rope(attn.k_proj(x).view(b, t, c.num_kv_heads, c.head_dim), cos, sin)
    kv.append((k, attn.v_proj(x).view(b, t, c.num_kv_heads, c.head_dim)))
    group = c.num_heads // c.num_kv_heads
    keys = [k.repeat_interleave(group, dim=2) for k, _ in kv]  # [B, T, heads, d] each
    values = [v.repeat_interleave(group, dim=2) for _, v in kv]
    scale = c.head_dim**-0.5
    causal = torch.ones(t, t, dtype=torch.bool).tril()
    past = torch.einsum("bihd,bjhd->bhij", q, keys[0]) * scale  # [B, heads, T, T]
    past = past.masked_fill(~causal, -float("inf"))
    own = [(q * k).sum(-1).transpose(1, 2)[..., None] * scale for k in keys[1:]]  # [B, h, T, 1]
    probs = torch.cat([past, *own], dim=-1).float().softmax(-1).to(q.dtype)
    out = torch.einsum("bhij,bjhd->bihd", probs[..., :t], values[0])
    for s, v in enumerate(values[1:]):
        out = out + probs[..., t + s].transpose(1, 2)[..., None] * v
    return attn.o_proj(out.reshape(b, t, c.num_heads * c.head_dim))


def head_step(
    head: Eagle3Head,
    hidden: torch.Tensor,  # [B, T, hidden]: fused features (step 0) or the head's prenorm
    tokens: torch.Tensor,  # [B, T]: the token after each row's position
    step: int,
    kv: list[tuple[torch.Tensor, torch.Tensor]],
) -> tuple[torch.Tensor, torch.Tensor]:  # draft-vocabulary logits [B, T, draft], prenorm
    """`Eagle3Head.forward` for a batch of whole sequences at one unrolled step."""
    layer, c = head.midlayer, head.config
    h = layer.hidden_norm(hidden)
    residual = h if c.norm_before_residual else hidden
    x = torch.cat([layer.input_layernorm(head.embed(tokens)), h], dim=-1)
    residual = residual + _attention(head, x, step, kv)
    residual = residual + layer.mlp(layer.post_attention_layernorm(residual))
    return head.lm_head(head.norm(residual)), residual


def _shift(x: torch.Tensor, by: int, fill: int) -> torch.Tensor:  # [B, T] -> [B, T]: x[:, i+by]
    return torch.cat([x[:, by:], x.new_full((x.shape[0], by), fill)], dim=1)


def ttt_loss(
    head: Eagle3Head,
    aux: torch.Tensor,  # [B, T, 3 * target_hidden]
    tokens: torch.Tensor,  # [B, T]
    labels: torch.Tensor,  # [B, T]: the target's greedy pick at each position, as a draft id
    ttt_steps: int,
) -> torch.Tensor:
    """Row i of step j sits at position i + j, reads token t_{i+j+1} and must give the target's
    pick after it (labels[i + j + 1])."""
    kv: list[tuple[torch.Tensor, torch.Tensor]] = []
    hidden, total, weights = head.fuse(aux), aux.new_zeros((), dtype=torch.float32), 0.0
    for step in range(ttt_steps + 1):
        logits, hidden = head_step(head, hidden, _shift(tokens, step + 1, 0), step, kv)
        target = _shift(labels, step + 1, IGNORE)
        if (target != IGNORE).any():
            loss = F.cross_entropy(
                logits.flatten(0, 1).float(), target.flatten(), ignore_index=IGNORE
            )
            total, weights = total + STEP_DECAY**step * loss, weights + STEP_DECAY**step
    return total / weights


def draft_labels(greedy: torch.Tensor, draft_ids: torch.Tensor, vocab: int) -> torch.Tensor:
    """Target ids to draft ids, IGNORE where the draft vocabulary lacks the id or the pick is
    UNKNOWN."""
    to_draft = torch.full((vocab,), IGNORE, dtype=torch.long)
    to_draft[draft_ids] = torch.arange(draft_ids.numel())
    return to_draft[greedy.clamp(min=0)].masked_fill(greedy == UNKNOWN, IGNORE)


EVAL_CHUNKS = 64  # the loss before and after training is over at most the first 64 chunks


def evaluate(head: Eagle3Head, data: Features, labels: torch.Tensor, recipe: Recipe) -> float:
    num = min(data.tokens.shape[0], EVAL_CHUNKS)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        losses = [
            ttt_loss(
                head,
                data.aux[i : i + recipe.batch],
                data.tokens[i : i + recipe.batch],
                labels[i : i + recipe.batch],
                recipe.ttt_steps,
            ).item()
            for i in range(0, num, recipe.batch)
        ]
    return sum(losses) / len(losses)


WARM_UP = 20  # optimizer steps of linear warm-up


def lr_factor(step: int, recipe: Recipe) -> float:
    """The learning rate's factor at an optimizer step: a linear warm-up, then constant or (the
    `linear` schedule) falling linearly to zero at `steps`; set by steps, not time, so a seed
    gives the same head wherever the step budget binds."""
    warm = min(1.0, (step + 1) / WARM_UP)
    return warm * (max(0.0, 1.0 - step / recipe.steps) if recipe.schedule == "linear" else 1.0)


def train(head: Eagle3Head, data: Features, labels: torch.Tensor, recipe: Recipe) -> Result:
    """AdamW over seeded batches of chunks until `steps` or the time budget, bf16 autocast."""
    params = [p for p in head.parameters() if p.requires_grad]
    lm_head = head.lm_head.weight
    scale = recipe.head_lr_scale if recipe.init_from_target else 1.0
    groups = [
        {"params": [p for p in params if p is not lm_head], "lr": recipe.lr},
        {"params": [lm_head], "lr": recipe.lr * scale},
    ]
    opt = torch.optim.AdamW(groups, lr=recipe.lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_factor(s, recipe))
    gen = torch.Generator().manual_seed(recipe.seed)
    first, losses, start = evaluate(head, data, labels, recipe), [], time.monotonic()
    num = data.tokens.shape[0]
    order = torch.randperm(num, generator=gen)
    for step in range(recipe.steps):
        if time.monotonic() - start > 60 * recipe.max_minutes:
            print(f"time budget reached after {step} steps", flush=True)
            break
        if (step + 1) * recipe.batch > order.numel():
            order = torch.cat([order, torch.randperm(num, generator=gen)])
        rows = order[step * recipe.batch : (step + 1) * recipe.batch]
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = ttt_loss(head, data.aux[rows], data.tokens[rows], labels[rows], recipe.ttt_steps)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        sched.step()
        losses.append(loss.item())
        if (step + 1) % recipe.log_every == 0:
            recent = losses[-recipe.log_every :]
            print(
                f"step {step + 1}: loss {sum(recent) / len(recent):.3f} "
                f"({time.monotonic() - start:.0f} s)",
                flush=True,
            )
    seconds = time.monotonic() - start
    return Result(losses, first, evaluate(head, data, labels, recipe), seconds)


def save_head(head: Eagle3Head, folder: Path, draft_ids: torch.Tensor, dtype: str) -> None:
    """model.safetensors beside the config.json already there: the format's names, d2t, t2d
    (`int8`: the matrices as int8 rows and their scales, the rest bfloat16), and SHA256SUMS."""
    cast = torch.bfloat16 if dtype == "int8" else getattr(torch, dtype)
    weights = {n: t.detach().to(cast).contiguous() for n, t in head.state_dict().items()}
    weights.pop("embed_tokens.weight", None)
    if dtype == "int8":
        weights = quantized_int8(weights)
    weights["d2t"] = draft_ids - torch.arange(draft_ids.numel())
    weights["t2d"] = torch.zeros(head.config.vocab_size, dtype=torch.bool).index_fill(
        0, draft_ids, True
    )
    save_file(weights, str(folder / "model.safetensors"))
    files = ("config.json", "model.safetensors")
    sums = [f"{sha256_file(folder / f)}  {f}" for f in files]
    (folder / "SHA256SUMS").write_text("\n".join(sums) + "\n")


def features(recipe: Recipe, loaded: LoadedModel, layer_ids: tuple[int, ...]) -> Features:
    """The target's answers, then text, as chunks, through the engine's forward, then the chat
    answers with the features captured as they were answered; each part cached."""
    cache = Path(recipe.cache) if recipe.cache else None
    data = text_features(recipe, loaded, layer_ids, cache)
    chats = chat_prompts(recipe.chat_prompts, recipe.seed) if recipe.chat_prompts else []
    engine = None
    for part, start in enumerate(range(0, len(chats), recipe.chat_part)):
        kept = chat_cache(cache, part)
        if kept is not None and kept.exists():
            print(f"chat features from {kept}", flush=True)
            data += Features(**torch.load(kept))
            continue
        from bench.serving.peers import prompt_ids

        engine = engine or answering_engine(recipe, layer_ids)
        prompts = [prompt_ids(engine.tokenizer, c) for c in chats[start : start + recipe.chat_part]]
        chat = captured_answers(engine, prompts, recipe.chat_tokens, recipe.seq_len)
        if kept is not None:
            torch.save(asdict(chat), kept)
        data += chat
    return data


def chat_cache(cache: Path | None, part: int) -> Path | None:
    """Where part `part` of the chat features is kept: beside the features' cache file."""
    if cache is None:
        return None
    return cache.with_suffix(".chat.pt" if part == 0 else f".chat{part}.pt")


def text_features(
    recipe: Recipe, loaded: LoadedModel, layer_ids: tuple[int, ...], cache: Path | None
) -> Features:
    """The target's answers to the bench's training prompts, then offline text: one prefill a
    chunk on the engine's forward."""
    if cache is not None and cache.exists():
        print(f"features from {cache}", flush=True)
        return Features(**torch.load(cache))
    answers = answered(recipe, cache)
    sources = [Path(s) for s in recipe.sources] or default_sources()
    chunks, files = token_chunks(
        loaded.tokenizer,
        sample_texts(sources, recipe.seed),
        recipe.seq_len,
        recipe.tokens,
        recipe.per_file,
        answers,
    )
    print(
        f"{chunks.numel()} tokens ({sum(len(a) + 1 for a in answers)} of {len(answers)} answers, "
        f"the rest from {len(files)} files); features at layers {layer_ids}",
        flush=True,
    )
    runner = ModelRunner(loaded, "cpu", recipe.dtype, 16)
    runner.keep_aux_hidden(layer_ids)
    runner.allocate_kv_cache(-(-recipe.seq_len // 16))
    data = native_features(runner, chunks)
    if cache is not None:
        torch.save(asdict(data), cache)
    return data


def answered(recipe: Recipe, cache: Path | None) -> list[list[int]]:
    """The target's answers to `recipe.answers` training prompts (prompt ids, then the answer's),
    kept beside the features' cache file (`.answers.json`) so that a rerun with other text or
    token counts skips the slowest part."""
    if not recipe.answers:
        return []
    kept = cache.with_suffix(".answers.json") if cache is not None else None
    if kept is not None and kept.exists():
        print(f"answers from {kept}", flush=True)
        return list(json.loads(kept.read_text()))
    prompts = training_prompts(recipe.answers, recipe.seed)
    answers = target_answers(
        answering_engine(recipe), prompts, recipe.answer_tokens, recipe.answer_batch
    )
    if kept is not None:
        kept.write_text(json.dumps(answers))
    return answers


def answering_engine(recipe: Recipe, aux_layers: tuple[int, ...] = ()) -> LLMEngine:
    """The engine that answers (`answer_config`, or the target plain), `answer_batch` requests
    at once; where features are captured, one that keeps exactly these aux layers (an EAGLE-3
    config of the same layers: its head drafts, and greedy answers equal plain ones)."""
    from server.settings import Settings

    config = (
        Settings.load(Path(recipe.answer_config)).engine_config()
        if recipe.answer_config
        else EngineConfig(model=recipe.target, dtype=recipe.dtype)  # type: ignore[arg-type]
    )
    engine = LLMEngine(replace(config, max_num_seqs=recipe.answer_batch))
    kept = engine.target.model.aux_layers
    if aux_layers and tuple(kept) != aux_layers:
        raise ValueError(
            f"--answer-config keeps aux layers {tuple(kept)}, not {aux_layers}: features are "
            "captured from an EAGLE-3 config whose head reads the same layers"
        )
    return engine


def run(recipe: Recipe) -> tuple[Eagle3Head, Result]:
    """Features, draft vocabulary, head, training, the folder: the whole job."""
    torch.manual_seed(recipe.seed)
    wall = time.monotonic()
    loaded = load_model(recipe.target, "auto")
    target = loaded.hf_config.to_dict()
    depth = target["num_hidden_layers"]
    layer_ids = tuple(sorted(recipe.aux_layers or (2, depth // 2, depth - 3)))
    data = features(recipe, loaded, layer_ids)
    outputs = TargetOutput.read(load_model(recipe.target, "none"))
    stops = [loaded.tokenizer.eos_token_id, *_as_list(target.get("eos_token_id"))]
    draft_ids = draft_vocabulary(data.greedy, recipe.draft_vocab, target["vocab_size"], stops)
    folder = Path(recipe.out)
    folder.mkdir(parents=True, exist_ok=True)
    config = head_config(target, recipe, layer_ids, draft_ids.numel())
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    head = new_head(Eagle3Config.read(folder), outputs, draft_ids, recipe)
    labels = draft_labels(data.greedy, draft_ids, target["vocab_size"])
    known = data.greedy != UNKNOWN
    print(
        f"draft vocabulary {draft_ids.numel()} covers "
        f"{(labels[known] != IGNORE).float().mean():.1%} of the target's {int(known.sum())} picks",
        flush=True,
    )
    result = train(head, data, labels, recipe)
    save_head(head, folder, draft_ids, recipe.save_dtype)
    readme = {
        "recipe": asdict(recipe),
        "tokens": data.tokens.numel(),
        "aux_layers": layer_ids,
        "steps": len(result.losses),
        "first_eval_loss": result.first_eval,
        "last_eval_loss": result.last_eval,
        "train_seconds": round(result.seconds, 1),
        "wall_seconds": round(time.monotonic() - wall, 1),
    }
    (folder / "README.json").write_text(json.dumps(readme, indent=2))
    print(f"loss {result.first_eval:.3f} -> {result.last_eval:.3f}; wrote {folder}", flush=True)
    return head, result


def _as_list(ids: int | list[int] | None) -> list[int]:
    return [] if ids is None else [ids] if isinstance(ids, int) else list(ids)


if __name__ == "__main__":
    run(parse(__doc__.split("\n")[0]))
