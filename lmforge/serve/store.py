"""Conversations kept by the server in SQLite, for the chat page (`lmforge serve --history PATH`).

One row per conversation: id, title, created/updated times and the conversation itself as JSON
(the page's message tree with its branches, system prompt and settings; the store does not
interpret it). The database runs in WAL mode with synchronous=FULL, and every change is one
transaction, so a conversation whose write returned is on disk: killing the server (SIGKILL)
mid-write loses at most the write in flight, never a committed one (tests/serve/test_store.py).
Export/import move every conversation as one JSON document.
"""

from __future__ import annotations

import json
import sqlite3
import threading
import time
import uuid
from pathlib import Path
from typing import Any

from lmforge.errors import ConfigError

SCHEMA = """
CREATE TABLE IF NOT EXISTS conversations (
    id TEXT PRIMARY KEY,
    title TEXT NOT NULL,
    created REAL NOT NULL,
    updated REAL NOT NULL,
    data TEXT NOT NULL
)
"""
EXPORT_FORMAT = "lmforge-conversations/1"


class ConversationStore:
    """Thread-safe CRUD over one SQLite file (":memory:" keeps them for this process only)."""

    def __init__(self, path: str | Path = ":memory:"):
        self.path = str(path)
        if self.path != ":memory:":
            self.path = str(Path(self.path).expanduser())
            Path(self.path).parent.mkdir(parents=True, exist_ok=True)
        try:
            self.db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None)
            self.db.execute("PRAGMA journal_mode=WAL")
            self.db.execute("PRAGMA synchronous=FULL")
            self.db.execute(SCHEMA)
        except sqlite3.DatabaseError as err:
            raise ConfigError(
                f"--history {self.path}: not a usable SQLite database ({err})"
            ) from None
        self.db.row_factory = sqlite3.Row  # rows convert to {column: value} dicts
        self.lock = threading.Lock()

    def close(self) -> None:
        with self.lock:
            self.db.close()

    def list(self) -> list[dict[str, Any]]:
        """Every conversation's id, title and times, most recently updated first."""
        with self.lock:
            query = "SELECT id, title, created, updated FROM conversations ORDER BY updated DESC"
            return [dict(row) for row in self.db.execute(query)]

    def get(self, conversation_id: str) -> dict[str, Any] | None:
        with self.lock:
            query = "SELECT id, title, created, updated, data FROM conversations WHERE id = ?"
            row = self.db.execute(query, (conversation_id,)).fetchone()
        return None if row is None else {**dict(row), "data": json.loads(row["data"])}

    def save(
        self,
        title: str,
        data: Any,
        conversation_id: str | None = None,
        created: float | None = None,
        updated: float | None = None,
    ) -> dict[str, Any]:
        """Create (no id, or an id not stored yet) or replace a conversation; one transaction.
        `created` / `updated`: the times to keep (an import), else now."""
        now = updated or time.time()
        cid = conversation_id or uuid.uuid4().hex
        text = json.dumps(data, ensure_ascii=False)
        with self.lock, self.db:  # the connection commits the transaction, or rolls it back
            self.db.execute("BEGIN IMMEDIATE")
            old = self.db.execute("SELECT created FROM conversations WHERE id = ?", (cid,))
            born = next((row["created"] for row in old), created or now)
            self.db.execute(
                "INSERT OR REPLACE INTO conversations (id, title, created, updated, data) "
                "VALUES (?, ?, ?, ?, ?)", (cid, title, born, now, text),
            )  # fmt: skip
        return {"id": cid, "title": title, "created": born, "updated": now}

    def delete(self, conversation_id: str) -> bool:
        with self.lock:
            cur = self.db.execute("DELETE FROM conversations WHERE id = ?", (conversation_id,))
        return cur.rowcount > 0

    def export(self) -> dict[str, Any]:
        """Every conversation, as one JSON-ready document."""
        items = [self.get(c["id"]) for c in self.list()]
        return {"format": EXPORT_FORMAT, "conversations": [c for c in items if c is not None]}

    def import_(self, document: Any) -> int:
        """Add (or replace, by id) the conversations of an `export` document; returns how many."""
        if not isinstance(document, dict) or document.get("format") != EXPORT_FORMAT:
            raise ConfigError(f"import: expected a document with format {EXPORT_FORMAT!r}")
        items = document.get("conversations")
        if not isinstance(items, list):
            raise ConfigError("import: 'conversations' must be a list")
        for i, item in enumerate(items):
            if not isinstance(item, dict) or not isinstance(item.get("title"), str) \
                    or "data" not in item:  # fmt: skip
                raise ConfigError(f"import: conversations[{i}] needs a 'title' and 'data'")
        for item in items:
            self.save(item["title"], item["data"], item.get("id"), item.get("created"),
                      item.get("updated"))  # fmt: skip
        return len(items)
