"""Prompt lookup: find the latest earlier occurrence of the text's last n tokens, propose what followed."""

from __future__ import annotations

import weakref

from engine.config import SpeculativeConfig
from engine.sample import structured
from engine.sequence import ScheduledSeq, Sequence
from engine.spec_decode.proposers.base import Proposal
from engine.spec_decode.proposers.tree import tree_from_paths

# Nodes a further match adds past where it leaves the likeliest one's path: the tokens right
# after a divergence are the ones a second match gets right, if any.
BRANCH_LEN = 3


class NgramIndex:
    """Where each n-gram of one request's text last occurred, kept current as the text grows.

    A lookup then costs n_max dict probes instead of a scan of the whole text: a scan is ~1 ms of
    Python for a 1,000-token prompt, paid for every request in every step (the planner and the
    proposer both look), which at 16 requests is a few percent of a CPU step. The text only
    ever grows (rejected drafts are never appended), so the index only ever adds."""

    def __init__(self, n_min: int, n_max: int, width: int = 1) -> None:
        self.n_min = n_min
        self.n_max = n_max
        self.width = width  # occurrences kept per n-gram: the branches a tree may draft
        self.latest: dict[tuple[int, ...], int] = {}  # n-gram -> start of its latest occurrence
        # n-gram -> starts of up to width - 1 earlier occurrences, the latest last (trees only)
        self.earlier: dict[tuple[int, ...], list[int]] = {}
        self.next_end = 1  # n-grams ending (exclusively) before this position are indexed

    def lookup(self, token_ids: list[int], k: int) -> list[int]:
        """Up to k tokens that followed the most recent earlier occurrence of the longest suffix
        n-gram (the suffix itself excluded)."""
        self._index(token_ids)
        length = len(token_ids)
        for n in range(min(self.n_max, length - 1), self.n_min - 1, -1):
            start = self.latest.get(tuple(token_ids[length - n :]))
            if start is not None:
                return token_ids[start + n : start + n + k]
        return []

    def lookup_paths(self, token_ids: list[int], k: int) -> list[list[int]]:
        """Up to `width` distinct continuations of k tokens at most, the likeliest first: the
        longest suffix n-gram's occurrences, latest first, then shorter n-grams' (the first is
        what `lookup` returns)."""
        self._index(token_ids)
        length = len(token_ids)
        paths: list[list[int]] = []
        for n in range(min(self.n_max, length - 1), self.n_min - 1, -1):
            gram = tuple(token_ids[length - n :])
            latest = self.latest.get(gram)
            starts = [] if latest is None else [latest, *reversed(self.earlier.get(gram, []))]
            for start in starts:
                path = token_ids[start + n : start + n + k]
                if path and path not in paths:
                    paths.append(path)
                if len(paths) == self.width:
                    return paths
        return paths

    def _index(self, token_ids: list[int]) -> None:
        length = len(token_ids)
        if length < self.next_end:  # not the text this index was built on
            self.latest, self.earlier, self.next_end = {}, {}, 1
        # Index every n-gram that ends before the text does: the suffix must not find itself.
        for end in range(self.next_end, length):
            for n in range(self.n_min, min(self.n_max, end) + 1):
                gram = tuple(token_ids[end - n : end])
                if self.width > 1 and gram in self.latest:
                    older = self.earlier.setdefault(gram, [])
                    older.append(self.latest[gram])
                    del older[: -(self.width - 1)]
                self.latest[gram] = end - n
        self.next_end = max(self.next_end, length)


class NgramProposer:
    name = "ngram"

    def __init__(self, config: SpeculativeConfig) -> None:
        self.n_min = config.ngram_min
        self.n_max = config.ngram_max
        self.tree_width = config.tree_width  # several matches: a tree of their continuations
        self._indexes: weakref.WeakKeyDictionary[Sequence, NgramIndex] = (
            weakref.WeakKeyDictionary()
        )  # one per live request

    def propose(self, batch: list[ScheduledSeq]) -> list[Proposal]:
        return [self.propose_one(item) for item in batch]

    def propose_one(self, item: ScheduledSeq) -> Proposal:
        k = item.k_for(self.name)
        if k == 0:
            return Proposal.empty()
        index = self._indexes.get(item.seq)
        if index is None:
            index = self._indexes[item.seq] = NgramIndex(self.n_min, self.n_max, self.tree_width)
        constraint = item.seq.constraint
        if self.tree_width > 1 and k > 1:
            paths = index.lookup_paths(item.seq.token_ids, k)
            paths = [cut for p in paths if (cut := structured.cut_drafts(constraint, p))]
            tree = tree_from_paths(paths, k, BRANCH_LEN)
            if len(paths) > 1 and not tree.is_chain:
                return Proposal(list(tree.token_ids), source=self.name, parents=tree.parents)
            drafts = paths[0] if paths else []
        else:
            drafts = structured.cut_drafts(constraint, index.lookup(item.seq.token_ids, k))
        return Proposal(drafts, source=self.name) if drafts else Proposal.empty()
