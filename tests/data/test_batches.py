import json

import numpy as np
import pytest
import torch

from lmforge.data import BatchSampler, TokenShard, iterate_eval_batches, pad_collate
from lmforge.errors import ConfigError, DataError


def arange_shard(n: int) -> TokenShard:
    # token i has value i, so a block's content reveals its offset
    return TokenShard(np.arange(n, dtype=np.uint32))


def test_batch_targets_are_inputs_shifted_by_one():
    sampler = BatchSampler(arange_shard(1000), batch_size=8, block_size=16, seed=1)
    for _ in range(20):
        x, y = sampler.next_batch()
        assert x.shape == y.shape == (8, 16) and x.dtype == y.dtype == torch.long
        assert torch.equal(y, x + 1)
        assert torch.equal(x, x[:, :1] + torch.arange(16))
        assert int(x.min()) >= 0 and int(y.max()) <= 999
        assert y.view(-1).numel() == 128  # contiguous


def test_every_start_offset_is_reachable():
    sampler = BatchSampler(arange_shard(10), batch_size=64, block_size=8)
    starts = {int(s) for _ in range(10) for s in sampler.next_batch()[0][:, 0]}
    assert starts == {0, 1}


def test_memmapped_shard(tmp_path):
    np.arange(300, dtype=np.uint16).tofile(tmp_path / "train.bin")
    (tmp_path / "meta.json").write_text(json.dumps({"dtype": "uint16"}))
    x, y = BatchSampler(TokenShard.open(tmp_path / "train.bin"), 4, 32).next_batch()
    assert torch.equal(y, x + 1)


def test_resume_reproduces_the_stream():
    shard = arange_shard(5000)
    a = BatchSampler(shard, batch_size=4, block_size=8, seed=123)
    for _ in range(3):
        a.next_batch()
    state = json.loads(json.dumps(a.state_dict()))  # survives a JSON checkpoint
    expected = [a.next_batch() for _ in range(3)]
    b = BatchSampler(shard, batch_size=4, block_size=8, seed=999)
    b.load_state_dict(state)
    assert b.batches_drawn == 3 and b.seed == 123
    for (xa, ya), (xb, yb) in zip(expected, (b.next_batch() for _ in range(3))):
        assert torch.equal(xa, xb) and torch.equal(ya, yb)
    c = BatchSampler(shard, batch_size=4, block_size=8, seed=123)
    assert not torch.equal(c.next_batch()[0], expected[0][0])
    with pytest.raises(DataError, match="invalid BatchSampler state"):
        b.load_state_dict({"batches_drawn": 1})


def test_short_shard_and_bad_sizes(tmp_path):
    np.arange(8, dtype=np.uint16).tofile(tmp_path / "val.bin")
    (tmp_path / "meta.json").write_text(json.dumps({"dtype": "uint16"}))
    shard = TokenShard.open(tmp_path / "val.bin")
    with pytest.raises(DataError, match=r"val\.bin: has 8 tokens, fewer than block_size \+ 1 = 9"):
        BatchSampler(shard, batch_size=2, block_size=8)
    with pytest.raises(DataError, match="val.bin"):
        next(iterate_eval_batches(shard, 2, 8))
    with pytest.raises(ConfigError):
        BatchSampler(shard, batch_size=0, block_size=4)


def test_eval_batches_are_sequential_and_non_overlapping():
    batches = list(iterate_eval_batches(arange_shard(101), batch_size=4, block_size=10))
    xs = torch.cat([x for x, _ in batches])
    ys = torch.cat([y for _, y in batches])
    assert [len(x) for x, _ in batches] == [4, 4, 2]
    assert torch.equal(xs.flatten(), torch.arange(100))
    assert torch.equal(ys, xs + 1)
    assert len(list(iterate_eval_batches(arange_shard(101), 4, 10, max_batches=2))) == 2
    again = list(iterate_eval_batches(arange_shard(101), 4, 10))
    assert all(torch.equal(a[0], b[0]) for a, b in zip(batches, again))


def test_pad_collate_right_and_left():
    seqs = [[5, 6, 7], [8], []]
    ids, mask = pad_collate(seqs, pad_id=0)
    assert ids.tolist() == [[5, 6, 7], [8, 0, 0], [0, 0, 0]]
    assert mask.tolist() == [[1, 1, 1], [1, 0, 0], [0, 0, 0]]
    ids, mask = pad_collate(seqs, pad_id=9, side="left")
    assert ids.tolist() == [[5, 6, 7], [9, 9, 8], [9, 9, 9]]
    assert mask.tolist() == [[1, 1, 1], [0, 0, 1], [0, 0, 0]]
    assert ids.dtype == mask.dtype == torch.long
    with pytest.raises(ConfigError, match="side"):
        pad_collate(seqs, 0, side="middle")
    with pytest.raises(DataError):
        pad_collate([], 0)


class CountingTokens:
    """Wraps a token array and records every read: how many index calls, and how many tokens
    each returned. Turning the whole array into one (np.asarray, .copy(), iteration) fails."""

    def __init__(self, tokens: np.ndarray):
        self.tokens, self.reads = tokens, []
        self.dtype, self.shape = tokens.dtype, tokens.shape

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, index):
        out = self.tokens[index]
        self.reads.append(np.size(out))
        return out

    def __array__(self, *args, **kwargs):
        raise AssertionError("the whole shard was materialised")

    def __iter__(self):
        raise AssertionError("the shard was iterated token by token")


@pytest.mark.parametrize("n_tokens", [1_000, 1_000_000])
def test_next_batch_is_one_vectorised_read_of_only_the_batch(n_tokens):
    """next_batch does O(batch) work whatever the shard size: one fancy-index read per batch
    (no Python loop over rows), returning exactly batch_size * (block_size + 1) tokens, and it
    never copies the whole shard."""
    tokens = CountingTokens(np.arange(n_tokens, dtype=np.uint32))
    sampler = BatchSampler(TokenShard(tokens), batch_size=12, block_size=64, seed=3)
    for _ in range(5):
        x, y = sampler.next_batch()
        assert torch.equal(y, x + 1) and torch.equal(x, x[:, :1] + torch.arange(64))
    assert tokens.reads == [12 * 65] * 5
    tokens.reads.clear()
    batches = list(iterate_eval_batches(TokenShard(tokens), batch_size=4, block_size=10,
                                        max_batches=3))  # fmt: skip
    assert len(batches) == 3 and tokens.reads == [4 * 11] * 3
