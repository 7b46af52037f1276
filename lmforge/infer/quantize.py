"""Inference precision and kernels: the activation dtype per machine, a model's Linears converted
to the weight-only int8 / int4 layers of quantized_linear.py and int4_linear.py
(`to_inference_precision`), and the place that picks the kernel each layer of the engine's
model runs (`inference_model`) and says which (`kernel_plan`, `lmforge precision`).
Measurements behind each choice: docs/inference.md.

Decoding one token reads every weight once, so on a CPU a small batch runs at memory bandwidth /
weight bytes (int8 reads 4x fewer bytes than fp32, int4 8x fewer), and what computes fastest
depends on the CPU (cpu_features.py):

- Activations (`--dtype auto`, `resolve_dtype`): bf16 where the CPU multiplies bf16 natively (AMX,
  AVX512-BF16), fp32 elsewhere (emulated bf16 is several times slower). With --quantize and
  lmforge's kernels built, fp32 (they take fp32 inputs). On a GPU bf16 where supported.
- lmforge's CPU kernels (cpu_kernels.py) take every product of a layer they fit (inputs a multiple
  of 32; int4 groups of 32), decode and prefill alike: activations quantised to int8 per block of
  32 and multiplied as integers, as llama.cpp does for Q8_0/Q4_0.
- Elsewhere (no compiler, a layer that does not fit, a GPU), torch's kernels: below `gemm_rows`
  rows `aten._weight_int8pack_mm` / `_weight_int4pack_mm_for_cpu` (`_weight_int4pack_mm` on
  CUDA) on bf16 activations (their fp32 variants are not vectorised on AVX2 CPUs); above, the
  activation dtype's GEMM on dequantised weights (`QuantizedLinear.gemm_dtype`: bf16 where the
  CPU has bf16 units), dequantised in chunks of rows rather than kept as a second copy.

int4 is group-wise asymmetric (w = (q - 8) * scale + zero per group, torch's int4pack
convention), so llama.cpp's Q4_1 blocks map onto it code for code (`Int4Linear.from_q4_blocks`),
and Q4_0's (zero = 0) onto the same kernel's symmetric layout, which stores no offsets (4.5 bits
a weight, as the file); Q8_0's scale is per block of 32, so it has its own layer
(`BlockInt8Linear`), which a GGUF loaded at its own precision uses. `--quantize int4` quantises
asymmetrically.

    model = inference_model(model, dtype="auto", quantize="int8")  # what the engine runs
"""

from __future__ import annotations

import copy
import functools
import itertools
import sys
import warnings

import torch
import torch.nn.functional as F
from torch import nn

from lmforge.errors import ConfigError
from lmforge.infer.cpu_features import CPUFeatures, cpu_features
from lmforge.infer.cpu_kernels import native_kernels
from lmforge.infer.int4_linear import DEFAULT_GROUP_SIZE, Int4Linear, check_int4_shape
from lmforge.infer.quantized_linear import (
    HalfLinear,
    Int8Linear,
    QuantizedEmbedding,
    QuantizedLinear,
    cpu_kernel_dtype,
)
from lmforge.model.attention import CausalSelfAttention
from lmforge.model.linear import Linear, onednn_available, plain_linear
from lmforge.model.mlp import GatedMLP
from lmforge.model.norms import RMSNorm
from lmforge.model.positions import LearnedPositions, RotaryEmbedding

# The choices every CLI offers (chat, serve, generate share them).
DTYPE_CHOICES = ("auto", "float32", "bfloat16", "float16")
QUANTIZE_CHOICES = ("int8", "int4")
DTYPE_HELP = (
    "activation/weight precision for decoding; auto (default): bfloat16 where the CPU has native "
    "bf16 (AMX, AVX512-BF16) or on a GPU, float32 elsewhere (emulated bf16 is ~5x slower)"
)
QUANTIZE_HELP = (
    "weight-only quantisation: int8 (per-channel, 4x fewer weight bytes than fp32) or int4 "
    "(group-wise, 8x fewer); prefill multiplies by the dequantised weights"
)

DTYPES_BY_NAME = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_ALIASES = {"bf16": "bfloat16", "fp32": "float32", "fp16": "float16", "f32": "float32"}


# ---- the activation dtype per machine ----------------------------------------------------------
def auto_dtype(
    device: torch.device | str = "cpu",
    features: CPUFeatures | None = None,
    quantize: str | None = None,
):
    """(dtype, why): what `--dtype auto` picks for `device` (and a `quantize` mode), and one
    line saying why."""
    device = torch.device(device)
    if device.type == "cuda":
        if torch.cuda.is_bf16_supported():
            return torch.bfloat16, f"{torch.cuda.get_device_name(device)} multiplies bf16 natively"
        return torch.float16, f"{torch.cuda.get_device_name(device)} has no bf16: float16"
    if device.type != "cpu":
        return torch.float32, f"no per-device rule for {device.type}: float32"
    f = features or cpu_features()
    if quantize in QUANTIZE_CHOICES and native_kernels() is not None:
        return torch.float32, (f"{f.summary()}: lmforge's {quantize} kernel takes fp32 "
                               "activations (it quantises them to int8 per 32)")  # fmt: skip
    if f.native_bf16:
        unit = "AMX" if f.amx else "AVX512-BF16"
        return torch.bfloat16, f"{f.summary()}: bf16 matmuls run on {unit}"
    return torch.float32, f"{f.summary()}: bf16 would be emulated (~5x slower matmuls)"


@functools.cache
def _say_once(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def resolve_dtype(
    dtype: torch.dtype | str | None,
    device: torch.device | str | None = None,
    features: CPUFeatures | None = None,
    announce: str | None = None,
    quantize: str | None = None,
) -> torch.dtype | None:
    """The one place a precision name becomes a torch dtype ('bf16', 'bfloat16', torch.float32;
    None stays None: the checkpoint's own). 'auto' picks per machine for `device` (the CPU when
    None; `auto_dtype`) and prints once per process what it chose and why (`announce`: a
    quantize mode whose kernels the line names too; '' for none; None prints nothing). A bf16 or
    fp16 asked for on a CPU `device` that would emulate it runs, with one warning naming the
    dtype auto would pick."""
    if dtype is None:
        return None
    if isinstance(dtype, str):
        name = _ALIASES.get(dtype, dtype)
        if name == "auto":
            chosen, why = auto_dtype(device or "cpu", features, quantize or announce or None)
            if announce is not None:
                kernels = describe_kernels(chosen, announce or None, device or "cpu")
                _say_once(f"dtype auto: {str(chosen).removeprefix('torch.')} ({why}){kernels}")
            return chosen
        if name not in DTYPES_BY_NAME:
            raise ConfigError(f"dtype must be one of {list(DTYPE_CHOICES)}, got {dtype!r}")
        dtype = DTYPES_BY_NAME[name]
    half = dtype in (torch.bfloat16, torch.float16)
    if half and device is not None and torch.device(device).type == "cpu":
        chosen, why = auto_dtype(device, features)
        if chosen != dtype:
            _warn_once(
                f"{str(dtype).removeprefix('torch.')} on this CPU runs, but slowly: {why}; "
                f"--dtype auto would use {str(chosen).removeprefix('torch.')}"
            )
    return dtype


def describe_kernels(dtype: torch.dtype, quantize: str | None, device="cpu") -> str:
    """'; int8: ...' naming the kernels a quantised model runs with these activations (for an
    unquantised one, those of bf16 / fp16 weights on a CPU; '' for torch's own): what `--dtype
    auto` prints after its choice."""
    if quantize is None:
        return _describe_half(dtype, device)
    if torch.device(device).type == "cuda":
        kernel = "_weight_int4pack_mm" if quantize == "int4" else "a GEMM on bf16-cast int8"
        return f"; {quantize}: {kernel} at every batch size"
    native = native_kernels()
    if native is not None:
        groups = " at group size 32, torch's kernels at others" if quantize == "int4" else ""
        return (f"; {quantize}: lmforge's {native.variant} {quantize} kernel (activations "
                f"quantised to int8 per 32) at every batch size, decode and prefill"
                f"{groups}")  # fmt: skip
    kernel = "_weight_int4pack_mm_for_cpu" if quantize == "int4" else "_weight_int8pack_mm"
    kdtype = cpu_kernel_dtype(dtype)
    cast = "" if kdtype == dtype else f" on {str(kdtype).removeprefix('torch.')}-rounded inputs"
    native_bf16 = dtype == torch.float32 and cpu_features().native_bf16
    gemm = torch.bfloat16 if native_bf16 else dtype  # QuantizedLinear.gemm_dtype
    big = f"{str(gemm).removeprefix('torch.')} GEMM on dequantised weights"
    if quantize == "int8" and (short := {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(gemm)):
        big = f"{short} GEMM on a {short} copy of the int8 values"
    if gemm != dtype:
        big += " (inputs rounded to it)"
    rows = QuantizedLinear.gemm_rows
    return (f"; {quantize}: {kernel}{cast} below {rows} rows (decode), "
            f"{big} from {rows} rows (prefill)")  # fmt: skip


def _describe_half(dtype: torch.dtype, device) -> str:
    """'; bf16 weights: ...' where the engine multiplies 16-bit weights by lmforge's kernel."""
    if dtype not in (torch.bfloat16, torch.float16) or torch.device(device).type != "cpu":
        return ""
    native = native_kernels()
    if native is None:
        return ""
    short = "bf16" if dtype == torch.bfloat16 else "fp16"
    how, rows = "fp32 multiply-adds on converted weights", "at every batch size"
    if dtype == torch.bfloat16 and native.variant == "avx512_bf16":
        how = "the AVX512-BF16 dot product"
        rows = f"up to {HalfLinear.torch_bf16_rows} rows, torch's bf16 GEMM above"
    return f"; {short} weights: lmforge's {native.variant} dense matmul ({how}) {rows}"


def kernel_plan(dtype: torch.dtype, quantize: str | None = None, device="cpu") -> dict[str, str]:
    """{layer kind: the kernel it runs} in a model `inference_model` converts to `dtype` with
    `quantize` on `device` (what `lmforge precision` prints)."""
    native = native_kernels() if torch.device(device).type == "cpu" else None
    linear = describe_kernels(dtype, quantize, device).removeprefix("; ").split(": ", 1)[-1]
    decode = f"lmforge's {native.variant} decode attention" if native else "SDPA"
    prefill = (f"lmforge's {native.variant} causal prefill attention (eager; SDPA in compiled "
               "steps and with masks)" if native else "SDPA (causal)")  # fmt: skip
    if not linear and dtype == torch.float32 and torch.device(device).type == "cpu":
        gemm = "oneDNN's fp32 GEMM (model/linear.py)" if onednn_available() else ""
        if native is not None:
            above = gemm or "torch's fp32 matmul"
            gemm = f"lmforge's {native.variant} dense matmul up to {Linear.gemv_rows} rows, {above}"
        linear = gemm
    rows = (
        f"lmforge's {native.variant} kernels for RMSNorm, rotate-half RoPE, SwiGLU's "
        "silu(gate) * up and the greedy argmax; torch for the rest"
        if native
        else "torch"
    )
    return {"Linear": linear or f"torch's {str(dtype).removeprefix('torch.')} matmul",
            "attention, decoding": f"{decode} (one query per row)",
            "attention, prefill": prefill,
            "norms, RoPE, SiLU, argmax": rows}  # fmt: skip


@functools.cache
def _warn_once(message: str) -> None:
    warnings.warn(message, stacklevel=4)


# ---- conversion --------------------------------------------------------------------------------
def swap_linears(module: nn.Module, make) -> None:
    """Replace every nn.Linear under `module` by make(linear, qualified name)."""
    found = module.named_modules(remove_duplicate=False)  # a module used twice: swapped twice
    for name, linear in [(n, m) for n, m in found if plain_linear(m)]:
        parent, _, attr = name.rpartition(".")
        setattr(module.get_submodule(parent), attr, make(linear, name))


def to_inference_precision(
    model: nn.Module,
    dtype: torch.dtype | str | None = None,
    quantize: str | None = None,
    copy_model: bool = True,
    group_size: int = DEFAULT_GROUP_SIZE,
    int4_codes: dict | None = None,
) -> nn.Module:
    """The model in `dtype` with its Linear layers quantised (`quantize`: None, 'int8', 'int4';
    int4 keeps the output head at int8 unless `int4_codes` holds it).

    dtype 'auto' (or None with a quantize) picks per machine (`resolve_dtype`). int4 checks every
    layer's shape first. `int4_codes`: {linear name: (codes, scale, zero)} already quantised
    (`Int4Linear.from_codes`), used instead of quantising those layers. With copy_model the
    input is left untouched (the engine's caller may keep training it); a model already in the
    asked precision is returned as it is, as is one already holding quantised layers (or a GGUF
    file loaded at its own precision) when no dtype is asked for."""
    if quantize is not None and quantize not in QUANTIZE_CHOICES:
        raise ConfigError(
            f"quantize must be one of {list(QUANTIZE_CHOICES)} or None, got {quantize!r}"
        )
    layers = [m for m in model.modules() if isinstance(m, (QuantizedLinear, QuantizedEmbedding))]
    as_stored = any(isinstance(m, (QuantizedEmbedding, HalfLinear)) for m in layers)
    if as_stored and (quantize is not None or dtype not in (None, "auto")):
        raise ConfigError(
            "this model runs a GGUF file at its own precision; ask for another one when loading "
            f"it (LM.load(path, dtype=..., quantize=...)), not afterwards (dtype={dtype!r}, "
            f"quantize={quantize!r})"
        )
    if dtype in (None, "auto") and layers:  # quantised on load, or a GGUF file as stored
        return model
    first = next(model.parameters())
    announce = (quantize or "") if dtype == "auto" else None  # asked for: say what it chose
    auto = dtype == "auto" or (dtype is None and quantize is not None)
    dtype = resolve_dtype("auto" if auto else dtype, first.device, announce=announce,
                          quantize=quantize) or first.dtype  # fmt: skip
    if quantize is None and dtype == first.dtype:
        return model
    device, codes = first.device, int4_codes or {}
    if quantize == "int4":
        for name, linear in model.named_modules():
            if plain_linear(linear) and name not in codes:
                check_int4_shape(name, linear.in_features, group_size)
    if copy_model:
        model = copy.deepcopy(model)
    model = model.to(dtype).eval().requires_grad_(False)
    if quantize == "int8":
        swap_linears(model, lambda linear, name: Int8Linear(linear, dtype))
    elif quantize == "int4":

        def make(linear: nn.Linear, name: str) -> Int4Linear:
            if name in codes:
                q, scale, zero = (t.to(linear.weight.device) for t in codes[name])
                if q.shape != linear.weight.shape:
                    raise ConfigError(
                        f"int4 codes for {name} have shape {tuple(q.shape)}, the layer "
                        f"{tuple(linear.weight.shape)}"
                    )
                return Int4Linear.from_codes(q, scale, zero, linear.bias, dtype, name)
            if name == "lm_head":  # as llama.cpp's Q4 mixes keep output.weight at 6-8 bits:
                return Int8Linear(linear, dtype)  # an int4 head cost SmolLM2 5.5% perplexity
            return Int4Linear(linear, dtype, group_size, name)

        swap_linears(model, make)
    if auto and dtype == torch.float32 and device.type == "cpu" and cpu_features().native_bf16:
        for layer in model.modules():  # auto chose fp32 for the decode kernels: bf16 prefill
            if isinstance(layer, QuantizedLinear):
                layer.gemm_dtype = torch.bfloat16
    return model


def inference_model(
    model: nn.Module, dtype: torch.dtype | str | None = None, quantize: str | None = None
) -> nn.Module:
    """The model the engine runs, in eval mode: in `dtype` with `quantize`d Linears (a converted
    copy, `to_inference_precision`), or, where the model already is in that precision, a copy of
    its module tree that shares every parameter and buffer (training updates stay visible; the
    caller's modules are never changed). Each layer's kernel is chosen here:

    - Linear: Int8Linear / Int4Linear with `quantize` (quantized_linear.py / int4_linear.py
      pick their kernels);
      bf16 / fp16 weights on a CPU with lmforge's kernels built: HalfLinear; else the model's
      own layer (model/linear.py `Linear`: fp32 on a CPU through oneDNN, and with lmforge's
      kernels built lmforge's dense GEMV for a decode step's few rows, `Linear.gemv`).
    - softmax attention decoding one token per row on a CPU: lmforge's fused decode attention
      (native/decode_attention.cpp, `CausalSelfAttention.decode_kernel`), and its fused causal
      prefill attention (native/prefill_attention.cpp, `prefill_kernel`); else SDPA.
    - SwiGLU MLPs on a CPU: `SwiGLU` (lmforge's silu(gate) * up in one pass).
    - RMSNorm and RoPE (rotate-half) on a CPU: lmforge's one-pass kernels (`RMSNorm.kernel`,
      `RotaryEmbedding.kernel`).
    """
    converted = to_inference_precision(model, dtype, quantize)
    if converted is model:
        shared = itertools.chain(model.parameters(), model.buffers())
        converted = copy.deepcopy(model, memo={id(t): t for t in shared})
    converted.eval()
    device = next(converted.parameters()).device
    native = native_kernels() if device.type == "cpu" else None
    if native is not None:
        swap_linears(converted, lambda linear, name: HalfLinear(linear.weight, linear.bias,
                     linear.weight.dtype) if _half_weights(linear) else linear)  # fmt: skip
        for layer in converted.modules():
            if isinstance(layer, CausalSelfAttention):
                layer.decode_kernel = native.decode_attention
                layer.prefill_kernel = native.prefill_attention
            if isinstance(layer, Linear):
                layer.gemv = native.dense_matmul
            if isinstance(layer, RMSNorm):
                layer.kernel = native.rms_norm
            if isinstance(layer, RotaryEmbedding) and not layer.interleaved:
                layer.kernel = native.rope_rotate_half
            if type(layer) is GatedMLP and layer.act is F.silu:
                layer.__class__, layer.silu_mul = SwiGLU, native.silu_mul
                layer.bf16_gemm = all(_bf16_gemm(p) for p in (layer.gate_proj, layer.up_proj,
                                                              layer.down_proj))  # fmt: skip
    call_directly(converted)
    return converted


def _half_weights(linear: nn.Linear) -> bool:
    """bf16 / fp16 weights on a CPU: lmforge's dense GEMV reads them at the memory bandwidth
    (HalfLinear over the same tensors, so training updates stay visible)."""
    w = linear.weight
    return w.device.type == "cpu" and w.dtype in (torch.bfloat16, torch.float16)


class SwiGLU(GatedMLP):
    """The engine's GatedMLP with SiLU on a CPU with lmforge's kernels: silu(gate) * up in one
    pass (native/activations.cpp) instead of torch's two. Where gate, up and down are bf16
    HalfLinears on the bf16 dot product (`bf16_gemm`), past their GEMV rows (a prefill), gate and
    up come out of torch's bf16 GEMM as bf16 and the product goes into down's as bf16: x is
    converted once, not twice, and none of gate, up or their product takes a trip through fp32
    (five passes over [rows, d_ff] become one). Training, gradients and compiled code trace
    GatedMLP's forward."""

    silu_mul = None  # NativeKernels.silu_mul
    bf16_gemm = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training or torch.is_grad_enabled() or torch.compiler.is_compiling():
            return super().forward(x)
        h = x.reshape(-1, x.shape[-1])
        gate, up, down = self.gate_proj, self.up_proj, self.down_proj
        if self.bf16_gemm and h.shape[0] > HalfLinear.native_bf16_rows:
            hb = h.to(torch.bfloat16)
            act = self.silu_mul(gate.bf16_product(hb), up.bf16_product(hb), True)
            return down.bf16_product(act).to(x.dtype).view(x.shape)
        g, u = gate(h), up(h)
        if g.dtype == u.dtype and g.dtype in (torch.float32, torch.bfloat16):
            act = self.silu_mul(g, u, g.dtype == torch.bfloat16)
        else:
            act = F.silu(g) * u
        return down(act).view(x.shape)


def _bf16_gemm(layer: nn.Module) -> bool:
    """A HalfLinear whose many-row product is torch's bf16 GEMM, bf16 in and out."""
    return type(layer) is HalfLinear and layer.takes_bf16


@functools.cache
def _direct(cls: type) -> type:
    """`cls` whose call is its forward, without nn.Module's hook dispatch."""
    return type(cls.__name__, (cls,), {"__call__": cls.forward, "__module__": cls.__module__})


def call_directly(model: nn.Module) -> None:
    """Make the engine's private copy cheap to call. Decoding one token calls ~10 modules per
    layer; nn.Module's __call__ (hook dispatch) and its __getattr__ (submodules and weights live
    in dicts it searches) cost about a microsecond each, several percent of a small model's step.
    So every module below the root becomes an instance of a subclass whose __call__ is its
    forward, and its submodules and parameters are also plain instance attributes. Left as they
    are: modules with hooks now (someone is watching them), modules whose forward was replaced on
    the instance (e.g. activation checkpointing's wrapper), and the token embedding (the engine
    hooks it for prompt embeddings)."""
    embed = getattr(model, "embed", None)
    for name, module in model.named_modules():
        hooked = module._forward_hooks or module._forward_pre_hooks
        own = "forward" in module.__dict__
        if not name or hooked or own or module is embed or isinstance(module, nn.Embedding):
            continue
        module.__class__ = _direct(type(module))
        module.__dict__.update(module._modules)
        module.__dict__.update(module._parameters)


def weight_bytes(model: nn.Module) -> int:
    """Bytes of the weights as stored (state_dict, shared tensors once; int8 counts 1 byte)."""
    tensors = {t.data_ptr(): t for t in model.state_dict().values()}
    return sum(t.numel() * t.element_size() for t in tensors.values())


def decode_bytes(model: nn.Module) -> int:
    """Weight bytes one decoding step reads: everything but the token and position embedding
    tables, of which a token reads one row (a token table the LM head shares still counts)."""
    tables = [m.weight for m in model.modules() if isinstance(m, (nn.Embedding, LearnedPositions))]
    head = getattr(model, "lm_head", None)
    shared = getattr(getattr(head, "weight", None), "data_ptr", lambda: None)()
    skip = sum(t.numel() * t.element_size() for t in tables if t.data_ptr() != shared)
    return weight_bytes(model) - skip
