"""Server settings: one model for the YAML config file, `SPECSERVE_*` variables and CLI flags.

Precedence: flags > environment > config file > defaults. Unknown keys are errors.
"""

from __future__ import annotations

from contextvars import ContextVar
from dataclasses import MISSING, fields
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import Field, ValidationError, model_validator
from pydantic_settings import (
    BaseSettings,
    InitSettingsSource,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
)

from engine.config import (
    NEEDS_DRAFT_MODEL,
    PROPOSERS,
    EngineConfig,
    Quantization,
    SpecMethod,
    SpeculativeConfig,
)

# The tool-call formats of server/openai/tool_formats.py (named like vLLM's --tool-call-parser).
ToolParserName = Literal[
    "auto", "hermes", "llama3_json", "mistral", "granite", "phi4_mini_json", "glm4"
]

# Engine settings renamed at the edge (settings key -> SpeculativeConfig field); every other engine
# setting has its field's own name. Engine fields with no key here: tokenizer, num_kv_blocks, seed.
_RENAMED = {
    "speculative_method": "method",
    "speculative_disable_batch_size": "disable_by_batch_size",
    "speculative_adaptive": "adaptive",
    "speculative_tree_width": "tree_width",
}
_ENGINE_FIELDS = {f.name: f for f in fields(EngineConfig)}
_SPEC_FIELDS = {f.name: f for f in fields(SpeculativeConfig)}


def engine_default(key: str) -> Any:
    """The engine's own default for a settings key: every engine default is written once, in
    engine/config.py, and the file, the variables and the flags start from it."""
    name = _RENAMED.get(key, key)
    found = _SPEC_FIELDS.get(name) or _ENGINE_FIELDS[name]
    assert found.default is not MISSING, f"{key} has no default in engine/config.py"
    return found.default


# The file's values for the `Settings` being built now (a settings source cannot take arguments).
_file_values: ContextVar[dict[str, Any] | None] = ContextVar("_file_values", default=None)


class SettingsError(ValueError):
    """A bad config file, variable or flag; the message names the key."""


class Settings(BaseSettings):
    model_config = SettingsConfigDict(
        env_prefix="SPECSERVE_", extra="forbid", validate_default=True, frozen=True
    )

    model: str = Field(description="target model: folder, .gguf file, hub id or bundled:NAME")
    draft_model: str | None = Field(
        default=engine_default("draft_model"),
        description="draft model for --speculative-method draft",
    )
    served_model_name: str | None = Field(default=None, description="model name clients use")
    speculative_method: SpecMethod = Field(
        default=engine_default("speculative_method"),
        description="speculation: none, draft (a small model), ngram (prompt lookup), "
        "hybrid (an n-gram match where there is one, else the draft model), "
        "eagle3 (an EAGLE-3 head, draft_model its folder, reading the target's hidden states), "
        "hybrid-eagle3 (an n-gram match where there is one, else the EAGLE-3 head), "
        "mtp (the target's own multi-token-prediction layer: Qwen3.5)",
    )
    num_speculative_tokens: int = Field(
        default=engine_default("num_speculative_tokens"),
        ge=0,
        le=64,
        description="k: draft tokens per step",
    )
    speculative_tree_width: int = Field(
        default=engine_default("speculative_tree_width"),
        ge=1,
        le=8,
        description="branches per level of a draft tree (n-gram, eagle3, draft model); 1: chains",
    )
    ngram_min: int = Field(
        default=engine_default("ngram_min"),
        ge=1,
        description="shortest n-gram the n-gram proposer matches",
    )
    ngram_max: int = Field(
        default=engine_default("ngram_max"),
        ge=1,
        description="longest n-gram the n-gram proposer matches",
    )
    speculative_disable_batch_size: int = Field(
        default=engine_default("speculative_disable_batch_size"),
        ge=0,
        description="decode plainly above this many running requests (0: never)",
    )
    speculative_adaptive: bool = Field(
        default=engine_default("speculative_adaptive"),
        description="choose each step's k from measured costs and acceptance",
    )
    draft_p_min: float = Field(
        default=engine_default("draft_p_min"),
        ge=0.0,
        lt=1.0,
        description="stop drafting below this draft probability",
    )
    draft_vocab_size: int | None = Field(
        default=engine_default("draft_vocab_size"),
        ge=1,
        description="the draft proposes only from the first this many token ids, a smaller head "
        "(null: the whole vocabulary)",
    )
    draft_compile: bool = Field(
        default=engine_default("draft_compile"),
        description="run the draft's single-request decode through a torch.compile'd graph "
        "(compiled at start; cached on disk)",
    )
    device: str = Field(default=engine_default("device"), description="cpu, cuda, cuda:N")
    tensor_parallel_size: int = Field(
        default=engine_default("tensor_parallel_size"),
        ge=1,
        description="shard the target over this many ranks (gloo on CPU, NCCL on CUDA)",
    )
    dtype: Literal["float32", "bfloat16", "float16"] = Field(
        default=engine_default("dtype"), description="weights"
    )
    quantization: Quantization = Field(
        default=engine_default("quantization"),
        description="auto: the fastest path here (a GGUF's blocks on the native kernels, on "
        "torch's int4/int8 kernels without them; dense on CUDA or for a float checkpoint); gguf: "
        "a GGUF's blocks on the native kernels; none: dequantize to dtype; int8/int4: quantize a "
        "float checkpoint at load; w8a8: int8 weights and int8 activations in two passes "
        "(fbgemm, x86 CPUs); w8a8-fast: one pass, 7-bit activations (for a draft)",
    )
    draft_quantization: Quantization | None = Field(
        default=engine_default("draft_quantization"),
        description="the draft model's quantization (null: the target's)",
    )
    host: str = Field(default="127.0.0.1", description="address to listen on")
    port: int = Field(default=8000, ge=0, le=65535, description="port to listen on")
    playground: bool = Field(
        default=True, description="serve the playground page at / (false: the API only)"
    )
    api_key: str | None = Field(
        default=None, description="require this bearer token (all but /health, /live, /metrics)"
    )
    max_num_seqs: int = Field(
        default=engine_default("max_num_seqs"), ge=1, description="most requests in one batch"
    )
    max_num_batched_tokens: int = Field(
        default=engine_default("max_num_batched_tokens"),
        ge=1,
        description="token budget of one step",
    )
    max_model_len: int | None = Field(
        default=engine_default("max_model_len"),
        ge=1,
        description="context window (default: model's)",
    )
    block_size: int = Field(
        default=engine_default("block_size"), ge=1, description="KV cache block size in tokens"
    )
    kv_cache_gib: float = Field(
        default=engine_default("kv_cache_gib"), gt=0, description="KV cache size, GiB"
    )
    gpu_memory_utilization: float = Field(
        default=engine_default("gpu_memory_utilization"),
        gt=0,
        le=1,
        description="on CUDA: share of the device's memory this process may hold (the KV pool "
        "gets kv_cache_gib or the rest of this share, whichever is less)",
    )
    enable_prefix_caching: bool = Field(
        default=engine_default("enable_prefix_caching"),
        description="reuse KV blocks of shared prefixes",
    )
    num_state_snapshots: int = Field(
        default=engine_default("num_state_snapshots"),
        ge=0,
        description="a hybrid target's prefix cache: linear-layer state snapshots kept (0: off)",
    )
    num_threads: int | None = Field(
        default=engine_default("num_threads"), ge=1, description="torch threads on CPU"
    )
    max_waiting_requests: int | None = Field(
        default=None,
        ge=1,
        description="a fixed cap: 429 once this many wait (default none: the queue is bounded "
        "by max_waiting_gib and max_queue_wait_s)",
    )
    max_waiting_gib: float = Field(
        default=1.0,
        gt=0,
        description="memory the waiting requests may hold, estimated per request (connection, "
        "state, prompt tokens); 429 beyond",
    )
    max_queue_wait_s: float = Field(
        default=300.0,
        gt=0,
        description="429 when the waiting queue would take longer than this to drain at the "
        "measured completion rate",
    )
    shutdown_grace_s: float = Field(
        default=30.0, ge=0, description="on SIGTERM, time to finish requests"
    )
    metrics_compat: Literal["vllm", "none"] = Field(
        default="vllm",
        description="also export the vllm: metric names routers read (none: only specserve:)",
    )
    response_store: Literal["sqlite", "memory"] = Field(
        default="sqlite",
        description="where /v1/responses keeps stored responses: sqlite (a file, kept across "
        "restarts) or memory",
    )
    response_store_path: str | None = Field(
        default=None,
        description="the response store's SQLite file (default: responses.sqlite3 in "
        "specserve's user data folder)",
    )
    response_store_max: int = Field(
        default=10000, ge=1, description="most stored responses; the oldest go first"
    )
    response_store_retention_s: float = Field(
        default=30 * 86400.0,
        ge=0,
        description="seconds a stored response is kept (0: until the size limit evicts it)",
    )
    tool_call_parser: ToolParserName = Field(
        default="auto",
        description="the model's tool-call format: hermes (Qwen), llama3_json, mistral, granite, "
        "phi4_mini_json, glm4 (GLM-4-0414); auto: the one its chat template shows, else hermes",
    )
    log_level: Literal["debug", "info", "warning", "error"] = Field(
        default="info", description="logging"
    )

    @model_validator(mode="after")
    def _consistent(self) -> Settings:
        if NEEDS_DRAFT_MODEL & set(PROPOSERS[self.speculative_method]) and not self.draft_model:
            raise ValueError(
                f"draft_model: required when speculative_method is {self.speculative_method}"
            )
        if self.ngram_min > self.ngram_max:
            raise ValueError("ngram_min: must be <= ngram_max")
        if self.quantization == "w8a8-fast":
            raise ValueError("quantization: w8a8-fast is for a draft model (draft_quantization)")
        return self

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        file_settings = InitSettingsSource(settings_cls, init_kwargs=_file_values.get() or {})
        return init_settings, env_settings, file_settings

    @classmethod
    def load(cls, config_file: str | Path | None = None, **flags: Any) -> Settings:
        """Build from a YAML file, the environment and flags; `SettingsError` names the bad key."""
        token = _file_values.set(read_config_file(config_file) if config_file else {})
        try:
            return cls(**flags)
        except ValidationError as exc:
            raise SettingsError(format_validation_error(exc, config_file)) from None
        finally:
            _file_values.reset(token)

    @property
    def model_name(self) -> str:
        return self.served_model_name or self.model

    @property
    def response_store_file(self) -> str:
        """The SQLite database of the response store (":memory:" for the memory-only store)."""
        if self.response_store == "memory":
            return ":memory:"
        if self.response_store_path:
            return self.response_store_path
        import platformdirs

        return str(Path(platformdirs.user_data_dir("specserve")) / "responses.sqlite3")

    def engine_config(self) -> EngineConfig:
        """The engine's config from the settings of the same names (`_RENAMED` aside)."""
        values = self.model_dump()
        spec = {f: values[k] for k, f in _keys(_SPEC_FIELDS).items()}
        engine = {f: values[k] for k, f in _keys(_ENGINE_FIELDS).items()}
        return EngineConfig(**engine, speculative=SpeculativeConfig(**spec))


def _keys(engine_fields: dict[str, Any]) -> dict[str, str]:
    """settings key -> engine field, for the engine fields that are settings."""
    key_of = {field: key for key, field in _RENAMED.items()}
    keys = {key_of.get(name, name): name for name in engine_fields}
    return {key: name for key, name in keys.items() if key in Settings.model_fields}


def read_config_file(path: str | Path) -> dict[str, Any]:
    try:
        data = yaml.safe_load(Path(path).read_text())
    except OSError as exc:
        raise SettingsError(f"config file {path}: {exc.strerror}") from None
    except yaml.YAMLError as exc:
        raise SettingsError(f"config file {path}: not valid YAML: {exc}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise SettingsError(f"config file {path}: must be a mapping of key: value")
    unknown = sorted(str(k) for k in data if k not in Settings.model_fields)
    if unknown:
        raise SettingsError(f"config file {path}: unknown key(s): {', '.join(unknown)}")
    return data


def format_validation_error(exc: ValidationError, config_file: str | Path | None) -> str:
    lines = []
    for err in exc.errors():
        key = ".".join(str(part) for part in err["loc"])
        msg = err["msg"].removeprefix("Value error, ")
        if err["type"] == "extra_forbidden":
            msg = "unknown key"
        lines.append(f"{key}: {msg}" if key else msg)
    where = f" (config file {config_file})" if config_file else ""
    return f"invalid settings{where}: " + "; ".join(lines)
