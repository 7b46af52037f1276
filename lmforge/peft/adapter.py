"""Bottleneck adapters (Houlsby et al. 2019): h + W_up σ(W_down h) after a chosen module, with
W_up zero-initialised so the model starts out unchanged.
"""

from collections.abc import Callable, Iterable

from torch import Tensor, nn

from lmforge.errors import ConfigError, require_choice
from lmforge.peft.lora import name_matches

ADAPTER_ACTIVATIONS: dict[str, Callable[[], nn.Module]] = {
    "relu": nn.ReLU,
    "gelu": nn.GELU,
    "silu": nn.SiLU,
    "tanh": nn.Tanh,
}


class Adapter(nn.Module):
    """h + W_up σ(W_down h): a residual bottleneck MLP; identity at init because W_up = 0."""

    def __init__(self, d_model: int, bottleneck: int = 64, activation: str = "gelu"):
        super().__init__()
        require_choice("adapter activation", activation, ADAPTER_ACTIVATIONS)
        if d_model <= 0 or bottleneck <= 0:
            raise ConfigError(f"adapter sizes must be > 0, got {d_model}, {bottleneck}")
        self.down = nn.Linear(d_model, bottleneck)
        self.act = ADAPTER_ACTIVATIONS[activation]()
        self.up = nn.Linear(bottleneck, d_model)
        nn.init.zeros_(self.up.weight)
        nn.init.zeros_(self.up.bias)

    def forward(self, h: Tensor) -> Tensor:
        return h + self.up(self.act(self.down(h)))


class AdapterWrapper(nn.Module):
    """Runs the original module, then the adapter on its output (on the first element when the
    module returns a tuple, as transformer blocks often do)."""

    def __init__(self, module: nn.Module, adapter: Adapter):
        super().__init__()
        self.module, self.adapter = module, adapter

    def forward(self, *args, **kwargs):
        out = self.module(*args, **kwargs)
        if isinstance(out, tuple):
            return (self.adapter(out[0]), *out[1:])
        return self.adapter(out)


def _output_width(module: nn.Module) -> int | None:
    for attr in ("out_features", "embedding_dim", "d_model", "hidden_size", "n_embd"):
        if isinstance(getattr(module, attr, None), int):
            return getattr(module, attr)
    if shape := getattr(module, "normalized_shape", None):
        return shape[-1]
    # a composite module (an MLP, an attention block) usually ends in its output projection
    linears = [m for m in module.modules() if isinstance(m, nn.Linear)]
    return linears[-1].out_features if linears else None


def apply_adapters(
    model: nn.Module,
    targets: str | Iterable[str],
    bottleneck: int = 64,
    activation: str = "gelu",
    d_model: int | None = None,
    freeze_base: bool = True,
) -> list[str]:
    """Wrap every module whose name matches ``targets`` (dotted suffix or glob) so an Adapter
    follows it; freeze all non-adapter parameters unless ``freeze_base=False``. ``d_model`` is
    read from the module when not given (out_features, normalized_shape, …, else the
    out_features of its last registered nn.Linear). Returns the names."""
    names = [n for n, _ in model.named_modules() if n and name_matches(n, targets)]
    # a matched module's children would otherwise be wrapped twice (outer and inner)
    names = [n for n in names if not any(n.startswith(o + ".") for o in names)]
    if not names:
        available = [n for n, _ in model.named_modules() if n]
        raise ConfigError(f"no module matched adapter targets {targets!r}; have {available}")
    for n in names:
        module = model.get_submodule(n)
        width = d_model or _output_width(module)
        if width is None:
            raise ConfigError(f"cannot infer the output width of {n}; pass d_model")
        param = next(module.parameters(), None)
        adapter = Adapter(width, bottleneck, activation)
        if param is not None:
            adapter.to(device=param.device, dtype=param.dtype)
        model.set_submodule(n, AdapterWrapper(module, adapter))
    if freeze_base:
        model.requires_grad_(False)
        for m in model.modules():
            if isinstance(m, AdapterWrapper):
                m.adapter.requires_grad_(True)
    return names
