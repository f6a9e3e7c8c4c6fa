"""Peers: transformers' own `generate` on the same prompts, model, dtype and threads, one at a time.

Run in a subprocess (`python -m bench.serving.peers REQUEST.json RESULT.json`) after the server has stopped,
so that the two never compete for the cores. Modes:
- `hf`: plain greedy `generate`;
- `hf-assisted`: `generate(assistant_model=draft)`, transformers' assisted generation;
- `hf-prompt-lookup`: `generate(prompt_lookup_num_tokens=k)`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from bench.serving.client import RequestResult
from bench.serving.datasets import Prompt

PEER_MODES = ("hf", "hf-assisted", "hf-prompt-lookup")


@dataclass(frozen=True)
class PeerJob:
    model: str
    draft_model: str | None
    dtype: str
    device: str
    num_threads: int | None
    modes: tuple[str, ...]
    prompts: dict[str, list[dict[str, Any]]]  # category -> Prompt fields
    max_tokens: int
    ignore_eos: bool
    repeats: int
    num_speculative_tokens: int  # assistant tokens / prompt-lookup tokens per step


def run_peers_subprocess(job: PeerJob, workdir: Path) -> list[dict[str, Any]]:
    """Runs the peers in a fresh interpreter; returns one record per request."""
    workdir.mkdir(parents=True, exist_ok=True)
    req, out = workdir / "peers_job.json", workdir / "peers_results.json"
    req.write_text(json.dumps(asdict(job)))
    subprocess.run([sys.executable, "-m", "bench.serving.peers", str(req), str(out)], check=True)
    records: list[dict[str, Any]] = json.loads(out.read_text())
    return records


# ---------------------------------------------------------------- inside the subprocess


class TimingStreamer:
    """A transformers streamer that notes when each batch of new tokens arrives."""

    def __init__(self) -> None:
        self.prompt_seen = False
        self.arrivals: list[tuple[float, int]] = []  # (perf_counter, tokens)

    def put(self, value: Any) -> None:
        if not self.prompt_seen:  # generate() first hands over the prompt itself
            self.prompt_seen = True
            return
        self.arrivals.append((time.perf_counter(), int(value.numel())))

    def end(self) -> None:
        pass


def load_hf_model(spec: str, dtype: str, device: str) -> tuple[Any, Any]:
    """(model, tokenizer) through engine.model.loader, so that GGUF and bundled: specs resolve to the same
    converted folder the server reads."""
    import torch
    from transformers import AutoModelForCausalLM

    from engine.model.loader import load_model

    loaded = load_model(spec)
    model: Any = AutoModelForCausalLM.from_pretrained(
        str(loaded.weights_dir), dtype=getattr(torch, dtype)
    )
    return model.to(device).eval(), loaded.tokenizer


def prompt_ids(tokenizer: Any, prompt: Prompt) -> list[int]:
    if prompt.is_chat:
        text = tokenizer.apply_chat_template(
            prompt.message_dicts(), tokenize=False, add_generation_prompt=True
        )
        return list(tokenizer(text, add_special_tokens=False)["input_ids"])
    return list(tokenizer(prompt.prompt)["input_ids"])


def generate_one(
    model: Any, tokenizer: Any, ids: list[int], mode: str, job: PeerJob, draft: Any
) -> RequestResult:
    import torch

    streamer = TimingStreamer()
    kwargs: dict[str, Any] = dict(max_new_tokens=job.max_tokens, do_sample=False, streamer=streamer)
    if job.ignore_eos:
        kwargs["min_new_tokens"] = job.max_tokens
    if mode == "hf-assisted":
        kwargs["assistant_model"] = draft
        kwargs["num_assistant_tokens"] = job.num_speculative_tokens
        kwargs["num_assistant_tokens_schedule"] = "constant"
    elif mode == "hf-prompt-lookup":
        kwargs["prompt_lookup_num_tokens"] = job.num_speculative_tokens
    input_ids = torch.tensor([ids], device=model.device)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    result = RequestResult("", mode, prompt_tokens=len(ids))
    result.start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(
            input_ids, attention_mask=torch.ones_like(input_ids), pad_token_id=pad, **kwargs
        )
    end = time.perf_counter()
    _fill_timing(result, streamer, end, int(out.shape[1]) - len(ids))
    return result


def _fill_timing(result: RequestResult, streamer: TimingStreamer, end: float, n_out: int) -> None:
    result.ok = n_out > 0
    result.e2e_s = end - result.start
    result.output_tokens = n_out
    last = result.start
    for i, (at, n) in enumerate(streamer.arrivals):
        if i == 0:
            result.ttft_s = at - result.start
        else:
            result.itl_s.extend([(at - last) / n] * n)
        last = at
        result.num_chunks += 1


def run_job(job: PeerJob) -> list[dict[str, Any]]:
    import torch
    from tqdm import tqdm

    torch.set_num_threads(job.num_threads or os.cpu_count() or 1)
    model, tokenizer = load_hf_model(job.model, job.dtype, job.device)
    draft = None
    if "hf-assisted" in job.modes:
        if not job.draft_model:
            raise ValueError("hf-assisted needs a draft model")
        draft, _ = load_hf_model(job.draft_model, job.dtype, job.device)
    prompts = {c: [Prompt(**_prompt_args(p)) for p in ps] for c, ps in job.prompts.items()}
    warmup(model, tokenizer, draft, job, next(iter(prompts.values()))[0])
    total = job.repeats * len(job.modes) * sum(map(len, prompts.values()))
    records = []
    with tqdm(total=total, desc="peers", unit="req") as bar:
        for repeat in range(job.repeats):
            for category, plist in prompts.items():
                for i, prompt in enumerate(plist):
                    ids = prompt_ids(tokenizer, prompt)
                    # Rotate the order per prompt so drift falls on every mode alike.
                    shift = (i + repeat) % len(job.modes)
                    for mode in job.modes[shift:] + job.modes[:shift]:
                        res = generate_one(model, tokenizer, ids, mode, job, draft)
                        res.prompt_id = prompt.prompt_id
                        records.append({"category": category, "repeat": repeat, **asdict(res)})
                        bar.update(1)
    return records


def warmup(model: Any, tokenizer: Any, draft: Any, job: PeerJob, prompt: Prompt) -> None:
    """One short generate per mode, so that one-off costs stay out of the first measurement."""
    short = replace(job, max_tokens=4, ignore_eos=False)
    ids = prompt_ids(tokenizer, prompt)
    for mode in job.modes:
        generate_one(model, tokenizer, ids, mode, short, draft)


def _prompt_args(fields: dict[str, Any]) -> dict[str, Any]:
    messages = fields.get("messages")
    if messages is not None:
        fields = {**fields, "messages": tuple(tuple(m) for m in messages)}
    return fields


def main(argv: list[str]) -> int:
    job_path, out_path = Path(argv[0]), Path(argv[1])
    raw = json.loads(job_path.read_text())
    raw["modes"] = tuple(raw["modes"])
    records = run_job(PeerJob(**raw))
    out_path.write_text(json.dumps(records))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
