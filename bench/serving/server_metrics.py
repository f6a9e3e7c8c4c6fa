"""Speculative counters from the server's /metrics, and their deltas over a measured window."""

from __future__ import annotations

from dataclasses import dataclass, field

import httpx
from prometheus_client.parser import text_string_to_metric_families

_PREFIXES = ("specserve:", "vllm:")  # vLLM's names mean the same, so its servers work too
_DRAFTS = "spec_decode_num_drafts_total"
_DRAFT_TOKENS = "spec_decode_num_draft_tokens_total"
_ACCEPTED = "spec_decode_num_accepted_tokens_total"
_PER_POS = "spec_decode_num_accepted_tokens_per_pos_total"
_BY_PROPOSER = "spec_decode_proposer_accepted_tokens_total"
_FORCED = "grammar"  # the proposer label of grammar-forced drafts


@dataclass
class SpecCounters:
    num_drafts: float = 0.0
    num_draft_tokens: float = 0.0
    num_accepted_tokens: float = 0.0
    accepted_per_pos: dict[int, float] = field(default_factory=dict)
    num_forced_tokens: float = 0.0  # accepted drafts the grammar forced (proposer "grammar")

    def __sub__(self, other: SpecCounters) -> SpecCounters:
        positions = set(self.accepted_per_pos) | set(other.accepted_per_pos)
        return SpecCounters(
            self.num_drafts - other.num_drafts,
            self.num_draft_tokens - other.num_draft_tokens,
            self.num_accepted_tokens - other.num_accepted_tokens,
            {
                p: self.accepted_per_pos.get(p, 0.0) - other.accepted_per_pos.get(p, 0.0)
                for p in positions
            },
            self.num_forced_tokens - other.num_forced_tokens,
        )

    def __add__(self, other: SpecCounters) -> SpecCounters:
        return self - SpecCounters(
            -other.num_drafts,
            -other.num_draft_tokens,
            -other.num_accepted_tokens,
            {p: -n for p, n in other.accepted_per_pos.items()},
            -other.num_forced_tokens,
        )

    @property
    def acceptance_rate(self) -> float | None:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else None

    @property
    def mean_acceptance_length(self) -> float | None:
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else None

    def acceptance_per_pos(self) -> list[float]:
        """Fraction of draft passes whose token at each position was accepted."""
        if not self.num_drafts or not self.accepted_per_pos:
            return []
        top = max(self.accepted_per_pos) + 1
        return [self.accepted_per_pos.get(p, 0.0) / self.num_drafts for p in range(top)]


def parse_spec_counters(text: str) -> SpecCounters:
    """Sums every label set (model_name, ...) of the spec_decode counters in a /metrics body."""
    counters = SpecCounters()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            name = _strip_prefix(sample.name)
            if name == _DRAFTS:
                counters.num_drafts += sample.value
            elif name == _DRAFT_TOKENS:
                counters.num_draft_tokens += sample.value
            elif name == _ACCEPTED:
                counters.num_accepted_tokens += sample.value
            elif name == _BY_PROPOSER and sample.labels.get("proposer") == _FORCED:
                counters.num_forced_tokens += sample.value
            elif name == _PER_POS and "position" in sample.labels:
                pos = int(sample.labels["position"])
                counters.accepted_per_pos[pos] = (
                    counters.accepted_per_pos.get(pos, 0.0) + sample.value
                )
    return counters


def _strip_prefix(name: str) -> str | None:
    for prefix in _PREFIXES:
        if name.startswith(prefix):
            return name[len(prefix) :]
    return None


async def scrape(client: httpx.AsyncClient) -> SpecCounters | None:
    """The counters now, or None when the server has no /metrics (deltas are then skipped)."""
    try:
        resp = await client.get("/metrics", timeout=30)
    except httpx.HTTPError:
        return None
    if resp.status_code != 200:
        return None
    return parse_spec_counters(resp.text)
