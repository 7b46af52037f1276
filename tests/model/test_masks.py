import pytest
import torch

from lmforge.errors import ConfigError
from lmforge.model.masks import (
    BlockLocal,
    Strided,
    Window,
    build_mask,
    build_pattern,
)


def prefix_lm_mask(length: int, prefix_len: int, device=None) -> torch.Tensor:
    """[L, L] bool: j <= max(i, m) (1-indexed; prefix LM): the prefix is bidirectional, the rest
    causal. L=5, m=2 -> rows 11000/11000/11100/11110/11111."""
    pos = torch.arange(length, device=device)
    return build_mask(pos, pos, prefix_len=prefix_len)


def rows(mask):
    return ["".join(str(int(x)) for x in row) for row in mask.tolist()]


def test_prefix_lm_mask_spec_vector():
    """j <= max(i, m), 1-indexed: L=5, m=2."""
    assert rows(prefix_lm_mask(5, 2)) == ["11000", "11000", "11100", "11110", "11111"]


def test_prefix_zero_is_causal_and_full_prefix_is_bidirectional():
    assert rows(prefix_lm_mask(3, 0)) == ["100", "110", "111"]
    assert rows(prefix_lm_mask(3, 3)) == ["111", "111", "111"]


def test_block_local_strided_and_window_patterns():
    pos = torch.arange(6)
    assert rows(BlockLocal(3)(pos, pos)) == ["100000", "110000", "111000",
                                              "000100", "000110", "000111"]  # fmt: skip
    assert rows(Strided(2)(pos, pos)) == ["100000", "110000", "111000",
                                           "011100", "101110", "010111"]  # fmt: skip
    assert rows(Window(2)(pos, pos)) == ["100000", "110000", "011000",
                                          "001100", "000110", "000011"]  # fmt: skip


def test_masks_depend_on_absolute_positions_only():
    """A cache that dropped old keys sees the same sub-mask (what rolling caches rely on)."""
    pattern = Window(3)
    full = build_mask(torch.arange(10), torch.arange(10), pattern)
    part = build_mask(torch.arange(7, 10), torch.arange(5, 10), pattern)
    assert torch.equal(part, full[7:10, 5:10])


def test_padding_keys_hidden_but_rows_never_empty():
    key_mask = torch.tensor([[False, False, True, True]])
    mask = build_mask(torch.arange(4), torch.arange(4), key_mask=key_mask)
    assert mask.shape == (1, 1, 4, 4)
    assert rows(mask[0, 0]) == ["1000", "0100", "0010", "0011"]


@pytest.mark.parametrize(
    "spec",
    [{"type": "dilated", "stride": 2}, {"type": "strided"},
     {"type": "block_local", "block_size": 0}, "strided"],
)  # fmt: skip
def test_bad_pattern_specs_name_the_field(spec):
    with pytest.raises(ConfigError, match="attention_pattern"):
        build_pattern(spec)
