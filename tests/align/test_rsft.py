"""RSFT: the selection rules on known rewards, and a short end-to-end run."""

import pytest
import torch

from lmforge.align.rsft import RSFTConfig, RSFTTrainer, select_rows
from lmforge.errors import ConfigError

REWARDS = torch.tensor([0.1, 0.9, 0.5, 0.0, 2.0, 1.0, 3.0, -1.0])  # two groups of 4


def test_best_of_n():
    assert select_rows(REWARDS, 4, "best").tolist() == [1, 6]


def test_top_k_and_min_reward():
    assert sorted(select_rows(REWARDS, 4, "top_k", k=2).tolist()) == [1, 2, 4, 6]
    assert sorted(select_rows(REWARDS, 4, "top_k", k=2, min_reward=0.6).tolist()) == [1, 4, 6]


def test_boltzmann():
    gen = torch.Generator().manual_seed(0)
    cold = select_rows(REWARDS, 4, "boltzmann", k=50, tau=1e-3, gen=gen)
    assert set(cold.tolist()) == {1, 6}  # τ → 0 is best-of-N
    hot = select_rows(REWARDS, 4, "boltzmann", k=4000, tau=1.0, gen=gen)
    first = torch.bincount(hot[hot < 4], minlength=4).float() / 4000
    expected = torch.softmax(REWARDS[:4], 0)
    torch.testing.assert_close(first, expected, atol=0.03, rtol=0)


def test_bad_config():
    with pytest.raises(ConfigError, match="select"):
        RSFTConfig(select="worst")


@pytest.mark.slow
def test_end_to_end(tmp_path):
    cfg = RSFTConfig(
        out_dir=str(tmp_path / "rsft"), init="scratch",
        model={"n_layer": 1, "n_head": 2, "d_model": 16, "max_seq_len": 32},
        data="task:add:1", n_train=40, n_eval=8, batch_size=4, group_size=4, max_new_tokens=4,
        max_iters=2, select="top_k", progress=False, threads=1,
    )  # fmt: skip
    result = RSFTTrainer(cfg, log=lambda *a: None).run()
    out = tmp_path / "rsft"
    for name in ("model.safetensors", "metrics.csv", "rsft.png"):
        assert (out / name).is_file(), name
    rows = (out / "metrics.csv").read_text().splitlines()
    kept = [float(r.split(",")[-1]) for r in rows if ",train,kept," in r]
    losses = [float(r.split(",")[-1]) for r in rows if ",train,loss," in r]
    assert kept == [8.0, 8.0] and all(0 < x < 20 for x in losses)
    assert "reward" in result
