"""A GGUF file into a Transformer one tensor at a time, each tensor going from the memory-mapped
file straight into the layer that will run it.

The model is built on the meta device (no memory), then each of its tensors is read from the
file, converted and placed, and the file's pages for it are dropped from this process
(GGUFFile.release): loading holds the finished layers plus one tensor in flight, never a float32
copy of the whole model. Three policies:

- `as_stored` (LM.load's default): the file's own precision. Q8_0 blocks become BlockInt8Linear
  and Q4_0 / Q4_1 / Q5_0 / Q5_1 blocks Int4Linear code for code (both are the native kernels'
  formats, only interleaved; Q4_0 / Q5_0 in the symmetric layouts, without offsets; Q5 in the
  5-bit ones); a fused layer joining Q8_0 with Q4_0 / Q5_0 parts holds them all as Q8_0 blocks
  (their centred codes fit int8: exact). F16 / BF16 stay 16-bit
  (HalfLinear), F32 stays F32; the token table too (QuantizedEmbedding, whose layer is also the
  head of a tied model). Q4_K / Q5_K super-blocks go block by block into the int4 / int5
  layouts (each sub-block of 32 a group, its scale d sc and offset -dmin m rounded to fp16: the
  only error); Q6_K into the int6 layout (Int6Linear: exact, its d repeated per group of 32: 7
  bits a weight against 6.56). Formats the kernels have no layout for (Q2_K, Q3_K, the IQ types)
  are
  dequantised one tensor at a time and quantised again: to int4 (groups of 32, scale and
  offset: Q4_1's layout) when they store at most 5 bits per weight, else to Q8_0. A fused layer
  (qkv) whose parts mix formats that no one layout holds keeps each part in its own layer, as
  stored where it can be (StackedLinear: llama-quantize's Q4_K / Q6_K qkv). One warning
  states which tensors were converted and the largest relative weight error that caused.
  Activations are float32.
- `dense`: every tensor dequantised to one dtype (training, export, `--dtype` given).
- `quantized`: lmforge's int8 / int4 (`--quantize`), as lmforge.infer.quantize makes them, from
  each layer's dequantised weights; Q4_0 / Q4_1 tensors keep their codes under int4.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

import torch
from torch import nn

from lmforge.errors import CheckpointError
from lmforge.infer.cpu_kernels import native_kernels
from lmforge.infer.int4_linear import Int4Linear, Int6Linear
from lmforge.infer.quantized_linear import (
    BLOCK,
    BlockInt8Linear,
    HalfLinear,
    Int8Linear,
    QuantizedEmbedding,
    QuantizedLinear,
    StackedLinear,
)
from lmforge.interop.families import Rule
from lmforge.interop.gguf_blocks import (
    GROUP_TYPES,
    K_GROUP_TYPES,
    Q8_EXACT_TYPES,
    read_group_blocks,
    read_k_blocks,
    read_q6_k_blocks,
    read_q8_blocks,
)
from lmforge.interop.gguf_header import ggml_types
from lmforge.interop.gguf_read import (
    PLAIN_TYPES,
    GGUFFile,
    check_tensors,
    permute_named,
    read_config,
)
from lmforge.interop.hf import to_ours
from lmforge.model.linear import Linear, plain_linear
from lmforge.model.transformer import Transformer

CONVERT_TO_INT4_BITS = 5.0  # at most Q4_1's bits per weight: int4 loses nothing it had


def bits_per_weight(type_name: str) -> float:
    _, block, nbytes = next(t for t in ggml_types().values() if t[0] == type_name)
    return 8 * nbytes / block


class _Loader:
    """Fills a meta-device Transformer from a GGUF file, tensor by tensor."""

    def __init__(self, f: GGUFFile, policy: str, dtype: torch.dtype, quantize: str | None,
                 device: torch.device):  # fmt: skip
        self.f, self.policy, self.dtype, self.quantize = f, policy, dtype, quantize
        self.device = device
        self.config, self.family = read_config(f)
        self.config.extra["gguf_architecture"] = f.architecture
        with torch.device("meta"):
            self.model = Transformer(self.config)
        self.to_gguf = check_tensors(f, self.family, self.config, self.model)
        self.converted: list[tuple[str, str, float]] = []  # (gguf name, type, relative error)

    # ---- reading ---------------------------------------------------------------------------
    def parts(self, rule) -> list[str]:
        return [self.to_gguf[h] for h in rule.hf_keys]

    def join(self, rule, tensors: list[torch.Tensor]) -> torch.Tensor:
        """Our tensor from its GGUF parts: as from an HF file, but GPT-2's projections are
        already stored [out, in] (no Conv1D transpose) and Gemma's norms already as 1 + weight
        (llama.cpp's converter adds the 1)."""
        if rule.transform in ("transpose", "plus_one"):
            return tensors[0]
        return to_ours(rule, tensors)

    def unpermute(self, name: str, t: torch.Tensor) -> torch.Tensor:
        return permute_named(name, t, self.config, self.f.architecture, reverse=True)

    def dense(self, rule, dtype: torch.dtype) -> torch.Tensor:
        """Our tensor dequantised to `dtype` (through float32 for the block formats)."""
        (out,) = self.components(rule, lambda f, name: [f.read(name, dtype)])
        return out.to(self.device)

    def components(self, rule, read: Callable) -> list[torch.Tensor]:
        """Each per-row component `read(f, name)` returns (codes, scales, ...), joined over the
        rule's parts: rows carry their own block scales, so un-permuting and concatenating rows
        is exact."""
        names = self.parts(rule)
        per_part = [[self.unpermute(g, t) for t in read(self.f, g)] for g in names]
        joined = [self.join(rule, list(parts)).contiguous() for parts in zip(*per_part)]
        for g in names:  # done with their pages (GGUFFile.release)
            self.f.release(g)
        return joined

    def group_blocks(self, rule) -> list[torch.Tensor | None]:
        """(nibbles, d, m, high) of a rule whose parts are Q4_0 / Q4_1 / Q5_0 / Q5_1
        (`read_group_blocks`) or Q4_K / Q5_K (`read_k_blocks`, whose rounding error is recorded
        for the warning): m None when every part is Q4_0, or every part Q5_0 (a symmetric
        layout); in a rule mixing them, the symmetric parts get their implied offset m = -8 d or
        -16 d (exact in fp16: a power-of-two multiple); high None unless a part is Q5 (then
        zero for the parts without fifth bits)."""
        kinds = self.kinds(rule)
        symmetric, five = kinds in ({"Q4_0"}, {"Q5_0"}), any(k.startswith("Q5") for k in kinds)
        errors: list[tuple[float, float]] = []

        def read(f: GGUFFile, g: str) -> tuple[torch.Tensor, ...]:
            if f.tensors[g].type_name in K_GROUP_TYPES:
                q, d, m, high, error = read_k_blocks(f, g)
                errors.append(error)
            else:
                q, d, m, high = read_group_blocks(f, g)
            if m is None and not symmetric:
                m = -(8 if high is None else 16) * d
            if high is None and five:
                high = torch.zeros(d.shape, dtype=torch.int32)
            return tuple(t for t in (q, d, m, high) if t is not None)

        parts = self.components(rule, read)
        if errors:
            error, norm = map(sum, zip(*errors))
            self.converted.append((",".join(self.parts(rule)), "/".join(sorted(kinds)),
                                   (error / max(norm, 1e-30)) ** 0.5))  # fmt: skip
        return [*parts[:2], None if symmetric else parts[2], parts[-1] if five else None]

    def kinds(self, rule) -> set[str]:
        return {self.f.tensors[g].type_name for g in self.parts(rule)}

    # ---- layers ------------------------------------------------------------------------------
    def stored_layer(self, rule, bias: torch.Tensor | None, name: str) -> nn.Module | None:
        """The file's precision: an exact layer where the kernels hold the format, a converted
        one where they do not; None for F32 (a plain Linear)."""
        kinds = self.kinds(rule)
        if kinds == {"F32"}:
            return None
        if "Q8_0" in kinds and kinds <= set(Q8_EXACT_TYPES):
            q, d = self.components(rule, read_q8_blocks)
            return BlockInt8Linear.from_blocks(q, d, bias, self.dtype)
        five = any(k.startswith("Q5") for k in kinds)  # the 5-bit layouts: native kernels only
        if kinds <= {*GROUP_TYPES, *K_GROUP_TYPES} and (not five or native_kernels()):
            q, d, m, high = self.group_blocks(rule)
            return Int4Linear.from_q4_blocks(q, d, m, bias, self.dtype, name, high)
        if kinds == {"Q6_K"} and native_kernels():
            return Int6Linear(*self.components(rule, read_q6_k_blocks), bias, self.dtype)
        if len(kinds) == 1 and (kind := next(iter(kinds))) in ("F16", "BF16"):
            return HalfLinear(self.dense(rule, PLAIN_TYPES[kind]), bias, self.dtype)
        if rule.transform == "cat" and len(kinds) > 1 and "F32" not in kinds:  # each as stored
            parts = [self.stored_layer(Rule((k,)), None, name) for k in rule.hf_keys]
            return StackedLinear(parts, bias, self.dtype)
        weight = self.dense(rule, torch.float32)
        bits = max(bits_per_weight(k) for k in kinds)
        linear = _dense_linear(weight, None)
        if bits <= CONVERT_TO_INT4_BITS and weight.shape[1] % BLOCK == 0:
            layer: QuantizedLinear = Int4Linear(linear, self.dtype, BLOCK, name)
        else:
            layer = BlockInt8Linear(linear, self.dtype)
        error = float((layer.dequantize(dtype=torch.float32) - weight).norm() / weight.norm())
        self.converted.append((",".join(self.parts(rule)), "/".join(sorted(kinds)), error))
        layer.register_buffer("bias", None if bias is None else bias.to(self.dtype))
        return layer

    def quantized_layer(self, rule, bias: torch.Tensor | None, name: str) -> nn.Module:
        """lmforge's int8 / int4 (lmforge.infer.quantize's choices: int4 keeps the output head
        at int8), Q4_0 / Q4_1 codes kept under int4."""
        if self.quantize == "int4" and self.kinds(rule) <= {"Q4_0", "Q4_1"}:
            q, d, m, _ = self.group_blocks(rule)
            return Int4Linear.from_q4_blocks(q, d, m, bias, self.dtype, name)
        linear = _dense_linear(self.dense(rule, torch.float32), bias)
        if self.quantize == "int8" or name == "lm_head":
            return Int8Linear(linear, self.dtype)
        return Int4Linear(linear, self.dtype, BLOCK, name)

    def linear(self, module: nn.Linear, rule, bias_rule, name: str) -> nn.Module:
        bias = None if bias_rule is None else self.dense(bias_rule, self.dtype)
        if self.policy == "quantized":
            return self.quantized_layer(rule, bias, name)
        layer = self.stored_layer(rule, bias, name) if self.policy == "as_stored" else None
        if layer is not None:
            return layer
        _assign(module, "weight", self.dense(rule, self.dtype))
        if bias is not None:
            _assign(module, "bias", bias)
        return module

    # ---- the model ---------------------------------------------------------------------------
    def build(self) -> Transformer:
        config, model = self.config, self.model
        key_map = self.family.key_map(config)
        linears = {n: m for n, m in model.named_modules() if plain_linear(m)}
        for ours, rule in key_map.items():
            module_name, _, attr = ours.rpartition(".")
            if module_name in linears and attr == "bias":
                continue  # placed with its weight
            if module_name in linears:
                layer = self.linear(linears[module_name], rule,
                                    key_map.get(f"{module_name}.bias"), module_name)  # fmt: skip
                model.set_submodule(module_name, layer)
            elif ours == "embed.weight" and self.policy == "as_stored":
                table = self.stored_layer(rule, None, "embed")
                if table is None:
                    _assign(model.embed, "weight", self.dense(rule, self.dtype))
                else:
                    model.embed = QuantizedEmbedding(table)
            else:
                module = model.get_submodule(module_name)
                t = getattr(module, attr, None)
                dtype = self.dtype if t is None or t.dtype.is_floating_point else torch.float32
                _assign(module, attr, self.dense(rule, dtype))
        if config.tie_embeddings:
            if isinstance(model.embed, QuantizedEmbedding):
                model.lm_head = model.embed.table  # one table: the lookup and the head
            elif self.policy == "quantized":  # the head at int8 under both (quantize.py's rule)
                linear = _dense_linear(model.embed.weight.detach().float(), None)
                model.lm_head = Int8Linear(linear, self.dtype)
            else:
                model.lm_head.weight = model.embed.weight
        for name, buf in list(model.named_buffers()):
            if buf.is_meta:  # tables the model computes (RoPE): refilled below
                module_name, _, attr = name.rpartition(".")
                empty = torch.empty(buf.shape, dtype=buf.dtype, device=self.device)
                _assign(model.get_submodule(module_name), attr, empty)
        model.reset_buffers()
        if left := [n for n, p in model.named_parameters() if p.is_meta]:
            raise CheckpointError(f"{self.f.path}: no tensor for {', '.join(left[:5])}")
        if self.converted:
            self.warn_converted()
        model.eval()
        if self.policy != "dense":
            model.requires_grad_(False)
        return model

    def warn_converted(self) -> None:
        names, kinds, errors = zip(*self.converted)
        worst = max(range(len(errors)), key=errors.__getitem__)
        warnings.warn(
            f"{self.f.path}: {len(names)} tensor(s) of type {', '.join(sorted(set(kinds)))} have "
            "no exact layout in lmforge's kernels and were converted per tensor (Q4_K / Q5_K "
            "block by block to int4 / int5 groups of 32, their scales' products rounded to fp16; "
            f"others re-quantised: int4 groups of 32 up to {CONVERT_TO_INT4_BITS:g} bits per "
            f"weight, Q8_0 above); largest relative weight error {errors[worst]:.2%} "
            f"({names[worst]})",
            stacklevel=4,
        )


def _dense_linear(weight: torch.Tensor, bias: torch.Tensor | None) -> nn.Linear:
    """A `Linear` holding `weight` (and `bias`) without initialising anything."""
    with torch.device("meta"):
        linear = Linear(weight.shape[1], weight.shape[0], bias=bias is not None)
    _assign(linear, "weight", weight)
    if bias is not None:
        _assign(linear, "bias", bias)
    return linear


def _assign(module: nn.Module, attr: str, tensor: torch.Tensor) -> None:
    """Replace a (meta) parameter or buffer by `tensor`."""
    if attr in module._parameters:
        module._parameters[attr] = nn.Parameter(tensor, requires_grad=tensor.is_floating_point())
    else:
        module._buffers[attr] = tensor


def load_gguf_weights(
    f: GGUFFile,
    device: str | torch.device = "cpu",
    dtype: torch.dtype | None = None,
    quantize: str | None = None,
) -> Transformer:
    """The Transformer of an opened GGUF file, built one tensor at a time (module docstring).
    dtype None and no quantize: the file's own precision on a CPU (float32 activations), every
    tensor dequantised to float32 elsewhere; a dtype alone: every tensor dequantised to it;
    quantize ('int8' / 'int4'): lmforge's quantised layers with `dtype` activations."""
    device = torch.device(device)
    if quantize is not None:
        policy = "quantized"
    elif dtype is None and device.type == "cpu":
        policy = "as_stored"
    else:
        policy = "dense"
    return _Loader(f, policy, dtype or torch.float32, quantize, device).build()
