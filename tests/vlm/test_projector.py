import pytest
import torch

from lmforge.errors import ConfigError
from lmforge.vlm.projector import PROJECTORS, build_projector


def test_linear_projector_is_w_v_plus_b():
    proj = build_projector("linear", 4, 6)
    v = torch.randn(2, 5, 4)
    torch.testing.assert_close(proj(v), v @ proj.proj.weight.T + proj.proj.bias)


@pytest.mark.parametrize("kind", sorted(PROJECTORS))
def test_projector_shapes(kind):
    assert build_projector(kind, 4, 6)(torch.randn(2, 5, 4)).shape == (2, 5, 6)


def test_unknown_projector():
    with pytest.raises(ConfigError, match="projector must be one of"):
        build_projector("conv", 4, 6)
