"""The loader's GGUF path on a tiny GGUF file: convert once, reuse, reconvert when replaced."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from tiny import make_tiny_gguf
from transformers import AutoModelForCausalLM, AutoTokenizer

from engine.model import bundled
from engine.model.loader import load_model
from engine.model.runner import ForwardInput, ModelRunner

TEXT = "naïve café 日本語 😀 def f(x): return x"


@pytest.fixture()
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("SPECSERVE_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache" / "converted"


@pytest.fixture(scope="module")
def gguf_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf")


def test_gguf_logits_match_source_model(gguf_file: Path, cache: Path) -> None:
    """Converted weights are the source's rounded to bfloat16; same tokenizer and template."""
    loaded = load_model(str(gguf_file))
    assert loaded.architecture == "Qwen2ForCausalLM"
    assert loaded.weights_dir.parent == cache
    source = gguf_file.with_suffix(".src")
    src_tok = AutoTokenizer.from_pretrained(str(source))
    ids = list(src_tok(TEXT)["input_ids"])
    assert list(loaded.tokenizer(TEXT)["input_ids"]) == ids
    chat = [{"role": "user", "content": "hi"}]
    assert loaded.tokenizer.apply_chat_template(chat, tokenize=False) == (
        src_tok.apply_chat_template(chat, tokenize=False)
    )
    runner = ModelRunner(loaded, "cpu", "float32", 4)
    runner.allocate_kv_cache(16)
    ours = runner.forward([ForwardInput(ids, 0, list(range(16)), len(ids))])
    ref = AutoModelForCausalLM.from_pretrained(str(source), dtype=torch.float32)
    with torch.no_grad():
        for param in ref.parameters():
            param.copy_(param.to(torch.bfloat16).float())
        want = ref(torch.tensor([ids])).logits[0]
    assert (ours - want).abs().max().item() < 1e-4


def test_gguf_converted_once_then_reused(
    gguf_file: Path, cache: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    first = load_model(str(gguf_file)).weights_dir
    assert "converting" in capsys.readouterr().err
    again = load_model(str(gguf_file)).weights_dir
    assert again == first
    assert "converting" not in capsys.readouterr().err


def test_replaced_gguf_is_reconverted_and_old_copy_removed(
    tmp_path: Path, cache: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = make_tiny_gguf(tmp_path / "replaced.gguf", seed=0)
    first = load_model(str(path)).weights_dir
    stat = path.stat()
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))
    second = load_model(str(path)).weights_dir
    assert second != first
    assert "converting" in capsys.readouterr().err
    assert second.exists() and not first.exists()


def test_bundled_spec_resolves_through_bundled(
    gguf_file: Path, cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    asked: list[str] = []

    def resolve(name: str) -> Path:
        asked.append(name)
        return gguf_file

    monkeypatch.setattr(bundled, "resolve", resolve)
    loaded = load_model("bundled:tiny-model")
    assert asked == ["tiny-model"]
    assert loaded.name == "bundled:tiny-model"
    assert loaded.architecture == "Qwen2ForCausalLM"


def test_folder_without_weights_fails_clearly(tmp_path: Path, gguf_file: Path) -> None:
    source = gguf_file.with_suffix(".src")
    folder = tmp_path / "no-weights"
    folder.mkdir()
    for item in source.iterdir():
        if item.suffix != ".safetensors":
            (folder / item.name).write_bytes(item.read_bytes())
    loaded = load_model(str(folder))
    with pytest.raises(FileNotFoundError, match="safetensors"):
        ModelRunner(loaded, "cpu", "float32", 4)


def test_unreachable_hub_id_fails_clearly(monkeypatch: pytest.MonkeyPatch) -> None:
    import huggingface_hub

    def offline(repo_id: str, **kwargs: object) -> str:
        raise ConnectionError("no network")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", offline)
    with pytest.raises(FileNotFoundError, match="some-org/some-model.*ConnectionError"):
        load_model("some-org/some-model")
