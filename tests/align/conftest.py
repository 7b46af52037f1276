"""Fixtures shared by the post-training tests."""

import pytest

TINY = {"n_layer": 1, "d_model": 32, "n_head": 2}


@pytest.fixture
def tiny_run():
    """A factory of small CPU run configs: tiny_run(ConfigClass, out_dir, **fields) — a 1-layer
    scratch model, 32 training and 16 held-out examples, 3 steps, quiet."""

    def make(cls, out, **kw):
        base = dict(out_dir=str(out), model=TINY, max_len=24, n_train=32, n_eval=16,
                    batch_size=8, max_iters=3, eval_interval=3, progress=False, threads=1,
                    warmup_iters=1)  # fmt: skip
        return cls(**{**base, **kw})

    return make
