import math

import torch

from lmforge.model.positions import RotaryEmbedding, sinusoidal_table


def sinusoid_rotation(omega: float, k: int) -> torch.Tensor:
    """R(k) with PE(p + k) = R(k) PE(p) for one [sin, cos] pair of frequency omega."""
    c, s = math.cos(omega * k), math.sin(omega * k)
    return torch.tensor([[c, s], [-s, c]], dtype=torch.float64)


def test_sinusoidal_spec_values():
    table = sinusoidal_table(2, 4)
    assert torch.allclose(table[0], torch.tensor([0.0, 1.0, 0.0, 1.0]))
    expected = torch.tensor([0.84147098, 0.54030231, 0.00999983, 0.99995])
    assert torch.allclose(table[1], expected, atol=1e-6)


def test_sinusoid_relative_rotation_spec():
    omega, p, k = math.pi / 4, 2, 3
    pe_p = torch.tensor([math.sin(omega * p), math.cos(omega * p)], dtype=torch.float64)
    shifted = sinusoid_rotation(omega, k) @ pe_p
    assert torch.allclose(
        shifted, torch.tensor([-0.70711, -0.70711], dtype=torch.float64), atol=1e-5
    )
    direct = torch.tensor(
        [math.sin(omega * (p + k)), math.cos(omega * (p + k))], dtype=torch.float64
    )
    assert torch.allclose(shifted, direct)


def _rotate(rope, x, positions):
    cos, sin = rope.tables(positions, x.dtype)
    return rope.rotate(x, cos, sin)


def test_rope_identities_both_pairings():
    for interleaved in (False, True):
        rope = RotaryEmbedding(8, 64, interleaved=interleaved)
        q = torch.randn(1, 1, 1, 8).expand(1, 1, 20, 8).contiguous()
        k = torch.randn(1, 1, 1, 8).expand(1, 1, 20, 8).contiguous()
        pos = torch.arange(20)
        rq, rk = _rotate(rope, q, pos), _rotate(rope, k, pos)
        assert torch.allclose(rq[..., 0, :], q[..., 0, :], atol=1e-6)  # position 0 = identity
        assert torch.allclose(rq.norm(dim=-1), q.norm(dim=-1), atol=1e-5)  # norm preserved
        scores = rq[0, 0] @ rk[0, 0].T  # score(i, j) depends only on i - j
        for c in (1, 5):
            assert torch.allclose(scores[3 + c, 1 + c], scores[3, 1], atol=1e-4)
            assert torch.allclose(scores[10 + c, 2 + c], scores[10, 2], atol=1e-4)


def test_rope_pairings_are_a_permutation_of_each_other():
    d = 8
    half = RotaryEmbedding(d, 16, interleaved=False)
    inter = RotaryEmbedding(d, 16, interleaved=True)
    perm = torch.arange(d).view(2, d // 2).T.reshape(-1)  # [0, 4, 1, 5, 2, 6, 3, 7]
    x = torch.randn(1, 1, 16, d)
    pos = torch.arange(16)
    out_half = _rotate(half, x, pos)
    out_inter = _rotate(inter, x[..., perm], pos)
    assert torch.allclose(out_half[..., perm], out_inter, atol=1e-6)


def test_rope_per_row_positions_match_shared():
    rope = RotaryEmbedding(8, 32)
    x = torch.randn(2, 3, 5, 8)
    shared = _rotate(rope, x, torch.arange(2, 7))
    per_row = _rotate(rope, x, torch.arange(2, 7).expand(2, 5))
    assert torch.allclose(shared, per_row)
