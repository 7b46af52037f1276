"""Sharded checkpoints: safetensors + JSON that resume on any world size, and files an attacker
controls (a pickle payload in every one) refused with one line, nothing executed."""

import contextlib
import json
import os
import pickle
import re
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch.distributed.checkpoint.state_dict import get_state_dict

from lmforge.cli.main import main as cli
from lmforge.errors import CheckpointError
from lmforge.fileio import load_tensors, save_tensors
from lmforge.model.config import ModelConfig
from lmforge.model.transformer import Transformer
from lmforge.train.checkpoint import rng_state
from lmforge.train.config import TrainConfig
from lmforge.train.pretrain import Pretrainer
from lmforge.train.sharded_checkpoint import (
    CHECKPOINT_DIR,
    check_checkpoint,
    consolidate,
    load_sharded,
    resolve_checkpoint,
    save_sharded,
)

PACKAGE = Path(__file__).resolve().parents[2] / "lmforge"
TEXT = "It is a truth universally acknowledged, that a single man in possession\n" * 30
ARGS = dict(
    tokenizer="char", batch_size=2, block_size=8, grad_accum=2, max_iters=2, lr_decay_iters=2,
    eval_interval=2, eval_iters=1, log_interval=1, warmup_iters=1, progress=False, samples=0,
    seed=3, device="cpu", model=dict(n_layer=1, n_head=2, d_model=16, max_seq_len=8),
)  # fmt: skip


def train_config(run: Path) -> TrainConfig:
    (run.parent / "corpus.txt").write_text(TEXT)
    return TrainConfig(**{**ARGS, "out_dir": str(run), "data": str(run.parent / "corpus.txt")})


@pytest.fixture(scope="module")
def trained(tmp_path_factory, world_of_one) -> Path:
    """A finished 2-step run under torchrun's code path, with its sharded checkpoint."""
    run = tmp_path_factory.mktemp("base") / "run"
    with world_of_one():
        Pretrainer(train_config(run), log=lambda *_: None).run()
    return run


def test_checkpoint_is_safetensors_and_json_only(trained):
    step_dir = resolve_checkpoint(trained)
    assert sorted(p.name for p in step_dir.iterdir()) == [
        "meta.json", "rank0.json", "rank0.safetensors"
    ]  # fmt: skip
    meta = check_checkpoint(step_dir)
    assert meta["step"] == 2 and meta["world_size"] == 1
    shard = load_file(step_dir / "rank0.safetensors")
    assert "optimizer.state.blocks.0.attn.qkv_proj.weight.exp_avg" in shard
    assert "model.lm_head.weight" not in shard  # tied to the embedding: stored once


# ---- files an attacker controls --------------------------------------------------------------
class Payload:
    """Unpickling this creates the marker file: what a malicious checkpoint would run."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def payload(marker: Path) -> bytes:
    return pickle.dumps(Payload(marker))


def test_the_payload_is_live(tmp_path):
    """The payload does run when unpickled, also by the reader of the old DCP format: the tests
    below would see the marker if anything unpickled it."""
    from torch.distributed.checkpoint import FileSystemReader

    marker = tmp_path / "marker"
    (tmp_path / ".metadata").write_bytes(payload(marker))
    with contextlib.suppress(Exception):
        FileSystemReader(str(tmp_path)).read_metadata()
    assert marker.exists()


def crafted_safetensors(header: dict, data: bytes = b"", length: int | None = None) -> bytes:
    raw = json.dumps(header).encode()
    return struct.pack("<Q", len(raw) if length is None else length) + raw + data


def old_dcp_format(step_dir: Path, evil: bytes) -> None:
    """What an older lmforge wrote: DCP's pickled .metadata and .distcp shards."""
    meta = json.loads((step_dir / "meta.json").read_text())
    for name in ("meta.json", "rank0.safetensors"):
        (step_dir / name).unlink()
    (step_dir / ".metadata").write_bytes(evil)
    (step_dir / "__0_0.distcp").write_bytes(evil)
    old = {k: meta[k] for k in ("step", "tokens_seen", "elapsed", "model_config", "world_size")}
    (step_dir / "meta.json").write_text(json.dumps(old))


def header_with_pickled_offsets(step_dir: Path, evil: bytes) -> None:
    shard = step_dir / "rank0.safetensors"
    save_file(load_file(shard), shard, metadata={"format": "lmforge-sharded-safetensors/1",
                                                 "offsets": evil.decode("latin-1")})  # fmt: skip


CASES = {
    # (how the step folder is tampered with, what the one-line error says)
    "old DCP checkpoint": (old_dcp_format, r"written by an older lmforge .* cannot be read safely"),
    "old DCP without meta.json": (
        lambda d, evil: (old_dcp_format(d, evil), (d / "meta.json").unlink()),
        r"written by an older lmforge",
    ),
    "meta.json is a pickle (beside pickled .metadata/.distcp)": (
        lambda d, evil: [
            (d / n).write_bytes(evil) for n in ("meta.json", ".metadata", "__0_0.distcp")
        ],
        r"meta.json: invalid JSON",
    ),
    "latest.json is a pickle": (
        lambda d, evil: (d.parent / "latest.json").write_bytes(evil),
        r"latest.json: invalid JSON",
    ),
    "rank0.json is a pickle": (
        lambda d, evil: (d / "rank0.json").write_bytes(evil),
        r"rank0.json: invalid JSON",
    ),
    "the shard is a pickle": (
        lambda d, evil: (d / "rank0.safetensors").write_bytes(evil),
        r"rank0.safetensors: corrupt or truncated shard",
    ),
    "header claims data past the end": (
        lambda d, evil: (d / "rank0.safetensors").write_bytes(
            crafted_safetensors(
                {
                    "model.embed.weight": {
                        "dtype": "F32",
                        "shape": [4096, 4096],
                        "data_offsets": [0, 4 * 4096 * 4096],
                    }
                },
                evil,
            )
        ),
        r"rank0.safetensors: corrupt or truncated shard",
    ),
    "header length of 2**63": (
        lambda d, evil: (d / "rank0.safetensors").write_bytes(
            crafted_safetensors({}, evil, length=2**63)
        ),
        r"rank0.safetensors: corrupt or truncated shard",
    ),
    "pickle in the header's offsets": (
        header_with_pickled_offsets,
        r"rank0.safetensors: invalid 'offsets' metadata",
    ),
}


@pytest.fixture(params=list(CASES))
def tampered(request, trained, tmp_path):
    """(run dir, marker, expected error) for a copy of the trained run with one tampering."""
    run = tmp_path / "run"
    shutil.copytree(trained, run)
    marker = tmp_path / "marker"
    tamper, error = CASES[request.param]
    tamper(resolve_checkpoint(run), payload(marker))
    return run, marker, error


def test_consolidate_refuses_a_malicious_checkpoint(tampered, tmp_path, capsys):
    run, marker, error = tampered
    capsys.readouterr()
    assert cli(["checkpoint", "consolidate", str(run), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1, err
    assert err.startswith("error: ")
    assert re.search(error, err), err
    assert not marker.exists(), "the checkpoint ran code"
    assert not (tmp_path / "out").exists()  # checked before anything is written


def test_resume_refuses_a_malicious_checkpoint(tampered, world_of_one):
    run, marker, error = tampered
    with world_of_one(), pytest.raises(CheckpointError, match=error) as info:
        Pretrainer(train_config(run), resume=True, log=lambda *_: None)
    assert "\n" not in str(info.value)
    assert not marker.exists(), "the checkpoint ran code"


def test_no_reader_in_the_package_unpickles():
    """Checkpoint, index and state readers use safetensors/JSON: no pickle.load, no DCP reader,
    no torch.load at all (weights_only=True is still an unpickler; HF's pytorch_model.bin is
    refused), no numpy allow_pickle=True."""
    forbidden = ("pickle.load", "import pickle", "from pickle", "dcp.load", "FileSystemReader",
                 "read_metadata(", "allow_pickle=True", "weights_only", "torch.load(",
                 "torch.jit.load", "read_pickle", "shelve.open", "marshal.load", "cloudpickle",
                 "dill.load", "joblib")  # fmt: skip
    hits = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for no, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            code = line.split("#")[0]
            hits += [f"{path.relative_to(PACKAGE)}:{no}: {f}" for f in forbidden if f in code]
    assert not hits, hits


# ---- resharding: 1 process -> 2 FSDP2 ranks -> 1 process ---------------------------------------
# vocab 51: the embedding's 51 rows split 26/25 over 2 ranks (uneven shards); tied head
MODEL = dict(vocab_size=51, n_layer=1, n_head=2, d_model=16, max_seq_len=16)

WORKER = """
import json, sys
from pathlib import Path
import torch, torch.distributed as dist, torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import get_state_dict
from torch.distributed.fsdp import fully_shard
from lmforge.fileio import load_tensors, save_tensors
from lmforge.model.config import ModelConfig
from lmforge.model.transformer import Transformer
from lmforge.train.checkpoint import rng_state
from lmforge.train.sharded_checkpoint import (check_checkpoint, load_sharded, resolve_checkpoint,
                                              save_sharded)

src, dst, expected_file, after_file = map(Path, sys.argv[1:5])
dist.init_process_group("gloo")
torch.manual_seed(100 + dist.get_rank())  # a different init on every rank: all of it is replaced
cfg = ModelConfig(**json.loads(sys.argv[5]))
model = Transformer(cfg)
for block in model.blocks:
    fully_shard(block)
fully_shard(model)
optimizer = torch.optim.AdamW(model.parameters(), lr=0.5)  # the saved lr must win
step_dir = resolve_checkpoint(src)
check_checkpoint(step_dir)
load_sharded(step_dir, model, optimizer)

def full(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t

def flat(model, optimizer):
    m, o = get_state_dict(model, optimizer)
    out = {f"model.{k}": full(v).detach().clone() for k, v in m.items()}
    for k, state in o["state"].items():
        out.update({f"optim.{k}.{n}": full(v).detach().clone() for n, v in state.items()})
    return out, o["param_groups"][0]["lr"]

got, lr = flat(model, optimizer)
expected = load_tensors(expected_file)
assert sorted(got) == sorted(expected), sorted(set(got) ^ set(expected))
for k, v in got.items():
    torch.testing.assert_close(v, expected[k], rtol=0, atol=0, msg=k)
assert lr == 0.01, lr
assert model.embed.weight.to_local().shape[0] == (26 if dist.get_rank() == 0 else 25)

x = torch.randint(0, cfg.vocab_size, (2, 9), generator=torch.Generator().manual_seed(7))
F.cross_entropy(model(x[:, :-1]).flatten(0, 1), x[:, 1:].flatten()).backward()
optimizer.step()
rank_state = {"sampler": {"lanes": {}}, "rng": rng_state(json_safe=True)}
save_sharded(dst / "checkpoints", model, optimizer, {"step": 2, "model_config": cfg.to_dict()},
             rank_state)
after, _ = flat(model, optimizer)
if dist.get_rank() == 0:
    save_tensors(after_file, after)
dist.destroy_process_group()
"""


def one_step(model, optimizer) -> None:
    x = torch.randint(0, MODEL["vocab_size"], (2, 9), generator=torch.Generator().manual_seed(7))
    F.cross_entropy(model(x[:, :-1]).flatten(0, 1), x[:, 1:].flatten()).backward()
    optimizer.step()
    optimizer.zero_grad()


def flat_state(model, optimizer) -> dict[str, torch.Tensor]:
    m, o = get_state_dict(model, optimizer)
    out = {f"model.{k}": v.detach().clone() for k, v in m.items()}
    for k, state in o["state"].items():
        out.update({f"optim.{k}.{n}": v.detach().clone() for n, v in state.items()})
    return out


@pytest.mark.slow
def test_resume_on_two_fsdp_ranks_and_back_on_one(tmp_path):
    cfg = ModelConfig(**MODEL)
    torch.manual_seed(0)
    model = Transformer(cfg)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    one_step(model, optimizer)  # moments are not zero
    rank_state = {"sampler": {"lanes": {}}, "rng": rng_state(json_safe=True)}
    save_sharded(tmp_path / "one" / CHECKPOINT_DIR, model, optimizer,
                 {"step": 1, "model_config": cfg.to_dict()}, rank_state)  # fmt: skip
    save_tensors(tmp_path / "expected.safetensors", flat_state(model, optimizer))

    # 1 -> 2: two FSDP2 ranks load it (checked inside), take the same step and save
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           str(script), str(tmp_path / "one"), str(tmp_path / "two"),
           str(tmp_path / "expected.safetensors"), str(tmp_path / "after.safetensors"),
           json.dumps(MODEL)]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    assert sorted(p.name for p in resolve_checkpoint(tmp_path / "two").glob("*.safetensors")) == [
        "rank0.safetensors", "rank1.safetensors"
    ]  # fmt: skip

    # the same step in this process: two ranks on the same batch average equal gradients
    one_step(model, optimizer)
    after = load_tensors(tmp_path / "after.safetensors")
    reference = flat_state(model, optimizer)
    for k, v in reference.items():
        torch.testing.assert_close(after[k], v, rtol=0, atol=1e-6, msg=k)

    # 2 -> 1: a fresh single process reads the 2-rank checkpoint exactly
    torch.manual_seed(1)
    fresh = Transformer(cfg)
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=0.5)
    load_sharded(resolve_checkpoint(tmp_path / "two"), fresh, fresh_opt)
    for k, v in flat_state(fresh, fresh_opt).items():
        torch.testing.assert_close(v, after[k], rtol=0, atol=0, msg=k)
    assert fresh_opt.param_groups[0]["lr"] == 0.01
    assert fresh_opt.param_groups[0]["betas"] == (0.9, 0.999)  # a tuple again

    # and consolidates to a normal model folder
    consolidate(tmp_path / "two", tmp_path / "model")
    weights = load_file(tmp_path / "model" / "model.safetensors")
    torch.testing.assert_close(weights["embed.weight"], after["model.embed.weight"], rtol=0, atol=0)
    assert (tmp_path / "model" / "config.json").is_file()
