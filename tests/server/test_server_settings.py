"""Settings: one model for the config file, SPECSERVE_* variables and `specserve serve` flags."""

from __future__ import annotations

import argparse
import typing
from pathlib import Path
from typing import Any

import pytest

from engine.config import EngineConfig
from server import command as serve_cmd
from server.settings import Settings, SettingsError

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    for key in [k for k in os.environ if k.startswith("SPECSERVE_")]:
        monkeypatch.delenv(key)


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "config.yaml"
    path.write_text(text)
    return path


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    serve_cmd.add_parser(parser.add_subparsers())
    return parser.parse_args(["serve", *argv])


def flags_of(args: argparse.Namespace) -> dict[str, Any]:
    return {k: v for k, v in vars(args).items() if k in Settings.model_fields}


def test_defaults() -> None:
    s = Settings.load(model="m")
    assert (s.host, s.port, s.max_waiting_requests, s.shutdown_grace_s) == (
        "127.0.0.1",
        8000,
        None,
        30,
    )
    assert s.speculative_method == "none" and s.api_key is None and s.model_name == "m"


def test_precedence_flags_env_file_defaults(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = write(tmp_path, "model: from-file\nport: 9001\nmax_num_seqs: 3\ndtype: float16\n")
    monkeypatch.setenv("SPECSERVE_PORT", "9002")
    monkeypatch.setenv("SPECSERVE_MAX_NUM_SEQS", "5")
    s = Settings.load(config, **flags_of(parse("--port", "9003")))
    assert s.port == 9003, "flag beats env"
    assert s.max_num_seqs == 5, "env beats file"
    assert s.dtype == "float16" and s.model == "from-file", "file beats defaults"
    assert s.block_size == 16, "defaults last"


@pytest.mark.parametrize(
    ("text", "key"),
    [
        ("model: m\nbogus_key: 1\n", "bogus_key"),
        ("model: m\nport: eighty\n", "port"),
        ("model: m\nspeculative_method: magic\n", "speculative_method"),
        ("model: m\nnum_speculative_tokens: -1\n", "num_speculative_tokens"),
        ("model: m\nspeculative_method: draft\n", "draft_model"),
        ("model: m\nngram_min: 5\nngram_max: 2\n", "ngram_min"),
        ("model: m\nkv_cache_gib: 0\n", "kv_cache_gib"),
        ("port: 1\n", "model"),
    ],
)
def test_file_errors_name_the_key(tmp_path: Path, text: str, key: str) -> None:
    with pytest.raises(SettingsError, match=key):
        Settings.load(write(tmp_path, text))


def test_env_and_flag_errors_name_the_key(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SPECSERVE_MAX_NUM_SEQS", "lots")
    with pytest.raises(SettingsError, match="max_num_seqs"):
        Settings.load(model="m")
    monkeypatch.delenv("SPECSERVE_MAX_NUM_SEQS")
    with pytest.raises(SettingsError, match="shutdown_grace_s"):
        Settings.load(**flags_of(parse("--model", "m", "--shutdown-grace-s", "-1")))


def test_file_must_be_a_mapping_of_yaml(tmp_path: Path) -> None:
    for text in ["- a\n- b\n", "model: [unclosed\n"]:
        with pytest.raises(SettingsError, match="config file"):
            Settings.load(write(tmp_path, text))
    with pytest.raises(SettingsError, match="config file"):
        Settings.load(tmp_path / "absent.yaml")


def test_every_key_has_a_flag() -> None:
    args = parse("--model", "m")
    for name in Settings.model_fields:
        flag = "--" + name.replace("_", "-")
        ns = parse(*(["--model", "m"] if name != "model" else []), flag, *_value_for(name))
        assert name in vars(ns), flag
    assert flags_of(args) == {"model": "m"}, "unset flags do not override the file or env"


def _value_for(name: str) -> list[str]:
    field = Settings.model_fields[name]
    if field.annotation is bool:
        return []
    choices = {
        "speculative_method": "ngram",
        "dtype": "float32",
        "log_level": "info",
        "quantization": "int4",
    }
    if typing.get_origin(field.annotation) is typing.Literal and name not in choices:
        return [str(typing.get_args(field.annotation)[-1])]
    return [choices.get(name, "1")]


def test_boolean_flags_both_ways(tmp_path: Path) -> None:
    config = write(tmp_path, "model: m\nenable_prefix_caching: true\n")
    off = Settings.load(config, **flags_of(parse("--no-enable-prefix-caching")))
    assert off.enable_prefix_caching is False
    assert Settings.load(config).enable_prefix_caching is True


def test_engine_config() -> None:
    s = Settings.load(**flags_of(parse(
        "--model", "t", "--draft-model", "d", "--speculative-method", "draft",
        "--num-speculative-tokens", "5", "--dtype", "float32", "--max-num-seqs", "3",
        "--max-model-len", "1024", "--kv-cache-gib", "0.5", "--speculative-disable-batch-size", "8",
    )))  # fmt: skip
    c = s.engine_config()
    assert isinstance(c, EngineConfig)
    assert (c.model, c.dtype, c.max_num_seqs, c.max_model_len, c.kv_cache_gib) == (
        "t", "float32", 3, 1024, 0.5,
    )  # fmt: skip
    assert c.speculative.method == "draft" and c.speculative.draft_model == "d"
    assert c.speculative.num_speculative_tokens == 5 and c.speculative.disable_by_batch_size == 8


@pytest.mark.parametrize("config", sorted((ROOT / "configs").glob("*.yaml")), ids=lambda p: p.name)
def test_shipped_configs_validate(config: Path) -> None:
    Settings.load(config).engine_config()


def test_serve_without_a_model_serves_the_default_config(monkeypatch: pytest.MonkeyPatch) -> None:
    """As `make serve` does: the shipped default config (the target and its EAGLE-3 head), or
    the bundled pair of configs/pair.yaml in an installed package without configs/ and heads/."""
    s = serve_cmd.load_settings(None, flags_of(parse("--port", "9100")))
    shipped = Settings.load(ROOT / "configs" / "default.yaml")
    assert s.model == shipped.model == serve_cmd.BUNDLED_PAIR["model"]
    assert s.speculative_method == "hybrid-eagle3" and s.port == 9100
    assert s.model_dump(exclude={"port"}) == shipped.model_dump(exclude={"port"})
    monkeypatch.setattr(serve_cmd, "DEFAULT_CONFIG", ROOT / "no-such.yaml")
    s = serve_cmd.load_settings(None, {})
    pair = Settings.load(ROOT / "configs" / "pair.yaml")
    assert (s.model, s.draft_model, s.speculative_method) == (
        pair.model, pair.draft_model, "hybrid",
    )  # fmt: skip
    assert (s.quantization, s.draft_quantization, s.draft_vocab_size) == (
        pair.quantization, pair.draft_quantization, pair.draft_vocab_size,
    )  # fmt: skip
    assert s.served_model_name == pair.served_model_name == shipped.served_model_name


def test_a_named_model_needs_no_default_config(monkeypatch: pytest.MonkeyPatch) -> None:
    assert serve_cmd.load_settings(None, flags_of(parse("--model", "m"))).model == "m"
    monkeypatch.setenv("SPECSERVE_MODEL", "env-model")
    assert serve_cmd.load_settings(None, {}).model == "env-model"


def test_every_engine_setting_is_a_key_with_the_engines_default() -> None:
    """An engine setting is declared once: its default lives in engine/config.py; the settings
    key (and so the YAML key, the variable and the flag) takes it from there."""
    from dataclasses import MISSING, fields

    from engine.config import EngineConfig, SpeculativeConfig
    from server.settings import _RENAMED

    key_of = {field: key for key, field in _RENAMED.items()}
    internal = {"tokenizer", "num_kv_blocks", "seed", "speculative"}  # not settings on purpose
    for cls in (EngineConfig, SpeculativeConfig):
        for f in fields(cls):
            if f.name in internal:
                continue
            key = key_of.get(f.name, f.name)
            assert key in Settings.model_fields, f"{cls.__name__}.{f.name} has no settings key"
            if f.default is not MISSING:
                assert Settings.model_fields[key].default == f.default, key
    config = Settings(model="m", speculative_method="ngram", speculative_adaptive=False)
    assert config.engine_config().speculative.method == "ngram"
    assert config.engine_config().speculative.adaptive is False
