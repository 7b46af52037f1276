"""Every OS error and bad input the CLI meets is one line on stderr (exit 1 or 2), never a
traceback; a config error leaves the output folder unwritten; SIGTERM saves like Ctrl-C."""

import csv
import errno
import io
import os
import re
import resource
import shlex
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from safetensors import SafetensorError

from lmforge.cli.main import describe_error, main

TEXT = "All the world's a stage, and all the men and women merely players.\n" * 30
TINY = ["--tokenizer", "char", "--max_iters", "4", "--eval_interval", "2", "--eval_iters", "1",
        "--batch_size", "2", "--block_size", "16", "--progress", "false", "--samples", "0",
        "--model.n_layer", "1", "--model.d_model", "16", "--model.n_head", "2",
        "--model.max_seq_len", "32", "--device", "cpu"]  # fmt: skip


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("corpus") / "play.txt"
    path.write_text(TEXT)
    return path


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, corpus) -> Path:
    out = tmp_path_factory.mktemp("errors") / "run"
    assert main(["pretrain", "--data", str(corpus), "--out_dir", str(out), *TINY]) == 0
    return out


def error_line(capsys, argv: list[str]) -> tuple[int, str]:
    """Run the CLI in this process; the failure must be one `error:` line and no traceback."""
    status = main(argv)
    out, err = capsys.readouterr()
    assert status in (1, 2), (status, out, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert "Traceback" not in out + err
    return status, lines[0]


def subprocess_error_line(proc: subprocess.CompletedProcess) -> str:
    """The same check on a CLI run in its own process (where a traceback would really print)."""
    assert proc.returncode in (1, 2), (proc.returncode, proc.stdout[-2000:], proc.stderr[-2000:])
    assert "Traceback" not in proc.stdout + proc.stderr, proc.stderr[-3000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
    return lines[0]


# ---- config errors: named, and found before anything is written ------------------------------
CONFIG_ERRORS = {
    "grad_clip a list": (["--grad_clip", "[1]"], ["grad_clip", "must be a number", "[1]"]),
    "lr NaN": (["--lr", ".nan"], ["lr", "finite", "nan"]),
    "unknown device": (["--device", "bogus"], ["device", "unknown device", "bogus"]),
    "model n_head": (["--model.n_head", "3"], ["n_head", "divisible"]),
    "unknown preset": (["--preset", "nope"], ["preset", "nope"]),
    "model field type": (["--model.dropout", "[1]"], ["model", "dropout", "must be a number"]),
    "encoder model": (["--model.d_model", "[2]"], ["model", "d_model", "an integer"]),
    "absent GPU": (["--device", "cuda"], ["device", "cuda", "no CUDA GPU"]),
}


@pytest.mark.parametrize("case", CONFIG_ERRORS, ids=list(CONFIG_ERRORS))
def test_config_error_is_one_line_and_writes_nothing(case, corpus, tmp_path, capsys):
    extra, fragments = CONFIG_ERRORS[case]
    if case == "absent GPU" and torch.cuda.is_available():
        pytest.skip("this machine has a CUDA GPU")
    out = tmp_path / "out"
    argv = ["pretrain", "--data", str(corpus), "--out_dir", str(out), *TINY, *extra]
    if case == "encoder model":  # a BERT run (its own config class and model config)
        argv = ["pretrain", "--objective", "mlm", "--data", str(corpus), "--out_dir", str(out),
                "--tokenizer", "char", "--device", "cpu", *extra]  # fmt: skip
    status, line = error_line(capsys, argv)
    assert status == 2
    for fragment in fragments:
        assert fragment in line, line
    assert not out.exists(), sorted(p.name for p in out.rglob("*"))


def test_config_yaml_is_validated_too(corpus, tmp_path, capsys):
    config = tmp_path / "run.yaml"
    config.write_text("max_iters: 4\nmodel:\n  n_layer: 1\n  d_model: 16\n  n_head: 5\n")
    out = tmp_path / "out"
    argv = ["pretrain", "--config", str(config), "--data", str(corpus), "--out_dir", str(out)]
    _, line = error_line(capsys, argv)
    assert "n_head (5)" in line and not out.exists()


# ---- the output folder: a file, under a file, read-only ---------------------------------------
def test_out_dir_that_is_a_file(corpus, tmp_path, capsys):
    blocker = tmp_path / "taken"
    blocker.write_text("not a folder")
    argv = ["pretrain", "--data", str(corpus), "--out_dir", str(blocker), *TINY]
    status, line = error_line(capsys, argv)
    assert status == 1 and str(blocker) in line and "is a file" in line
    inner = blocker / "run"
    status, line = error_line(capsys, [*argv[:4], str(inner), *TINY])
    assert status == 1 and f"{inner}: {blocker} is a file, where a folder is needed" in line


def test_read_only_out_dir(corpus, tmp_path, capsys):
    """A folder without write permission, made real also under root: root ignores permission
    bits, so there the CLI runs in a process without CAP_DAC_OVERRIDE (capsh)."""
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o555)
    try:
        for out in (locked, locked / "run"):  # writing into it; creating a folder in it
            argv = ["pretrain", "--data", str(corpus), "--out_dir", str(out), *TINY]
            if os.access(locked, os.W_OK):  # root
                if shutil.which("capsh") is None:
                    pytest.skip("running as root without capsh: permissions are not enforced")
                command = shlex.join([sys.executable, "-m", "lmforge", *argv])
                proc = subprocess.run(["capsh", "--drop=cap_dac_override", "--", "-c", command],
                                      capture_output=True, text=True, timeout=600)  # fmt: skip
                status, line = proc.returncode, subprocess_error_line(proc)
            else:
                status, line = error_line(capsys, argv)
            assert status == 1, line
            assert line == f"error: {locked}: cannot write here: permission denied " \
                           "(read-only, or owned by another user)"  # fmt: skip
    finally:
        locked.chmod(0o755)
    assert list(locked.iterdir()) == []


# ---- a full disk (a file size limit in a child process: the same OSError path) ----------------
LIMITED = textwrap.dedent("""
    import resource, signal, sys
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG
    resource.setrlimit(resource.RLIMIT_FSIZE, ({limit}, {limit}))
    from lmforge.cli.main import main
    sys.exit(main(sys.argv[1:]))
""")


def run_with_file_size_limit(limit: int, argv: list[str]) -> subprocess.CompletedProcess:
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    if hard != resource.RLIM_INFINITY and hard < limit:
        pytest.skip("the file size limit is already lower than this test needs")
    script = LIMITED.format(limit=limit)
    return subprocess.run([sys.executable, "-c", script, *argv], capture_output=True, text=True,
                          timeout=600)  # fmt: skip


def test_disk_full_while_tokenising(tmp_path):
    big = tmp_path / "big.txt"
    big.write_text(TEXT * 40)  # ~80k tokens: shards of ~160 kB, over the 64 kB limit
    out = tmp_path / "out"
    proc = run_with_file_size_limit(64_000, ["pretrain", "--data", str(big), "--out_dir",
                                             str(out), *TINY])  # fmt: skip
    line = subprocess_error_line(proc)
    assert proc.returncode == 1
    assert line.startswith(f"error: {out}: file too large"), line
    assert not (out / "data" / "train.bin").exists()


def test_disk_full_while_saving_the_model(corpus, tmp_path):
    """model.safetensors (~400 kB) is over the limit, the token shards are not: safetensors
    reports the failed write as its own error type, named here with the run's folder."""
    out = tmp_path / "out"
    argv = ["pretrain", "--data", str(corpus), "--out_dir", str(out), *TINY,
            "--model.d_model", "64", "--model.n_layer", "2", "--model.n_head", "4"]  # fmt: skip
    proc = run_with_file_size_limit(64_000, argv)
    line = subprocess_error_line(proc)
    assert proc.returncode == 1
    assert line == f"error: {out}: writing a safetensors file failed: file too large " \
                   "(the file size limit, `ulimit -f`, was reached)"  # fmt: skip
    assert not (out / "model.safetensors").exists()  # atomic: no half-written weights


def test_no_space_left_on_device_names_the_file():
    """ENOSPC itself: /dev/full fails every write with it, and write() errors carry no file
    name: the open file in the traceback is the one named."""
    if not os.path.exists("/dev/full"):
        pytest.skip("no /dev/full on this system")
    with pytest.raises(OSError) as info:
        with open("/dev/full", "w") as fh:
            fh.write("x" * 10_000)
    assert info.value.errno == errno.ENOSPC and info.value.filename is None
    message, status = describe_error(info.value)
    assert (message, status) == ("/dev/full: no space left on device (free some space and run "
                                 "again)", 1)  # fmt: skip
    err = SafetensorError(
        "Error while serializing: I/O error: No space left on device (os error 28)"
    )  # what safetensors' save_file raises on a full disk
    message, status = describe_error(err)
    assert status == 1 and message.endswith("failed: no space left on device (free some space "
                                            "and run again)")  # fmt: skip
    assert describe_error(RuntimeError("a bug")) == (None, 1)  # bugs keep their traceback


# ---- bad input files and text ----------------------------------------------------------------
def test_jsonl_with_invalid_utf8(tmp_path, capsys):
    data = tmp_path / "docs.jsonl"
    data.write_bytes(b'{"text": "fine"}\n{"text": "caf\xe9 \xff"}\n')
    out = tmp_path / "out"
    status, line = error_line(capsys, ["pretrain", "--data", str(data), "--out_dir", str(out),
                                       *TINY])  # fmt: skip
    assert status == 2
    assert line == f"error: {data}: not valid utf-8 text (byte 0xe9: invalid continuation " \
                   "byte); save it as UTF-8"  # fmt: skip


def test_checkpoint_config_holding_a_list(checkpoint, tmp_path, capsys):
    broken = tmp_path / "broken"
    shutil.copytree(checkpoint, broken)
    (broken / "config.json").write_text("[1, 2]\n")
    status, line = error_line(capsys, ["generate", "--checkpoint", str(broken), "--prompt", "A"])
    assert status == 2 and str(broken / "config.json") in line and "JSON object" in line


GENERATE_ERRORS = {
    "temperature NaN": (["--prompt", "A", "--temperature", "nan"], ["temperature", "nan"]),
    "lone surrogate": (["--prompt", "A\ud800"], ["--prompt", "U+D800", "character 1"]),
    "undecodable byte": (["--prompt", "\udced\udca0"], ["--prompt", "byte 0xED"]),
    "unknown device": (["--prompt", "A", "--device", "bogus"], ["--device", "bogus"]),
    "absent GPU": (["--prompt", "A", "--device", "cuda"], ["--device", "no CUDA GPU"]),
}


@pytest.mark.parametrize("case", GENERATE_ERRORS, ids=list(GENERATE_ERRORS))
def test_generate_bad_input(case, checkpoint, capsys):
    extra, fragments = GENERATE_ERRORS[case]
    if case == "absent GPU" and torch.cuda.is_available():
        pytest.skip("this machine has a CUDA GPU")
    status, line = error_line(capsys, ["generate", "--checkpoint", str(checkpoint), *extra])
    assert status == 2
    for fragment in fragments:
        assert fragment in line, line
    assert "corrupt" not in line


def test_chat_reports_a_bad_line_and_goes_on(checkpoint, capsys, monkeypatch):
    monkeypatch.setattr(sys, "stdin", io.StringIO("hi \ud800\n/exit\n"))
    argv = ["chat", "--checkpoint", str(checkpoint), "--max-new-tokens", "2", "--no-compile"]
    assert main(argv) == 0
    out, err = capsys.readouterr()
    assert "error: input: not valid Unicode text (lone surrogate U+D800 at character 3)" in out
    assert out.count("> ") == 2 and "Traceback" not in out + err  # asked again, then /exit


# ---- SIGTERM saves a checkpoint, as Ctrl-C does ----------------------------------------------
def wait_for_train_row(proc: subprocess.Popen, metrics: Path, deadline_s: float = 600) -> None:
    """Until the run has logged a training step (a file poll: no assumption on speed)."""
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        assert proc.poll() is None, proc.communicate()
        if metrics.is_file():
            with open(metrics, newline="") as fh:
                if any(row["split"] == "train" for row in csv.DictReader(fh)):
                    return
        time.sleep(0.1)
    proc.kill()
    pytest.fail("no training step logged")


@pytest.mark.slow
def test_sigterm_saves_a_checkpoint_and_resume_continues(corpus, tmp_path, capsys):
    out = tmp_path / "run"
    endless = ["--max_iters", "1000000", "--eval_interval", "1000000", "--log_interval", "1"]
    argv = ["pretrain", "--data", str(corpus), "--out_dir", str(out), *TINY, *endless]
    proc = subprocess.Popen([sys.executable, "-m", "lmforge", *argv], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)  # fmt: skip
    wait_for_train_row(proc, out / "metrics.csv")
    proc.send_signal(signal.SIGTERM)
    stdout, stderr = proc.communicate(timeout=600)
    assert proc.returncode == 128 + signal.SIGTERM, stderr[-3000:]
    assert "Traceback" not in stdout + stderr
    saved = re.search(r"interrupted: checkpoint saved at step (\d+)", stdout)
    assert saved, stdout
    step = int(saved.group(1))
    assert step >= 1 and (out / "training_state.safetensors").is_file()
    assert (out / "model.safetensors").is_file()

    resume = [*argv[:-6], "--max_iters", str(step + 2), "--eval_interval", "1000000", "--resume"]
    assert main(resume) == 0
    printed = capsys.readouterr().out
    assert f"resumed from step {step}" in printed and f"final: step {step + 2} " in printed


@pytest.mark.slow
def test_sigterm_to_torchrun_saves_one_checkpoint_from_every_rank(corpus, tmp_path):
    """torchrun forwards SIGTERM to each worker, which takes it at its own point in a step:
    the ranks must still stop at the same step and write one complete sharded checkpoint
    (not hang in mismatched collectives until torchrun kills them), which --resume continues."""
    out = tmp_path / "run"
    base = ["pretrain", "--data", str(corpus), "--out_dir", str(out), *TINY, "--grad_accum", "2"]
    endless = ["--max_iters", "1000000", "--eval_interval", "1000000", "--log_interval", "1"]
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                "--nproc_per_node=2", "-m", "lmforge"]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([*launcher, *base, *endless], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=env)  # fmt: skip
    wait_for_train_row(proc, out / "metrics.csv")
    proc.send_signal(signal.SIGTERM)
    output, _ = proc.communicate(timeout=600)
    saved = re.search(r"interrupted: checkpoint saved at step (\d+)", output)
    assert saved, output[-3000:]
    assert "forcefully exiting" not in output  # torchrun did not have to SIGKILL a rank
    step = int(saved.group(1))
    resume = [*base, "--max_iters", str(step + 1), "--eval_interval", "1000000", "--resume"]
    finished = subprocess.run([*launcher, *resume], capture_output=True, text=True, env=env,
                              timeout=600)  # fmt: skip
    assert finished.returncode == 0, finished.stderr[-3000:]
    assert f"resumed from step {step}" in finished.stdout
    assert f"final: step {step + 1} " in finished.stdout
