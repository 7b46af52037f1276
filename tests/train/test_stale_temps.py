"""Temp files of killed saves: remove_stale_temps deletes the orphans and nothing a live process
is writing, and the checkpoint save/resume paths call it."""

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from lmforge.fileio import (
    DEAD_WRITER_GRACE_S,
    UNOWNED_TEMP_AGE_S,
    remove_stale_temps,
    temp_file_beside,
)
from lmforge.model.config import ModelConfig
from lmforge.model.transformer import Transformer
from lmforge.train.checkpoint import load_training_state, rng_state, save_training_state
from lmforge.train.sharded_checkpoint import CHECKPOINT_DIR, save_sharded

# A writer SIGKILLed in the middle of an atomic save: its temp file is all that is left.
KILLED_WRITER = """
import os, signal, sys
from pathlib import Path
from lmforge.fileio import atomic_write

def write(tmp):
    Path(tmp).write_bytes(b"x" * 100_000)
    os.kill(os.getpid(), signal.SIGKILL)

atomic_write(sys.argv[1], write)
"""


def killed_save(target: Path) -> Path:
    """Run a real atomic save of `target` in a subprocess that is SIGKILLed mid-write; return
    the orphaned temp file it leaves (aged past the grace period)."""
    before = set(target.parent.glob(".*.tmp"))
    old = target.read_bytes() if target.exists() else None
    proc = subprocess.run([sys.executable, "-c", KILLED_WRITER, str(target)], check=False)
    assert proc.returncode == -signal.SIGKILL
    (orphan,) = set(target.parent.glob(".*.tmp")) - before
    assert orphan.stat().st_size == 100_000
    assert (target.read_bytes() if target.exists() else None) == old  # the rename never ran
    age(orphan, 2 * DEAD_WRITER_GRACE_S)
    return orphan


def age(path: Path, seconds: float) -> None:
    past = time.time() - seconds
    os.utime(path, (past, past))


def tagged(folder: Path, name: str, pid: int, host: str | None = None) -> Path:
    """A temp named as temp_file_beside names it, but for process `pid` (and another host)."""
    fd, tmp = temp_file_beside(folder / name)
    os.close(fd)
    new = re.sub(r"-\d+(\.[^.]+\.tmp)$", rf"-{pid}\1", Path(tmp).name)
    if host is not None:
        new = re.sub(r"\.lmf-.*(-\d+\.[^.]+\.tmp)$", rf".lmf-{host}\1", new)
    assert new != Path(tmp).name or pid == os.getpid()
    return Path(tmp).rename(folder / new)


# A process in the middle of a long atomic write: it holds its temp file and keeps running.
LIVE_WRITER = """
import os, sys, time
from lmforge.fileio import temp_file_beside

fd, tmp = temp_file_beside(sys.argv[1])
print(tmp, flush=True)
time.sleep(300)
"""


@pytest.fixture
def live_writer(tmp_path):
    """(process, its temp file) of a writer that is still running."""
    proc = subprocess.Popen([sys.executable, "-c", LIVE_WRITER, str(tmp_path / "live.bin")],
                            stdout=subprocess.PIPE, text=True)  # fmt: skip
    tmp = Path(proc.stdout.readline().strip())
    yield proc, tmp
    proc.kill()
    proc.wait()


def dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()  # reaped: the PID names no process now
    return proc.pid


def test_only_orphans_are_removed(tmp_path, live_writer):
    old = 2 * DEAD_WRITER_GRACE_S
    dead = dead_pid()
    orphans = [killed_save(tmp_path / "model.safetensors"), tagged(tmp_path, "a.json", dead)]
    age(orphans[1], old)
    untagged_old = tmp_path / ".tokens.k2j3h4g5.tmp"  # another writer's naming, a day untouched
    untagged_old.write_bytes(b"x")
    age(untagged_old, UNOWNED_TEMP_AGE_S + 60)
    orphans.append(untagged_old)

    kept = {
        # a live process is writing it, however old its mtime
        live_writer[1]: old,
        tagged(tmp_path, "mine.json", os.getpid()): old,
        # its writer just died: within the grace period (a same-named host in another PID
        # namespace could own it)
        tagged(tmp_path, "fresh.json", dead): 0,
        # another host's process: its PID cannot be checked here
        tagged(tmp_path, "remote.json", dead, host="other-node"): old,
        tmp_path / ".tokens.abcdefgh.tmp": old,  # untagged, not a day old
        tmp_path / "visible.tmp": UNOWNED_TEMP_AGE_S * 2,  # not our hidden pattern
        tmp_path / ".notes.json": UNOWNED_TEMP_AGE_S * 2,
    }
    for path, seconds in kept.items():
        path.touch()
        age(path, seconds)
    (tmp_path / ".folder.tmp").mkdir()  # a directory is never removed
    age(tmp_path / ".folder.tmp", UNOWNED_TEMP_AGE_S * 2)

    removed = remove_stale_temps(tmp_path)
    assert sorted(removed) == sorted(orphans)
    left = {p.name for p in tmp_path.iterdir()}
    assert left == {p.name for p in kept} | {".folder.tmp"}
    assert remove_stale_temps(tmp_path) == []  # nothing more to do


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="zombie check reads /proc")
def test_a_killed_but_unreaped_writer_counts_as_dead(tmp_path):
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
    try:
        orphan = tagged(tmp_path, "x.json", proc.pid)
        age(orphan, 2 * DEAD_WRITER_GRACE_S)
        assert remove_stale_temps(tmp_path) == []  # running
        proc.kill()
        deadline = time.monotonic() + 30
        while Path(f"/proc/{proc.pid}/stat").read_text().split(") ")[1][0] != "Z":
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert remove_stale_temps(tmp_path) == [orphan]  # a zombie writes nothing
    finally:
        proc.kill()
        proc.wait()


def test_a_missing_folder_is_not_an_error(tmp_path):
    assert remove_stale_temps(tmp_path / "nowhere") == []


def test_training_state_save_and_resume_remove_orphans(tmp_path):
    path = tmp_path / "training_state.safetensors"
    first = killed_save(path)
    save_training_state(path, {"w": torch.ones(3), "step": 1})
    assert not first.exists()
    second = killed_save(path)
    assert load_training_state(path)["step"] == 1
    assert not second.exists()
    assert [p.name for p in tmp_path.iterdir()] == [path.name]


def test_sharded_save_removes_orphans_of_killed_saves(tmp_path):
    root = tmp_path / CHECKPOINT_DIR
    root.mkdir()
    orphan = killed_save(root / "latest.json")
    model = Transformer(ModelConfig(vocab_size=11, n_layer=1, n_head=1, d_model=8, max_seq_len=8))
    optimizer = torch.optim.AdamW(model.parameters())
    meta = {"step": 1, "model_config": model.config.to_dict()}
    save_sharded(
        root, model, optimizer, meta, {"sampler": {"lanes": {}}, "rng": rng_state(json_safe=True)}
    )
    assert not orphan.exists()
    assert sorted(p.name for p in root.iterdir()) == ["latest.json", "step_00000001"]


def test_a_pretraining_run_removes_orphans_of_a_killed_run(tmp_path):
    """A run reopening its out_dir (shards already built, so the shard builder does not run)
    removes what killed saves left there and in data/, and keeps a live writer's temp."""
    from lmforge.train.config import TrainConfig
    from lmforge.train.pretrain import Pretrainer

    corpus = tmp_path / "corpus.txt"
    corpus.write_text("It was the best of times, it was the worst of times.\n" * 20)
    out = tmp_path / "run"
    cfg = dict(out_dir=str(out), data=str(corpus), tokenizer="char", batch_size=2, block_size=8,
               max_iters=1, eval_iters=1, progress=False, samples=0, device="cpu",
               model=dict(n_layer=1, n_head=1, d_model=8, max_seq_len=8))  # fmt: skip
    Pretrainer(TrainConfig(**cfg), log=lambda *_: None)
    built = {p.name: p.stat().st_mtime_ns for p in (out / "data").iterdir()}

    dead = dead_pid()
    orphans = [
        killed_save(out / "model.safetensors"),  # a real atomic save, SIGKILLed
        tagged(out, "training_state.safetensors", dead),
        tagged(out / "data", "train.bin", dead),
    ]
    for orphan in orphans[1:]:
        orphan.write_bytes(b"x" * 1000)
        age(orphan, 2 * DEAD_WRITER_GRACE_S)
    live = tagged(out, "metrics.csv", os.getpid())  # this process is alive: never an orphan
    age(live, 2 * DEAD_WRITER_GRACE_S)

    Pretrainer(TrainConfig(**cfg), log=lambda *_: None)
    assert [p for p in orphans if p.exists()] == []
    assert live.exists()
    # the shards were reused, not rebuilt: the run itself, not the shard builder, cleaned data/
    assert {p.name: p.stat().st_mtime_ns for p in (out / "data").iterdir()} == built
