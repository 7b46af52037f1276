"""Load Hugging Face model directories into our Transformer and export ours back.

Loading reads `config.json` (the family is chosen by `model_type`), one `model.safetensors` or
the shards named by `model.safetensors.index.json`, converts every tensor through the family's
key map and checks its shape, and only then materialises the model: a bad file raises one
CheckpointError/ConfigError and never leaves a half-loaded model behind. Exporting writes
config.json, safetensors (sharded past `max_shard_bytes`), generation_config.json and the
tokenizer, which `transformers.AutoModelForCausalLM/AutoTokenizer.from_pretrained` read unchanged.
transformers itself is never imported: safetensors and our code do the work.

`save_lm` is what `LM.save` (and so every trainer's output folder) goes through: a model that came
from a transformers family (imported from an HF folder or a GGUF file, which records the family in
`config.extra["hf_model_type"]`) is written in that family's layout, so `from_pretrained` loads the
folder as written; a model born in lmforge keeps lmforge's own format (`lmforge convert --to-hf`
exports it when its config maps onto a family).
"""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import torch

from lmforge.errors import CheckpointError, ConfigError, LMForgeError, require_choice
from lmforge.fileio import check_state, read_json, save_tensors, write_json
from lmforge.interop.families import FAMILIES, Family, Rule
from lmforge.model.config import ModelConfig
from lmforge.model.io import INDEX_FILE, build_model, read_tensors, save_model, weight_files
from lmforge.model.transformer import Transformer


def hf_config_to_ours(hf: dict[str, Any], source: str = "config.json") -> ModelConfig:
    """The ModelConfig for an HF config dict; the original is kept in extra["hf_config"]."""
    if (family := FAMILIES.get(hf.get("model_type"))) is None:
        raise CheckpointError(
            f"{source}: model_type {hf.get('model_type')!r} is not supported; supported: "
            f"{', '.join(sorted(FAMILIES))} (and lmforge's own 'lmforge')"
        )
    try:
        data = family.config_from_hf(hf)
    except KeyError as err:
        raise ConfigError(f"{source}: missing field {err.args[0]!r}") from err
    except ConfigError as err:
        raise ConfigError(f"{source}: {err}") from err
    data["extra"] = {"hf_model_type": family.model_type, "hf_config": hf}
    return ModelConfig.from_dict(data, source=source)


# ---- reading weights ---------------------------------------------------------------------------
def to_ours(rule: Rule, tensors: list[torch.Tensor]) -> torch.Tensor:
    """Our tensor from the HF tensors a key-map rule names."""
    if rule.transform == "cat":
        return torch.cat(tensors, dim=0)
    if rule.transform == "slice":
        return tensors[0].split(list(rule.sizes), dim=0)[rule.index]
    if rule.transform == "transpose":
        return tensors[0].t().contiguous()
    if rule.transform == "plus_one":
        return tensors[0] + 1
    return tensors[0]


def _to_hf(rule: Rule, tensor: torch.Tensor) -> list[torch.Tensor]:
    if rule.transform == "cat":
        return list(tensor.split(list(rule.sizes), dim=0))
    if rule.transform == "transpose":
        return [tensor.t().contiguous()]
    if rule.transform == "plus_one":
        return [tensor - 1]
    return [tensor]


def hf_shapes(
    family: Family, config: ModelConfig, ours: dict[str, torch.Tensor], conv1d: bool = True
) -> dict[str, tuple[int, ...]]:
    """HF tensor name -> the shape the family's key map implies from our state dict `ours` (meta
    tensors will do). `conv1d`: GPT-2's Conv1D weights are stored [in, out] (GGUF: [out, in])."""
    shapes = {}
    for name, rule in family.key_map(config).items():
        shape = tuple(ours[name].shape)
        if rule.transform == "cat":
            shapes.update({key: (size, *shape[1:]) for key, size in zip(rule.hf_keys, rule.sizes)})
        elif rule.transform == "slice":
            shapes[rule.hf_keys[0]] = (sum(rule.sizes), *shape[1:])
        else:
            transposed = rule.transform == "transpose" and conv1d
            shapes[rule.hf_keys[0]] = shape[::-1] if transposed else shape
    return shapes


def convert_state(family: Family, config: ModelConfig, files: dict[str, Path], where: Path):
    """Our state dict from an HF checkpoint, every name and shape checked before returning."""
    with torch.device("meta"):
        expected = Transformer(config).state_dict()
    if config.tie_embeddings:
        expected.pop("lm_head.weight", None)
    key_map = family.key_map(config)
    if set(key_map) != set(expected):  # a converter bug, not a user error; say so plainly
        uncovered = sorted(set(expected) ^ set(key_map))[:5]
        raise LMForgeError(f"{family.model_type} converter does not cover {uncovered}")
    canonical = family.normalize_keys(list(files))
    shapes = hf_shapes(family, config, expected)
    raw = read_tensors(files, [canonical[k] for k in shapes if k in canonical])
    tied = {"lm_head.weight"} if config.tie_embeddings else set()
    allowed = {k for k in canonical if k.endswith(family.ignored_suffixes)} | tied
    found = {k: raw.get(canonical[k], ()) for k in canonical}  # () for a tensor not read
    check_state(where, found, shapes, "config.json", allowed)
    return {
        ours: to_ours(rule, [raw[canonical[k]] for k in rule.hf_keys])
        for ours, rule in key_map.items()
    }


def load_hf_model(
    directory: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype | None = None
) -> Transformer:
    """A Transformer holding the weights of an HF checkpoint directory (fp32 unless `dtype`)."""
    directory = Path(directory)
    hf = read_json(directory / "config.json", "model config")
    config = hf_config_to_ours(hf, str(directory / "config.json"))
    family = FAMILIES[config.extra["hf_model_type"]]
    state = convert_state(family, config, weight_files(directory), directory)
    return build_model(config, state, device, dtype or torch.float32)


def read_generation_config(directory: str | Path) -> dict[str, Any] | None:
    path = Path(directory) / "generation_config.json"
    return read_json(path, "generation config") if path.is_file() else None


# ---- exporting ---------------------------------------------------------------------------------
def choose_family(config: ModelConfig) -> Family:
    """The family a config exports as: the one it came from, else the first that fits (FAMILIES
    lists the preferred first)."""
    if (family := origin_family(config)) is not None:
        return family
    problems = {model_type: f.export_problems(config) for model_type, f in FAMILIES.items()}
    if fits := [model_type for model_type, p in problems.items() if not p]:
        return FAMILIES[fits[0]]
    detail = " | ".join(f"{t}: {'; '.join(p)}" for t, p in problems.items())
    raise ConfigError(f"this model cannot be written as a Hugging Face checkpoint ({detail})")


def _unpermute_interleaved(rows: torch.Tensor, head_dim: int) -> torch.Tensor:
    """Reorder each head's rows from interleaved RoPE pairs (0,1),(2,3).. to rotate-half
    pairs (0, d/2),(1, d/2+1).., so HF's rotate_half computes what our interleaved RoPE did."""
    order = torch.cat([torch.arange(0, head_dim, 2), torch.arange(1, head_dim, 2)])
    return rows.unflatten(0, (-1, head_dim))[:, order].flatten(0, 1)


def export_state(family: Family, model: Transformer) -> dict[str, torch.Tensor]:
    """HF-named tensors for `model`; ConfigError if it holds tensors the family has no place for
    (LoRA or adapter layers still wrapped in it), which would otherwise be dropped silently."""
    config = model.config
    state = model.state_dict()
    key_map = family.key_map(config)
    tied = {"lm_head.weight"} if config.tie_embeddings else set()
    if leftover := sorted(set(state) - set(key_map) - tied):
        raise ConfigError(
            f"cannot write this model as {family.model_type}: tensor(s) {', '.join(leftover[:3])} "
            "have no Hugging Face name (merge LoRA/adapter layers before saving)"
        )
    out, pieces = {}, {}
    for ours, rule in key_map.items():
        if rule.transform == "slice":  # one fused HF tensor from several of ours
            pieces.setdefault(rule.hf_keys[0], {})[rule.index] = state[ours].detach()
            continue
        parts = _to_hf(rule, state[ours].detach())
        if config.rope_interleaved and rule.transform == "cat":
            parts[:2] = [_unpermute_interleaved(p, config.head_dim) for p in parts[:2]]  # q, k
        for key, tensor in zip(rule.hf_keys, parts):
            out[key] = tensor.contiguous().cpu()
    for key, by_index in pieces.items():
        out[key] = torch.cat([by_index[i] for i in sorted(by_index)]).cpu()
    return out


def write_weights(directory: Path, state: dict[str, torch.Tensor], max_shard_bytes: int | None):
    """model.safetensors, or numbered shards plus the index transformers reads (split as
    huggingface_hub, which `datasets` brings, splits them for transformers' own saves)."""
    from huggingface_hub import split_torch_state_dict_into_shards

    split = split_torch_state_dict_into_shards(state, max_shard_size=max_shard_bytes or 2**62)
    for fname, names in split.filename_to_tensors.items():
        save_tensors(directory / fname, {n: state[n] for n in names}, metadata={"format": "pt"})
    if split.is_sharded:
        index = {"metadata": split.metadata, "weight_map": split.tensor_to_filename}
        write_json(directory / INDEX_FILE, index)
    else:  # an index left by an earlier sharded save would be read instead of the new file
        (directory / INDEX_FILE).unlink(missing_ok=True)


def export_hf(lm, directory: str | Path, max_shard_bytes: int | None = None) -> Path:
    """Write `lm` (model + tokenizer) as an HF checkpoint directory; returns the directory."""
    directory = Path(directory)
    model, tok = lm.model, lm.tokenizer
    require_dense(model, "export")
    config = model.config
    family = choose_family(config)
    state = export_state(family, model)
    preserved = dict(config.extra.get("hf_config") or {})
    if preserved.get("model_type") != family.model_type:
        preserved = {}
    hf = {**preserved, **family.config_to_hf(config)}
    hf.pop("rope_parameters", None)  # written in the legacy form by config_to_hf
    ids = {f"{r}_token_id": getattr(tok, f"{r}_id", None) for r in ("bos", "eos", "pad")}
    special = {k: v for k, v in ids.items() if v is not None}
    hf.update(special, model_type=family.model_type, architectures=[family.architecture])
    hf["torch_dtype"] = str(next(model.parameters()).dtype).removeprefix("torch.")
    write_weights(directory, state, max_shard_bytes)  # atomic writes make the folder
    write_json(directory / "config.json", hf)
    generation = {**(getattr(lm, "generation_config", None) or {}), **special}
    write_json(directory / "generation_config.json", generation)
    if tok is not None:
        tok.save(directory)
    return directory


SAVE_FORMATS = ("auto", "hf", "lmforge")


def origin_family(config: ModelConfig) -> Family | None:
    """The transformers family a model came from (recorded by the HF and GGUF importers in
    `config.extra["hf_model_type"]`) when the config still fits it; None for lmforge-born models."""
    family = FAMILIES.get(config.extra.get("hf_model_type"))
    return None if family is None or family.export_problems(config) else family


def require_dense(model: torch.nn.Module, action: str) -> None:
    """ConfigError when `model` holds inference-only layers (quantised, or a GGUF file loaded at
    its own precision), whose weights no checkpoint format here stores."""
    from lmforge.infer.quantized_linear import QuantizedEmbedding, QuantizedLinear

    found = [n for n, m in model.named_modules()
             if isinstance(m, (QuantizedLinear, QuantizedEmbedding))]  # fmt: skip
    if found:
        raise ConfigError(
            f"cannot {action} a model with quantised or as-stored inference layers ({found[0]}, "
            f"{len(found)} in all); load it with dtype='float32' (LM.load(path, "
            "dtype='float32'), --dtype float32) to get dense weights"
        )


def save_lm(lm, directory: str | Path, format: str = "auto") -> Path:
    """Write `lm` (model + tokenizer) to `directory`; what `LM.save` does.

    format="auto": the Hugging Face layout of the family the model came from (see
    `origin_family`), so transformers loads the folder as written, else lmforge's own format;
    "hf": the HF layout whatever the origin (ConfigError if no family fits); "lmforge": ours.
    Both layouts are read back by `LM.load`."""
    require_choice("save format", format, SAVE_FORMATS)
    require_dense(lm.model, "save")
    if format == "hf" or (format == "auto" and origin_family(lm.model.config) is not None):
        return export_hf(lm, directory)
    directory = Path(directory)
    save_model(lm.model, directory)  # atomic writes make the folder
    (directory / INDEX_FILE).unlink(missing_ok=True)  # a stale HF shard index would win on load
    if lm.tokenizer is not None:
        lm.tokenizer.save(directory)
    return directory


# ---- LoRA adapters under Hugging Face PEFT names -----------------------------------------------
LORA_A, LORA_B = ".lora_A.weight", ".lora_B.weight"


def _lora_family(config: ModelConfig) -> Family | None:
    """The family whose PEFT names a LoRA of this model is written under: its origin, unless
    its RoPE is interleaved (only lmforge-born models are), whose q/k rows HF orders otherwise."""
    return None if config.rope_interleaved else origin_family(config)


def _hf_lora_modules(family: Family, config: ModelConfig) -> dict[str, tuple[str, slice, int]]:
    """HF module name -> (our Linear module, the rows of it that the HF module holds, its row
    count) for every Linear HF PEFT can put a LoRA on: not a slice of a fused HF tensor (Phi-3's
    gate_up_proj) nor a module HF does not hold as nn.Linear (Mixtral's fused experts)."""
    key_map = family.key_map(config)
    with torch.device("meta"):
        model = Transformer(config)
    found = {}
    for module, layer in model.named_modules():
        if not isinstance(layer, torch.nn.Linear) or any(
            part in module for part in family.no_lora_modules
        ):
            continue
        rule = key_map.get(f"{module}.weight")
        if module == "lm_head":  # a tied lm_head is stored once as the embedding, HF keeps it
            rule = Rule(("lm_head.weight",))
        if rule is None or rule.transform == "slice":
            continue
        sizes = rule.sizes if rule.transform == "cat" else (layer.out_features,)
        for key, start, size in zip(rule.hf_keys, itertools.accumulate(sizes, initial=0), sizes):
            found[key.removesuffix(".weight")] = (module, slice(start, start + size), sum(sizes))
    return found


def lora_to_hf(
    config: ModelConfig, tensors: dict[str, torch.Tensor]
) -> tuple[dict[str, torch.Tensor], list[str], dict[str, Any]] | None:
    """Our LoRA tensors ("<module>.lora_A.weight" / ".lora_B.weight") under the names HF PEFT
    gives them on the transformers model this one came from: (tensors, target_modules, config
    fields to set), or None when the model has no HF origin (`origin_family`) or an adapted
    module has no HF nn.Linear. A fused qkv_proj becomes q_proj/k_proj/v_proj: its B matrix is
    split by output rows and the shared A copied to each, which gives each projection exactly
    the update the fused layer applied to its rows."""
    if (family := _lora_family(config)) is None:
        return None
    adapted = {k.removesuffix(LORA_A) for k in tensors if k.endswith(LORA_A)}
    every = _hf_lora_modules(family, config)
    names = {name: (ours, rows) for name, (ours, rows, _) in every.items() if ours in adapted}
    if {ours for ours, _ in names.values()} != adapted:  # a module HF has no nn.Linear for
        return None
    out: dict[str, torch.Tensor] = {}
    for name, (ours, rows) in names.items():
        out[name + LORA_A] = tensors[ours + LORA_A].clone()
        out[name + LORA_B] = tensors[ours + LORA_B][rows].contiguous()
    targets = set()
    for name in names:  # a short name when every layer's module of that name is adapted
        short = name.rsplit(".", 1)[-1]
        same = {m for m in every if m.rsplit(".", 1)[-1] == short}
        targets.add(short if same <= set(names) else name)
    extra = {"fan_in_fan_out": family.model_type == "gpt2"}  # GPT-2's Conv1D stores [in, out]
    return out, sorted(targets), extra


def lora_from_hf(
    config: ModelConfig, tensors: dict[str, torch.Tensor], where: str
) -> dict[str, torch.Tensor] | None:
    """The inverse of `lora_to_hf` for an adapter saved under HF module names: our LoRA tensors,
    or None when the names are not HF ones (an adapter in lmforge's own names). q/k/v LoRAs are
    fused back into qkv_proj, which has ONE A matrix: they must share it (as `lora_to_hf`
    writes them); a projection left out gets zero B rows. CheckpointError otherwise."""
    if (family := _lora_family(config)) is None:
        return None
    modules = {k.removesuffix(LORA_A) for k in tensors if k.endswith(LORA_A)}
    known = _hf_lora_modules(family, config)
    if not modules or not modules <= set(known):
        return None
    grouped: dict[str, list[str]] = {}
    for name in sorted(modules):
        grouped.setdefault(known[name][0], []).append(name)
    out = {}
    for ours, names in grouped.items():
        a = tensors[names[0] + LORA_A]
        b = a.new_zeros(known[names[0]][2], a.shape[0])  # rows of a projection left out: zero
        for name in names:
            if not torch.equal(tensors[name + LORA_A], a):
                raise CheckpointError(
                    f"{where}: {names[0]} and {name} have different LoRA A matrices; lmforge's "
                    f"fused {ours} shares one A (merge the adapter into the model instead)"
                )
            piece, rows = tensors[name + LORA_B], known[name][1]
            if piece.shape != (want := (rows.stop - rows.start, a.shape[0])):
                raise CheckpointError(
                    f"{where}: {name}{LORA_B} has shape {tuple(piece.shape)}, the model implies "
                    f"{want}"
                )
            b[rows] = piece
        out[ours + LORA_A], out[ours + LORA_B] = a, b
    return out
