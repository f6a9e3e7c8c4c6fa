"""Load config, tokenizer and weights from a folder, a `.gguf`, a hub id or `bundled:NAME`.

Every source ends up as a local folder of config + tokenizer + safetensors. A GGUF file loaded
with `quantization` none is dequantized once (slow for a 1.5B model) into a bfloat16
safetensors folder under `$SPECSERVE_CACHE/converted/`, keyed by the file's path, size and
mtime, and read from there on later loads. With any other `quantization` only its config and
tokenizer are saved there, and the weights are read raw from the GGUF file at every load
(`engine.model.quant.gguf_weights`): quantized blocks stay quantized.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from filelock import FileLock
from safetensors import safe_open
from transformers import AutoConfig, AutoTokenizer, PretrainedConfig, PreTrainedTokenizerBase

from engine.config import Quantization
from engine.model.decoder import WeightValue
from engine.model.families import (
    ARCHITECTURE_OF_MODEL_TYPE,
    check_supported,
    split_fused,
    text_model,
)
from engine.model.gguf_config import gguf_config
from engine.model.gguf_dense import OWN_CONFIG_ARCHS, gguf_tokenizer
from engine.model.quantization import quantization_for_weights

_CONVERTED_DONE = "specserve-converted.json"
# model types of GGUF files whose weights and tokenizer transformers' GGUF reader cannot read:
# read here (engine.model.quant.gguf_weights, engine.model.gguf_dense.gguf_tokenizer)
_OWN_READER_TYPES = (*OWN_CONFIG_ARCHS.values(), "gpt_oss", "qwen3_5_text", "gemma4_text")


@dataclass(frozen=True)
class LoadedModel:
    name: str  # the spec it was loaded from
    hf_config: PretrainedConfig
    tokenizer: PreTrainedTokenizerBase
    weights_dir: Path  # folder holding *.safetensors with transformers parameter names
    architecture: str  # e.g. "Qwen2ForCausalLM"
    quantization: Quantization = "none"  # what the runner makes of the weights (never `auto` on
    # a float checkpoint, nor `gguf` without a .gguf file and the native kernels)
    gguf_file: Path | None = None  # weights read raw from here (weights_dir: config only)

    def iter_weights(self) -> Iterator[tuple[str, WeightValue]]:
        """(transformers name, tensor or quantized weight) pairs, read lazily one at a time;
        fused checkpoint matrices (Phi-3's) split into the other families' names."""
        yield from split_fused(self.architecture, self.hf_config, self._checkpoint_weights())

    def _checkpoint_weights(self) -> Iterator[tuple[str, WeightValue]]:
        if self.gguf_file is not None:
            from engine.model.quant.gguf_weights import read_gguf_weights

            blocks = self.quantization == "gguf"  # load_model checked that the kernels load
            yield from read_gguf_weights(self.gguf_file, self.hf_config, blocks=blocks)
            return
        files = sorted(self.weights_dir.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"no *.safetensors in {self.weights_dir}")
        for file in files:
            with safe_open(str(file), framework="pt") as f:
                for key in f.keys():
                    yield key, f.get_tensor(key)

    @property
    def generation_eos_ids(self) -> list[int]:
        """eos_token_id of generation_config.json, when the folder has one."""
        path = self.weights_dir / "generation_config.json"
        if not path.exists():
            return []
        eos = json.loads(path.read_text()).get("eos_token_id")
        return [] if eos is None else [eos] if isinstance(eos, int) else list(eos)


def _log(msg: str) -> None:
    print(f"[specserve loader] {msg}", file=sys.stderr, flush=True)


def load_model(spec: str, quantization: Quantization = "none") -> LoadedModel:
    """Resolve `spec` to a local folder and read config and tokenizer (weights stay lazy);
    `quantization` `auto` or `gguf` becomes what these weights load with here."""
    if spec.startswith("bundled:"):
        from engine.model import bundled

        path = Path(bundled.resolve(spec.removeprefix("bundled:")))
    else:
        path = Path(spec).expanduser()
    quantization = quantization_for_weights(quantization, path)
    if path.is_file() and path.suffix == ".gguf" and quantization != "none":
        loaded = _load_folder(spec, gguf_metadata(path))
        return replace(loaded, quantization=quantization, gguf_file=path)
    return replace(_load_folder(spec, _resolve(spec, path)), quantization=quantization)


def _resolve(spec: str, path: Path) -> Path:
    if path.is_file() and path.suffix == ".gguf":
        return converted_gguf(path)
    if path.is_dir():
        return path
    if path.exists() or spec.startswith((".", "/", "~", "bundled:")) or spec.count("/") != 1:
        raise FileNotFoundError(f"model {spec!r}: not a model folder, .gguf file or hub id")
    return _from_hub(spec)


def _from_hub(repo_id: str) -> Path:
    from huggingface_hub import snapshot_download

    _log(f"fetching {repo_id} from the Hugging Face hub")
    patterns = ["*.json", "*.safetensors", "tokenizer*", "*.model", "*.txt", "*.jinja"]
    try:
        return Path(snapshot_download(repo_id, allow_patterns=patterns))
    except Exception as err:  # offline, unknown repo, gated: all mean "cannot load this"
        raise FileNotFoundError(
            f"model {repo_id!r}: no such local folder or .gguf file, and the Hugging Face hub "
            f"could not provide it ({type(err).__name__}: {err})"
        ) from err


def architecture_of(config: PretrainedConfig) -> str:
    names = getattr(config, "architectures", None) or []
    if names:
        return str(names[0])
    model_type = getattr(config, "model_type", "")
    return ARCHITECTURE_OF_MODEL_TYPE.get(model_type, f"<model_type {model_type!r}>")


def _load_folder(spec: str, folder: Path) -> LoadedModel:
    config = AutoConfig.from_pretrained(str(folder))
    architecture, config = text_model(architecture_of(config), config)
    check_supported(architecture)
    _log(f"loading {spec} ({architecture}) from {folder}")
    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    return LoadedModel(spec, config, tokenizer, folder, architecture)


# --- GGUF ---------------------------------------------------------------------------------


def cache_root() -> Path:
    env = os.environ.get("SPECSERVE_CACHE")
    if env:
        return Path(env).expanduser()
    import platformdirs

    return Path(platformdirs.user_cache_dir("specserve"))


def _gguf_key(path: Path) -> str:
    stat = path.stat()
    raw = f"{path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}"
    return f"{path.stem}-{hashlib.sha256(raw.encode()).hexdigest()[:16]}"


def converted_gguf(path: Path) -> Path:
    """The bfloat16 safetensors folder converted from `path`, converting it first if needed."""
    out = cache_root() / "converted" / _gguf_key(path)
    if (out / _CONVERTED_DONE).exists():
        return out
    _checked_gguf_config(path)
    with FileLock(f"{out}.lock"):  # one process at a time (tests and servers may race)
        if not (out / _CONVERTED_DONE).exists():
            _convert_into(path, out)
    _prune_stale(path, out)
    return out


def gguf_metadata(path: Path) -> Path:
    """A folder with only the config and tokenizer of `path` (saved once; weights stay raw)."""
    out = cache_root() / "converted" / f"{_gguf_key(path)}-meta"
    if (out / _CONVERTED_DONE).exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(f"{out}.lock"):
        if not (out / _CONVERTED_DONE).exists():
            _build_atomically(out, ".meta-", lambda tmp: _save_config_and_tokenizer(path, tmp))
    _prune_stale(path, out)
    return out


def _save_config_and_tokenizer(path: Path, out: Path) -> None:
    config = _checked_gguf_config(path)
    config.save_pretrained(str(out))
    _gguf_tokenizer(path, config).save_pretrained(str(out))
    (out / _CONVERTED_DONE).write_text(json.dumps({"source": str(path.resolve())}) + "\n")


def _checked_gguf_config(path: Path) -> PretrainedConfig:
    """The file's config (engine.model.gguf_config), naming its architecture; refused unless
    the decoder runs it."""
    config = gguf_config(path)
    config.architectures = [architecture_of(config)]
    check_supported(config.architectures[0])
    return config


def _prune_stale(path: Path, keep: Path) -> None:
    """Delete earlier conversions of the same file (it was replaced: new size or mtime)."""
    source = str(path.resolve())
    for old in keep.parent.glob(f"{path.stem}-*"):
        marker = old / _CONVERTED_DONE
        if (
            old == keep
            or not marker.exists()
            or old.name.endswith("-meta") != keep.name.endswith("-meta")
        ):
            continue
        if json.loads(marker.read_text()).get("source") == source:
            _log(f"removing stale conversion {old}")
            shutil.rmtree(old, ignore_errors=True)


def _build_atomically(out: Path, prefix: str, fill: Callable[[Path], None]) -> None:
    """Fill a fresh temporary folder beside `out`, then rename it into place: a reader never sees
    a half-written folder, and a failed build leaves nothing behind."""
    tmp = Path(tempfile.mkdtemp(prefix=prefix, dir=out.parent))
    try:
        fill(tmp)
        tmp.chmod(0o755)
        shutil.rmtree(out, ignore_errors=True)
        tmp.rename(out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _convert_into(path: Path, out: Path) -> None:
    _log(f"converting {path.name} to bfloat16 safetensors (once; takes a minute or more)")
    started = time.monotonic()
    _build_atomically(out, ".converting-", lambda tmp: _convert_gguf(path, tmp))
    _log(f"converted in {time.monotonic() - started:.0f}s -> {out}")


def _convert_gguf(path: Path, out: Path) -> None:
    """Dequantize with transformers' own GGUF reader and name mapping; save bf16 safetensors."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    config = _checked_gguf_config(path)
    # transformers cannot read these files (gpt-oss: its reader expects other expert names than
    # llama.cpp's converter writes; qwen35 and gemma4: it knows no such architecture)
    if config.model_type in _OWN_READER_TYPES:
        tensors = _own_dequantized(path, config)
    else:
        with torch.device("meta"):
            skeleton = AutoModelForCausalLM.from_config(config)  # only for the tensor name map
        parsed = load_gguf_checkpoint(
            str(path), return_tensors=True, model_to_load=skeleton, torch_dtype=torch.bfloat16
        )
        tensors = parsed.pop("tensors")
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    del tensors
    config.dtype = torch.bfloat16
    config.save_pretrained(str(out))
    _gguf_tokenizer(path, config).save_pretrained(str(out))
    (out / _CONVERTED_DONE).write_text(json.dumps({"source": str(path.resolve())}) + "\n")


def _own_dequantized(path: Path, config: PretrainedConfig) -> dict[str, torch.Tensor]:
    """Every tensor of a file transformers cannot read, dequantized by gguf's own reference under
    transformers' names (q/k unpermuted, as `read_gguf_weights` gives them), in bfloat16."""
    from engine.model.quant.gguf_weights import read_gguf_weights

    weights = read_gguf_weights(path, config, exact=True)
    return {name: value.to(torch.bfloat16) for name, value in weights}  # type: ignore[union-attr]


def _gguf_tokenizer(path: Path, config: PretrainedConfig) -> PreTrainedTokenizerBase:
    """transformers' tokenizer of the file; for an architecture its GGUF reader refuses, the
    one built from the file's vocabulary alone (engine.model.gguf_dense)."""
    if config.model_type in _OWN_READER_TYPES:
        return gguf_tokenizer(path)
    return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


def check_same_vocab(target_tokenizer: object, draft_tokenizer: object) -> None:
    """A draft must speak the target's tokens: refuse with what differs."""
    target_vocab: dict[str, int] = target_tokenizer.get_vocab()  # type: ignore[attr-defined]
    draft_vocab: dict[str, int] = draft_tokenizer.get_vocab()  # type: ignore[attr-defined]
    if target_vocab == draft_vocab:
        return
    only_target = sorted(set(target_vocab) - set(draft_vocab))[:5]
    only_draft = sorted(set(draft_vocab) - set(target_vocab))[:5]
    moved = [t for t in target_vocab if t in draft_vocab and target_vocab[t] != draft_vocab[t]][:5]
    raise ValueError(
        "the draft model's tokenizer differs from the target's "
        f"({len(target_vocab)} vs {len(draft_vocab)} tokens; only in target: {only_target}; "
        f"only in draft: {only_draft}; different ids: {moved}). A draft must share the target's vocabulary."
    )
