"""Tiny random models and a tiny byte-level BPE tokenizer for tests that run anywhere in seconds."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    AutoModelForCausalLM,
    Gemma3TextConfig,
    Gemma4TextConfig,
    Glm4Config,
    GptOssConfig,
    GraniteConfig,
    LlamaConfig,
    MistralConfig,
    Olmo2Config,
    Phi3Config,
    PretrainedConfig,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen3_5TextConfig,
    Qwen3Config,
    Qwen3MoeConfig,
    SmolLM3Config,
)

EOS = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = [EOS, IM_START, IM_END]

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

_CORPUS = [
    "The quick brown fox jumps over the lazy dog. The dog sleeps in the sun.",
    "Speculative decoding lets a small draft model propose tokens that a large model verifies.",
    "Once upon a time there was a little server that answered every request it was given.",
    "Hello, world! How are you today? I am fine, thank you. What is your name?",
    "def fibonacci(n: int) -> int:\n    if n < 2:\n        return n\n"
    "    return fibonacci(n - 1) + fibonacci(n - 2)\n",
    "for i in range(10):\n    print(i * i)\n",
    "import torch\nx = torch.zeros(3, 4)\ny = x.sum(dim=-1)\n",
    "class Request:\n    def __init__(self, prompt):\n        self.prompt = prompt\n",
    '{"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}',
    "naïve café 日本語 😀 résumé Ünïcödé Straße 中文 한국어 emoji 🚀🎉",
    "1 2 3 4 5 6 7 8 9 10 100 1000 3.14159 2.71828",
]


def build_tiny_tokenizer(path: str | Path, vocab_size: int = 400) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE on the built-in corpus; save it with a ChatML template at path."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS * 4, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=EOS,
        pad_token=EOS,
        additional_special_tokens=[IM_START, IM_END],
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(path))
    return fast


_FAMILIES: dict[str, type[PretrainedConfig]] = {
    "llama": LlamaConfig,
    "qwen2": Qwen2Config,
    "qwen3": Qwen3Config,
    "mistral": MistralConfig,
    "gemma3": Gemma3TextConfig,
    "gemma4": Gemma4TextConfig,
    "phi3": Phi3Config,
    "granite": GraniteConfig,
    "smollm3": SmolLM3Config,
    "olmo2": Olmo2Config,
    "glm4": Glm4Config,
    "qwen3_5": Qwen3_5TextConfig,
    "qwen3_moe": Qwen3MoeConfig,
    "gpt_oss": GptOssConfig,
}


def tiny_config(
    family: str,
    vocab_size: int,
    eos_token_id: int,
    num_layers: int = 2,
    hidden_size: int = 64,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int = 128,
    max_position_embeddings: int = 512,
    tie_word_embeddings: bool | None = None,
    **overrides: Any,
) -> PretrainedConfig:
    """A small config of the family; tied embeddings by default for qwen2/qwen3/gemma3/smollm3."""
    if tie_word_embeddings is None:
        tie_word_embeddings = family in ("qwen2", "qwen3", "gemma3", "smollm3")
    kwargs: dict[str, Any] = dict(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        intermediate_size=intermediate_size,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=tie_word_embeddings,
        head_dim=hidden_size // num_heads,
        # Large init so that random logits have a clear argmax (greedy-equality tests need no ties).
        initializer_range=0.2,
        rms_norm_eps=1e-6,
        bos_token_id=eos_token_id,
        eos_token_id=eos_token_id,
        pad_token_id=eos_token_id,
    )
    if family == "mistral":
        kwargs["sliding_window"] = None
    kwargs.update(overrides)
    return _FAMILIES[family](**kwargs)


def make_tiny_model(path: str | Path, family: str = "qwen2", seed: int = 0, **config: Any) -> Path:
    """Build a random float32 model of the family with the tiny tokenizer; save all at path.

    `config` takes tiny_config's keywords (num_layers, hidden_size, ...) and config overrides."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tiny_tokenizer(path)
    eos_id = int(tokenizer.convert_tokens_to_ids(EOS))  # type: ignore[arg-type]
    hf_config = tiny_config(family, vocab_size=len(tokenizer), eos_token_id=eos_id, **config)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32)
    _spread_norm_weights(model, seed)
    model.save_pretrained(str(path))
    return path


# The hybrid Qwen3.5's linear-attention sizes, small (its defaults are 16 key heads of 128)
_QWEN3_5_LINEAR = dict(
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=8,
    linear_value_head_dim=16,
    num_layers=4,  # three Gated DeltaNet layers, then one full-attention layer
)


def make_tiny_qwen3_5(path: str | Path, seed: int = 0, **config: Any) -> Path:
    """A tiny hybrid Qwen3.5 (Qwen3_5ForCausalLM): make_tiny_model with small linear layers."""
    return make_tiny_model(path, family="qwen3_5", seed=seed, **(_QWEN3_5_LINEAR | config))


def _spread_norm_weights(model: torch.nn.Module, seed: int) -> None:
    """Norm weights start at ones; perturb them so a wrong norm (or missing q/k norm) shows up.

    The final norm is doubled: it scales the logits (std ~3), spreading the top-1/top-2 gap.
    """
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.add_(0.2 * torch.randn(param.shape, generator=gen))
            if name == "model.norm.weight":
                param.mul_(2.0)


def make_tiny_gguf(path: str | Path, seed: int = 0, **overrides: Any) -> Path:
    """A tiny qwen2-family model written as an F32 GGUF file (llama.cpp's names and metadata).

    Qwen2 needs no q/k permutation, so tensors are written as transformers holds them. The
    source folder (config, tokenizer, safetensors) is kept next to it as `<path>.src`.
    """
    import json

    import gguf
    from safetensors.torch import load_file

    path = Path(path)
    src = make_tiny_model(path.with_suffix(".src"), family="qwen2", seed=seed, **overrides)
    config = json.loads((src / "config.json").read_text())
    writer = gguf.GGUFWriter(str(path), "qwen2")
    _gguf_hparams(writer, config)
    _gguf_tokenizer(writer, src)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.QWEN2, config["num_hidden_layers"])
    for name, tensor in load_file(str(src / "model.safetensors")).items():
        base, suffix = name.rsplit(".", 1)
        writer.add_tensor(f"{names.get_name(base)}.{suffix}", tensor.float().numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _gguf_hparams(writer: Any, config: dict[str, Any]) -> None:
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    writer.add_rope_freq_base(config.get("rope_parameters", {}).get("rope_theta", 10000.0))
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])


def _gguf_tokenizer(writer: Any, src: Path) -> None:
    import json

    import gguf

    spec = json.loads((src / "tokenizer.json").read_text())
    vocab: dict[str, int] = spec["model"]["vocab"]
    tokens = sorted(vocab, key=vocab.__getitem__)
    special = {t["content"] for t in spec["added_tokens"]}
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2")
    writer.add_token_list(tokens)
    writer.add_token_types(
        [gguf.TokenType.CONTROL if t in special else gguf.TokenType.NORMAL for t in tokens]
    )
    merges = spec["model"]["merges"]
    writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in merges])
    for add in (writer.add_eos_token_id, writer.add_bos_token_id, writer.add_pad_token_id):
        add(vocab[EOS])
    writer.add_chat_template(CHAT_TEMPLATE)
