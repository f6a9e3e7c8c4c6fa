"""`DecoderShape`: the sizes and switches of the one decoder (engine.model.decoder), read once
from a transformers config. A family is a shape: its switches say where it departs from Llama,
and their defaults are Llama's (engine.model.families sets them)."""

from __future__ import annotations

from dataclasses import dataclass, replace

from transformers import PretrainedConfig


@dataclass(frozen=True)
class MoeShape:
    """A routed mixture-of-experts MLP (engine.model.moe) in the layers it names."""

    num_experts: int
    top_k: int  # experts a token is routed to
    expert_size: int  # each expert's intermediate size
    layers: tuple[int, ...]  # the layers whose MLP is routed (the others keep the dense MLP)
    norm_topk_prob: bool = False  # Qwen's: the top-k probabilities rescaled to sum to 1
    # gpt-oss's: top k of the router's logits (with a bias), then a softmax over those k; experts
    # with biases and a SwiGLU clamped at swiglu_limit (engine.model.moe.ClampedSwiGLUExpert)
    topk_then_softmax: bool = False
    router_bias: bool = False
    swiglu_limit: float | None = None
    swiglu_alpha: float = 1.702


@dataclass(frozen=True)
class DecoderShape:
    """The sizes the module needs, read once from a transformers config."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    qkv_bias: bool
    o_bias: bool
    qk_norm: bool
    tie_word_embeddings: bool
    # Gemma's switches
    norm_offset: bool = False  # RMSNorm scales by 1 + weight, in float32, rounding once
    activation: str = "silu"  # the gated MLP's: "silu" (SwiGLU) or "gelu_tanh" (GeGLU)
    sandwich_norms: bool = False  # a norm after each sublayer too, before the residual add
    embed_scale: float | None = None  # embeddings times this, rounded first (Gemma: sqrt(hidden))
    query_pre_attn_scalar: float | None = None  # the attention scale is its -1/2 power
    sliding_window: int | None = None  # the "sliding_attention" layers' window
    layer_types: tuple[str, ...] = ()  # "sliding_attention" / "full_attention" each; (): all full
    # Granite's multipliers, each a Python float on the model dtype's tensor as transformers has it
    embedding_multiplier: float = 1.0  # embeddings times this
    attention_multiplier: float | None = None  # the attention scale itself (None: head_dim's)
    residual_multiplier: float = 1.0  # each sublayer's output times this as it joins the stream
    logits_scaling: float = 1.0  # the head's logits divided by this
    # SmolLM3's: layers that attend without rotary embedding (NoPE)
    no_rope_layers: tuple[int, ...] = ()
    # mixture of experts (Qwen3-MoE): the routed MLP's sizes and layers; None: dense MLPs only
    moe: MoeShape | None = None
    attention_sinks: bool = False  # gpt-oss's: a learned logit per head, a key with no value
    # OLMo 2's: no norm before attention or the MLP (sandwich norms' post ones only), q/k norms
    # over a token's whole projection, every norm's weight applied in float32 before rounding
    pre_norms: bool = True
    qk_norm_flat: bool = False
    norm_late_round: bool = False
    # Gemma 4's: full-attention layers of their own head size and KV head count, a weightless
    # norm on the values, a learned scalar on each layer's output, soft-capped logits
    global_head_dim: int | None = None
    global_kv_heads: int | None = None
    v_norm: bool = False
    layer_scalar: bool = False
    final_logit_softcapping: float | None = None

    @classmethod
    def from_config(
        cls, config: PretrainedConfig, qkv_bias: bool, o_bias: bool, qk_norm: bool
    ) -> DecoderShape:
        num_heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // num_heads
        return cls(
            vocab_size=config.vocab_size,
            hidden_size=config.hidden_size,
            intermediate_size=config.intermediate_size,
            num_layers=config.num_hidden_layers,
            num_heads=num_heads,
            num_kv_heads=getattr(config, "num_key_value_heads", None) or num_heads,
            head_dim=head_dim,
            rms_norm_eps=config.rms_norm_eps,
            qkv_bias=qkv_bias,
            o_bias=o_bias,
            qk_norm=qk_norm,
            tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
        )

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def attention_scale(self) -> float:
        if self.attention_multiplier is not None:
            return self.attention_multiplier
        return float(self.query_pre_attn_scalar or self.head_dim) ** -0.5

    @property
    def layers_alike(self) -> bool:
        """Every layer runs the same ops on the same rope: what one compiled graph for a run of
        layers and the native stack assume (not so with Gemma 3's or SmolLM3's layer kinds, nor
        with routed experts, whose choice of weights is the data's)."""
        return not self.layer_types and not self.no_rope_layers and self.moe is None

    def attention_shape(self, layer: int) -> DecoderShape:
        """The sizes layer `layer` attends at (Gemma 4's full-attention layers have their own)."""
        if self.global_head_dim is None or self.is_sliding(layer):
            return self
        kv_heads = self.global_kv_heads or self.num_kv_heads
        return replace(self, head_dim=self.global_head_dim, num_kv_heads=kv_heads)

    def is_sliding(self, layer: int) -> bool:
        return bool(self.layer_types) and self.layer_types[layer] == "sliding_attention"

    def is_moe(self, layer: int) -> bool:
        return self.moe is not None and layer in self.moe.layers

    def rotates(self, layer: int) -> bool:
        return layer not in self.no_rope_layers
