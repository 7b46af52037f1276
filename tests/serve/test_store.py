"""The chat page's conversation store: SQLite CRUD, export/import, the /api/conversations routes,
and no committed conversation lost when the writer is killed with SIGKILL mid-write."""

import os
import signal
import sqlite3
import subprocess
import sys
import textwrap
import time

import pytest
import requests

from lmforge.errors import ConfigError
from lmforge.serve.app import create_app
from lmforge.serve.store import ConversationStore

TREE = {"nodes": [{"id": "a", "parent": None, "role": "user", "content": "2+2? ∑"}],
        "leaf": "a", "settings": {"temperature": 0.7}}  # fmt: skip


def test_crud_and_export_import_round_trip(tmp_path):
    store = ConversationStore(tmp_path / "h.sqlite3")
    first = store.save("maths", TREE)
    second = store.save("other", {"nodes": []})
    assert store.get(first["id"])["data"] == TREE
    time.sleep(0.01)
    again = store.save("maths, renamed", {**TREE, "leaf": None}, first["id"])
    assert again["created"] == first["created"] and again["updated"] > first["updated"]
    assert [c["id"] for c in store.list()] == [first["id"], second["id"]]  # newest first
    document = store.export()
    assert store.delete(second["id"]) and not store.delete(second["id"])
    fresh = ConversationStore(tmp_path / "copy.sqlite3")
    assert fresh.import_(document) == 2
    assert fresh.export()["conversations"] == document["conversations"]
    with pytest.raises(ConfigError, match="format"):
        fresh.import_({"conversations": []})
    with pytest.raises(ConfigError, match=r"conversations\[0\]"):
        fresh.import_({"format": document["format"], "conversations": [{"data": {}}]})
    store.close()
    reopened = ConversationStore(tmp_path / "h.sqlite3")  # survives a restart
    assert reopened.get(first["id"])["title"] == "maths, renamed"


def test_not_a_database_is_one_clear_line(tmp_path):
    bad = tmp_path / "h.sqlite3"
    bad.write_bytes(b"not sqlite at all" * 100)
    with pytest.raises(ConfigError, match="not a usable SQLite database"):
        ConversationStore(bad)


def test_routes_keep_the_api_key(make_engine, live_server, api_key, tmp_path):
    app = create_app(make_engine(), "tiny", api_key=api_key, history=tmp_path / "h.sqlite3")
    url = live_server(app).url + "/api/conversations"
    auth = {"Authorization": f"Bearer {api_key}"}
    assert requests.get(url, timeout=30).status_code == 401
    made = requests.post(url, json={"title": "t", "data": TREE}, headers=auth, timeout=30).json()
    assert requests.get(f"{url}/{made['id']}", headers=auth, timeout=30).json()["data"] == TREE
    put = requests.put(f"{url}/{made['id']}", json={"title": "u", "data": {}}, headers=auth,
                       timeout=30)  # fmt: skip
    assert put.json()["title"] == "u"
    listed = requests.get(url, headers=auth, timeout=30).json()["conversations"]
    assert [c["id"] for c in listed] == [made["id"]]
    exported = requests.get(f"{url}/export", headers=auth, timeout=30).json()
    assert requests.delete(f"{url}/{made['id']}", headers=auth, timeout=30).status_code == 200
    assert requests.get(f"{url}/{made['id']}", headers=auth, timeout=30).status_code == 404
    back = requests.post(f"{url}/import", json=exported, headers=auth, timeout=30).json()
    assert back == {"imported": 1}
    bad = requests.post(url, json={"title": 5, "data": {}}, headers=auth, timeout=30)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "title"


WRITER = textwrap.dedent("""
    import sys
    from lmforge.serve.store import ConversationStore
    store = ConversationStore(sys.argv[1])
    big = {"nodes": [{"content": "x" * 20000, "i": i} for i in range(20)]}
    i = 0
    while True:
        saved = store.save(f"c{i}", {**big, "n": i})
        print(saved["id"], i, flush=True)  # printed only after the commit returned
        i += 1
""")


def test_sigkill_mid_write_loses_no_committed_conversation(tmp_path):
    path = tmp_path / "h.sqlite3"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    proc = subprocess.Popen([sys.executable, "-c", WRITER, str(path)], stdout=subprocess.PIPE,
                            text=True, env=env)  # fmt: skip
    committed = []
    try:
        while len(committed) < 15:
            line = proc.stdout.readline()
            assert line, "the writer died"
            committed.append(line.split())
    finally:
        proc.send_signal(signal.SIGKILL)  # while it is writing the next one
        proc.wait()
    db = sqlite3.connect(path)
    assert db.execute("PRAGMA integrity_check").fetchone() == ("ok",)
    db.close()
    store = ConversationStore(path)
    for cid, i in committed:
        found = store.get(cid)
        assert found is not None and found["data"]["n"] == int(i)
