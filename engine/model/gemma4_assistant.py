"""Gemma 4's assistant draft (`gemma4_assistant`, transformers' Gemma4AssistantForCausalLM).

Not a model of its own: every one of its layers is KV-shared with the target. One draft step for
a request whose last token t sits at position P (the target has computed [0, P)):
- input: [the target's embedding of t (times sqrt hidden) ; a state of the target's width], the
  state being the target's final hidden state at P - 1 (after its norm, transformers'
  `hidden_states[-1]`) for the first draft, the step's own output after;
- `pre_projection` (2 * target hidden -> hidden), then Gemma 4's layers, each a query (q_proj,
  q_norm, rope at P: every draft of a step sits at the same position) over the target's K/V of
  [0, P) in the target's paged pool, in place: a full-attention layer reads what the target's
  last full-attention layer that computes K/V wrote, a sliding one the last sliding layer's, over
  the last window + 1 keys (transformers' bidirectional window is |q - kv| <= window, one key
  more than the target's own sliding layers read);
- the final norm, then `lm_head` (tied to its embedding table; no soft-capping) for the logits,
  and `post_projection` (hidden -> target hidden) for the next draft's state.
With `use_ordered_embeddings` the head scores only the tokens of the top centroids
(`OrderedHead`, transformers' Gemma4AssistantMaskedEmbedder).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from torch import nn
from transformers import AutoConfig, PretrainedConfig

from engine.model.attention import AttentionMetadata
from engine.model.decoder import KVCache
from engine.model.family_switches import gemma4_shape, gemma4_weights
from engine.model.gemma4 import Gemma4Extras, Gemma4Model
from engine.model.shape import DecoderShape

MODEL_TYPE = "gemma4_assistant"
LAYER_TYPES = ("sliding_attention", "full_attention")


@dataclass(frozen=True)
class KVSources:
    """The target's layers whose K/V the assistant reads, by layer type: the last layer of each
    type that computes K/V (transformers' `kv_sharing_modes` "store")."""

    by_type: dict[str, int]

    @classmethod
    def of(cls, target: PretrainedConfig) -> KVSources:
        types = list(target.layer_types)
        computed = len(types) - int(getattr(target, "num_kv_shared_layers", 0) or 0)
        found = {t: max(j for j in range(computed) if types[j] == t) for t in set(types[:computed])}
        return cls(found)


class OrderedHead(nn.Module):
    """`use_ordered_embeddings`: the head scores only the tokens of the `top_k` centroids whose
    logits are highest; every other token gets the row's lowest score minus 1."""

    def __init__(self, hidden: int, vocab: int, num_centroids: int, top_k: int) -> None:
        super().__init__()
        self.centroids = nn.Linear(hidden, num_centroids, bias=False)
        self.token_ordering: torch.Tensor  # [vocab]: the tokens of centroid c at c * vocab / C
        self.register_buffer("token_ordering", torch.empty(vocab, dtype=torch.long))
        self.top_k, self.num_centroids = top_k, num_centroids

    def forward(
        self,
        normed: torch.Tensor,  # [R, hidden]
        table: torch.Tensor,  # [vocab, hidden]: the head's rows
    ) -> torch.Tensor:  # [R, vocab] in the model dtype
        top = self.centroids(normed).topk(self.top_k, dim=-1).indices  # [R, top_k]
        clusters = self.token_ordering.view(self.num_centroids, -1)  # [C, vocab / C]
        ids = clusters[top].flatten(1)  # [R, top_k * vocab / C]
        scores = (normed.unsqueeze(1) @ table[ids].transpose(1, 2)).squeeze(1)  # [R, top_k*V/C]
        out = (scores.amin(-1, keepdim=True) - 1.0).expand(-1, table.shape[0]).clone()
        return out.scatter_(1, ids, scores)


class Gemma4Assistant(nn.Module):
    def __init__(self, config: PretrainedConfig, shape: DecoderShape) -> None:
        super().__init__()
        self.shape = shape
        every_layer_shared = tuple(-1 for _ in range(shape.num_layers))
        self.decoder = Gemma4Model(shape, Gemma4Extras(0, 0, every_layer_shared, False))
        backbone, hidden = int(config.backbone_hidden_size), shape.hidden_size
        self.pre_projection = nn.Linear(2 * backbone, hidden, bias=False)
        self.post_projection = nn.Linear(hidden, backbone, bias=False)
        self.ordered: OrderedHead | None = None
        if config.use_ordered_embeddings:
            top_k = int(config.centroid_intermediate_top_k)
            self.ordered = OrderedHead(hidden, shape.vocab_size, int(config.num_centroids), top_k)

    @property
    def device(self) -> torch.device:
        return self.pre_projection.weight.device

    @property
    def window(self) -> int | None:
        """The keys a sliding layer's query reads: transformers' |q - kv| <= sliding_window."""
        window = self.shape.sliding_window
        return None if window is None else window + 1

    def forward(
        self,
        inputs: torch.Tensor,  # [R, 2 * backbone]: the target's embedding of t ; the state
        positions: torch.Tensor,  # [R]: each row's position P (its last token's)
        kv: dict[str, KVCache],  # the target's pool of its source layer, by layer type
        meta: AttentionMetadata,  # each row one query seeing keys [0, P) (`sliding`: the window)
    ) -> tuple[torch.Tensor, torch.Tensor]:  # logits [R, vocab] float32, state [R, backbone]
        model = self.decoder
        assert model.rotary is not None, "call decoder.init_rotary first"
        x = self.pre_projection(inputs.to(self.pre_projection.weight.dtype))
        rope = model.rotary.tables(positions, x.dtype)
        local = (model.local_rotary or model.rotary).tables(positions, x.dtype)
        residual: torch.Tensor | None = None
        for i, layer in enumerate(model.layers):
            layer_kv = kv[self.shape.layer_types[i]]
            x, residual = layer(x, residual, local if layer.sliding else rope, layer_kv, meta)
        dtype = x.dtype if residual is None else residual.dtype
        normed = model.norm.add_forward(x, residual, dtype)[0]  # [R, hidden]
        return self.logits(normed), self.post_projection(normed)

    def logits(self, normed: torch.Tensor) -> torch.Tensor:  # [R, hidden] -> [R, vocab] float32
        head = self.decoder.lm_head
        table = head.weight if isinstance(head, nn.Linear) else self.decoder.embed_tokens.weight
        if self.ordered is not None:
            return self.ordered(normed, table).float()
        return F.linear(normed, table).float()


def read_config(folder: Path) -> PretrainedConfig:
    """The assistant's config (transformers' Gemma4AssistantConfig), refused unless it is one."""
    if not (folder / "config.json").is_file():
        raise ValueError(f"{folder}: no config.json (a gemma4_assistant checkpoint folder)")
    config = AutoConfig.from_pretrained(str(folder))
    if config.model_type != MODEL_TYPE:
        raise ValueError(
            f"{folder} is not a Gemma 4 assistant draft: model_type {config.model_type!r}, "
            f"not {MODEL_TYPE!r}"
        )
    return config


def check_fits(config: PretrainedConfig, target: PretrainedConfig, sources: KVSources) -> None:
    """The assistant's sizes against the target's: its state width, vocabulary, window and, per
    layer type, the head size and KV heads of the target layer it reads."""
    text = config.text_config
    wanted = {
        "target hidden size": (int(config.backbone_hidden_size), int(target.hidden_size)),
        "vocab size": (int(text.vocab_size), int(target.vocab_size)),
        "sliding window": (int(text.sliding_window), int(target.sliding_window)),
    }
    for kind in set(text.layer_types):
        if kind not in sources.by_type:
            raise ValueError(f"the assistant has {kind} layers, the target none computing K/V")
        ours, theirs = text.per_layer_config[kind], target.per_layer_config[sources.by_type[kind]]
        wanted[f"{kind} head_dim"] = (int(ours.head_dim), int(theirs.head_dim))
        kv_heads = (int(ours.num_key_value_heads), int(theirs.num_key_value_heads))
        wanted[f"{kind} KV heads"] = kv_heads
    if config.use_ordered_embeddings and text.vocab_size % config.num_centroids:
        raise ValueError(
            f"ordered embeddings: {config.num_centroids} centroids do not divide the vocabulary"
        )
    wrong = [f"{name} {a} (target {b})" for name, (a, b) in wanted.items() if a != b]
    if wrong:
        raise ValueError(f"the Gemma 4 assistant does not fit its target: {', '.join(wrong)}")


def load_gemma4_assistant(
    path: str,
    target: PretrainedConfig,  # the target's text config (Gemma4TextConfig)
    device: torch.device,
    dtype: torch.dtype,
) -> Gemma4Assistant:
    folder = Path(path)
    config = read_config(folder)
    if target.model_type != "gemma4_text":
        raise ValueError(
            f"a Gemma 4 assistant drafts for a Gemma 4 target, not {target.model_type!r}"
        )
    check_fits(config, target, KVSources.of(target))
    text = config.text_config
    shape = gemma4_shape(text)
    with torch.device("meta"):
        assistant = Gemma4Assistant(config, shape)
    assistant = assistant.to_empty(device=device).to(dtype)
    _load_weights(assistant, text, _read_weights(folder))
    assistant.decoder.init_rotary(text, device)
    return assistant.requires_grad_(False).eval()


def _read_weights(folder: Path) -> dict[str, torch.Tensor]:
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{folder} has no .safetensors files (the assistant's weights)")
    return {name: t for file in files for name, t in load_file(str(file)).items()}


def _load_weights(
    assistant: Gemma4Assistant, text: PretrainedConfig, weights: dict[str, torch.Tensor]
) -> None:
    """`model.*` into the decoder (q_proj as each shared layer's query), the projections and the
    ordered head's tensors beside it; a tied head saved as lm_head stands for the table."""
    if "model.embed_tokens.weight" not in weights and "lm_head.weight" in weights:
        weights["model.embed_tokens.weight"] = weights["lm_head.weight"]
    own = {k: weights.pop(k) for k in list(weights) if not k.startswith(("model.", "lm_head."))}
    assistant.decoder.load_weights(gemma4_weights(text, weights.items()))
    state = {k.replace("masked_embedding.", "ordered."): v for k, v in own.items()}
    missing, unexpected = assistant.load_state_dict(state, strict=False)
    missing = [k for k in missing if not k.startswith("decoder.")]
    if missing or unexpected:
        raise ValueError(f"assistant weights: missing {missing}, unexpected {unexpected}")
