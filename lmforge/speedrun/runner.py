"""Run the stages in order, skipping finished ones, and never lose a finished stage.

The run folder holds `speedrun.json` (the preset and the resolved plan) and one subfolder per
stage. A stage is finished when its `stage.json` exists; that file is written atomically, last,
with the settings the stage ran with and its headline numbers. So:

- rerunning the same command skips finished stages and resumes an interrupted trainer from its
  last checkpoint (trainers checkpoint atomically, and on Ctrl-C);
- `--from STAGE` deletes the finish marks of STAGE and every later stage and redoes them;
- a folder made by another preset, or whose finished stages ran with other settings, is refused
  with a message naming the difference, before anything runs;
- a full disk stops the run with a message; the finished stages stay as they were.
"""

from __future__ import annotations

import contextlib
import errno
import json
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from lmforge.errors import ConfigError, LMForgeError
from lmforge.fileio import read_json, write_json
from lmforge.speedrun.presets import STAGE_ORDER
from lmforge.speedrun.report import write_report
from lmforge.speedrun.stages import MARK, STAGES, RunContext

MANIFEST = "speedrun.json"


def _stage_settings(plan: dict[str, Any], stage: str) -> dict[str, Any]:
    """What a stage's result depends on: its own section and the pipeline-wide keys."""
    shared = {k: plan.get(k) for k in ("corpus", "task", "nproc", "init")}
    return json.loads(json.dumps({"shared": shared, stage: plan.get(stage, {})}))


def _differences(old: Any, new: Any, prefix: str = "") -> list[str]:
    if isinstance(old, dict) and isinstance(new, dict):
        out = []
        for key in sorted(set(old) | set(new)):
            out += _differences(old.get(key), new.get(key), f"{prefix}{key}.")
        return out
    return [] if old == new else [f"{prefix.rstrip('.')}: {old!r} -> {new!r}"]


def _disk_full(err: BaseException) -> bool:
    """Whether an error (or one it wraps) is "no space left on device"; libraries such as
    safetensors re-raise it as their own error type with the OS message inside."""
    while err is not None:
        if isinstance(err, OSError) and err.errno == errno.ENOSPC:
            return True
        if "No space left on device" in str(err) or "os error 28" in str(err):
            return True
        err = err.__cause__ or err.__context__
    return False


@contextlib.contextmanager
def compute_settings(plan: dict[str, Any]) -> Iterator[None]:
    """Threads and determinism for the run, restored afterwards (the run may be one call in a
    longer process, such as a test session). `deterministic` means one thread and
    torch.use_deterministic_algorithms: the same numbers on every run on one kind of CPU."""
    threads, det = torch.get_num_threads(), torch.are_deterministic_algorithms_enabled()
    try:
        if plan.get("deterministic"):
            torch.set_num_threads(1)
            torch.use_deterministic_algorithms(True)
        elif plan.get("threads"):
            torch.set_num_threads(plan["threads"])
        yield
    finally:
        torch.set_num_threads(threads)
        torch.use_deterministic_algorithms(det)


class Speedrun:
    """tokenizer -> pretrain -> sft -> reward -> dpo -> grpo (-> ppo) -> eval -> rag -> report."""

    def __init__(self, plan: dict[str, Any], out: str | Path, log=print, progress: bool = True):
        self.plan, self.out = plan, Path(out)
        self.stages = [s for s in STAGE_ORDER if s in plan["stages"]]
        self.ctx = RunContext(plan, self.out, log, progress)
        self.log = log

    def finished(self, stage: str) -> dict[str, Any] | None:
        mark = self.out / stage / MARK
        return read_json(mark, "stage mark") if mark.is_file() else None

    def check_folder(self, redo_from: str | None) -> None:
        """Refuse a folder from another preset, or finished stages with other settings."""
        manifest = self.out / MANIFEST
        if not manifest.is_file():
            if self.out.exists() and (not self.out.is_dir() or any(self.out.iterdir())):
                raise ConfigError(
                    f"{self.out} exists and is not a speedrun folder (no {MANIFEST}); "
                    "choose an empty or new --out"
                )
            return
        old = read_json(manifest, "speedrun manifest")
        if old.get("preset") != self.plan["preset"] and redo_from != self.stages[0]:
            raise ConfigError(
                f"{self.out} holds a {old.get('preset')!r} speedrun, not {self.plan['preset']!r}: "
                f"use another --out, or --from {self.stages[0]} to redo everything here"
            )
        keep = self.stages[: self.stages.index(redo_from)] if redo_from else self.stages
        for stage in keep:
            done = self.finished(stage)
            if done is None:
                continue
            if diff := _differences(done["settings"], _stage_settings(self.plan, stage)):
                raise ConfigError(
                    f"{self.out}/{stage} finished with other settings ({'; '.join(diff[:3])}): "
                    f"use --from {stage} to redo it and what follows, or another --out"
                )

    def run(self, redo_from: str | None = None) -> dict[str, Any]:
        """Run (or skip) every stage, then write the report. Returns {stage: numbers}."""
        if redo_from is not None and redo_from not in self.stages:
            raise ConfigError(
                f"--from {redo_from!r}: stages in this plan: {', '.join(self.stages)}"
            )
        self.check_folder(redo_from)
        self.out.mkdir(parents=True, exist_ok=True)
        write_json(self.out / MANIFEST, {"preset": self.plan["preset"], "plan": self.plan})
        with compute_settings(self.plan):
            return self._run_stages(redo_from)

    def _run_stages(self, redo_from: str | None) -> dict[str, Any]:
        if redo_from is not None:  # start those stages afresh (no resuming their old checkpoints)
            for stage in self.stages[self.stages.index(redo_from) :]:
                shutil.rmtree(self.out / stage, ignore_errors=True)
        results: dict[str, Any] = {}
        started = time.perf_counter()
        upstream_changed = False  # a stage that ran now invalidates the finished ones after it
        for stage in self.stages:
            done = self.finished(stage)
            if done is not None and upstream_changed:
                self.log(f"== {stage}: an earlier stage ran again; redoing it")
                shutil.rmtree(self.out / stage, ignore_errors=True)
            elif done is not None:
                self.log(f"== {stage}: finished earlier ({done['seconds']:.0f} s), skipped")
                results[stage] = done
                continue
            results[stage] = self._run_stage(stage)
            upstream_changed = True
        total = time.perf_counter() - started
        report = write_report(self.out, self.plan, results)
        self.log(f"\nspeedrun finished in {total / 60:.1f} min -> {report}")
        return results

    def _run_stage(self, stage: str) -> dict[str, Any]:
        self.log(f"\n== {stage}: {STAGES[stage].title}")
        t0 = time.perf_counter()
        (self.out / stage).mkdir(parents=True, exist_ok=True)
        try:
            numbers = STAGES[stage].run(self.ctx)
        except KeyboardInterrupt:
            self.log(f"\ninterrupted in stage {stage}; finished stages are kept in {self.out}. "
                     "Run the same command again to continue.")  # fmt: skip
            raise
        except Exception as err:
            if _disk_full(err):
                raise LMForgeError(
                    f"disk full during stage {stage} (writing under {self.out}); finished stages "
                    "are kept: free some space and run the same command again to continue"
                ) from err
            raise
        done = {
            "stage": stage,
            "settings": _stage_settings(self.plan, stage),
            "numbers": numbers,
            "seconds": time.perf_counter() - t0,
            "finished_at": time.strftime("%Y-%m-%d %H:%M:%S"),
        }
        write_json(self.out / stage / MARK, done)
        self.log(f"== {stage}: done in {done['seconds']:.0f} s")
        return done
