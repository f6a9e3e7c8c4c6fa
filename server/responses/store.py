"""The Responses API's store: each stored response with its input items and the conversation
before it, so `previous_response_id` can continue it and GET can return it.

One SQLite table, in a file by default (a restart loses nothing) or in memory. Bounded twice:
responses older than the retention go first, then the oldest beyond the size limit. Every
lookup names the owner (a hash of the caller's API key, or "" without keys); another owner's
response reads as absent. A file belongs to one server process at a time: its start-up fails
the responses an earlier process left unfinished (`rewrite_unfinished`, server/responses/
interrupted.py).
"""

from __future__ import annotations

import hashlib
import json
import sqlite3
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from server.responses.interrupted import UNFINISHED

_SCHEMA = """
CREATE TABLE IF NOT EXISTS responses (
    id TEXT PRIMARY KEY,
    owner TEXT NOT NULL,
    created REAL NOT NULL,
    body TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS responses_created ON responses (created);
"""


@dataclass(frozen=True)
class StoredResponse:
    response: dict[str, Any]  # the response object as GET returns it
    input_items: list[dict[str, Any]]  # this request's input items, each with an id
    history: list[dict[str, Any]]  # the items before them (from previous_response_id)

    @property
    def context(self) -> list[dict[str, Any]]:
        """What a response continuing this one starts from (instructions are not carried)."""
        return [*self.history, *self.input_items, *self.response.get("output", [])]

    def to_json(self) -> str:
        body = {"response": self.response, "input_items": self.input_items, "history": self.history}
        return json.dumps(body, ensure_ascii=False)

    @classmethod
    def from_json(cls, text: str) -> StoredResponse:
        body = json.loads(text)
        return cls(body["response"], body["input_items"], body["history"])


def owner_of(api_key: str | None) -> str:
    """Who may see a response: a hash of the key it was created with (the key is never stored)."""
    if not api_key:
        return ""
    return hashlib.sha256(api_key.encode()).hexdigest()[:32]


class ResponseStore:
    """Thread-safe; every call is one short SQLite statement or transaction."""

    def __init__(self, path: str | Path, max_responses: int, retention_s: float) -> None:
        self.path = str(path)
        self.max_responses = max_responses
        self.retention_s = retention_s
        if self.path != ":memory:":
            Path(self.path).parent.mkdir(parents=True, exist_ok=True)
        self._db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None)
        self._lock = threading.Lock()
        with self._lock:
            if self.path != ":memory:":
                self._db.execute("PRAGMA journal_mode=WAL")
                # A commit is in the WAL once written, so a killed process loses none; only a
                # power cut may lose the last ones (never corrupting the file). Without the fsync
                # per commit, a running response's checkpoints stay cheap.
                self._db.execute("PRAGMA synchronous=NORMAL")
            self._db.executescript(_SCHEMA)

    def put(self, response_id: str, owner: str, stored: StoredResponse) -> None:
        """Insert or replace (a streamed response is stored when it starts and when it ends)."""
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                self._db.execute(
                    "INSERT INTO responses (id, owner, created, body) VALUES (?, ?, ?, ?) "
                    "ON CONFLICT(id) DO UPDATE SET body = excluded.body",
                    (response_id, owner, time.time(), stored.to_json()),
                )
                self._evict()
                self._db.execute("COMMIT")
            except BaseException:
                self._db.execute("ROLLBACK")
                raise

    def get(self, response_id: str, owner: str) -> StoredResponse | None:
        with self._lock:
            row = self._db.execute(
                "SELECT body FROM responses WHERE id = ? AND owner = ? AND created >= ?",
                (response_id, owner, self._oldest_kept()),
            ).fetchone()
        return None if row is None else StoredResponse.from_json(row[0])

    def delete(self, response_id: str, owner: str) -> bool:
        with self._lock:
            cursor = self._db.execute(
                "DELETE FROM responses WHERE id = ? AND owner = ?", (response_id, owner)
            )
        return cursor.rowcount > 0

    def rewrite_unfinished(self, change: Callable[[dict[str, Any]], dict[str, Any]]) -> list[str]:
        """Every response still queued or in progress, whoever owns it, rewritten by `change`
        (one transaction); returns their ids."""
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                rows = self._db.execute(
                    "SELECT id, body FROM responses WHERE json_extract(body, '$.response.status') "
                    f"IN ({', '.join('?' * len(UNFINISHED))})",
                    UNFINISHED,
                ).fetchall()
                for response_id, body in rows:
                    stored = StoredResponse.from_json(body)
                    changed = replace(stored, response=change(stored.response))
                    self._db.execute(
                        "UPDATE responses SET body = ? WHERE id = ?",
                        (changed.to_json(), response_id),
                    )
                self._db.execute("COMMIT")
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
        return [response_id for response_id, _ in rows]

    def __len__(self) -> int:
        with self._lock:
            return int(self._db.execute("SELECT COUNT(*) FROM responses").fetchone()[0])

    def close(self) -> None:
        with self._lock:
            self._db.close()

    def _oldest_kept(self) -> float:
        return time.time() - self.retention_s if self.retention_s > 0 else float("-inf")

    def _evict(self) -> None:
        """Expired responses, then the oldest beyond the size limit (inside put's transaction)."""
        self._db.execute("DELETE FROM responses WHERE created < ?", (self._oldest_kept(),))
        (count,) = self._db.execute("SELECT COUNT(*) FROM responses").fetchone()
        if count > self.max_responses:
            self._db.execute(
                "DELETE FROM responses WHERE id IN "
                "(SELECT id FROM responses ORDER BY created, rowid LIMIT ?)",
                (count - self.max_responses,),
            )
