"""Hugging Face model families: config mapping and weight renaming, one small class per family.

A family knows three things: how an HF `config.json` maps to a ModelConfig (and back), and
`key_map`: for every tensor of *our* model, which HF tensors it comes from and how (copy,
concatenate q/k/v into our fused qkv_proj, transpose GPT-2's Conv1D). The same table drives
loading and exporting, so the two directions cannot drift apart. Features a family cannot express
are reported by `export_problems` in words, never silently dropped.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from lmforge.errors import ConfigError
from lmforge.interop.rope import rope_from_hf, rope_to_hf
from lmforge.model.config import ModelConfig


@dataclass(frozen=True)
class Rule:
    """Our tensor = transform(HF tensors). "cat": ours is the HF tensors stacked along dim 0
    (`sizes` split it back on export); "slice": ours is piece `index` of one fused HF tensor cut
    into `sizes`; "transpose": GPT-2's Conv1D stores [in, out]; "plus_one": Gemma's norms
    store gamma - 1 (they scale by 1 + weight)."""

    hf_keys: tuple[str, ...]
    transform: str = "copy"  # "copy" | "cat" | "slice" | "transpose" | "plus_one"
    sizes: tuple[int, ...] = ()
    index: int = 0


def _linear(m: dict, ours: str, hf: str, bias: bool, transform: str = "copy") -> None:
    m[f"{ours}.weight"] = Rule((f"{hf}.weight",), transform)
    if bias:
        m[f"{ours}.bias"] = Rule((f"{hf}.bias",))


ANY = None  # in a family's `needs`: a field it writes whatever its value
# What no family's config.json can say, at the value each family's code assumes: every family
# starts from these, so a model using one (an MLA or windowed-pattern attention, a parallel or
# sandwich block, scaled embeddings or logits, soft-capping) is refused, not exported without it.
PLAIN_BLOCK: dict[str, tuple] = {
    "attention": ("softmax",), "attention_pattern": (None,), "norm_position": ("pre",),
    "parallel_block": (False,), "logit_scaling": (False,), "embed_scale": (False,),
    "attn_logit_softcap": (None,), "final_logit_softcap": (None,), "attn_scale": (None,),
    "rope_local_base": (None,),
}  # fmt: skip


class Family:
    """Base class: subclasses set the names, define config_from_hf(hf dict) -> ModelConfig
    fields, config_to_hf(config) -> hf dict and key_map(config) -> {our tensor: Rule}, and
    override the parts that differ."""

    model_type = ""
    architecture = ""
    ignored_suffixes: tuple[str, ...] = ("rotary_emb.inv_freq",)  # buffers some old files kept
    # parts of our model that transformers does not hold as nn.Linear modules, so a LoRA on them
    # has no Hugging Face PEFT name (e.g. Mixtral's experts are fused 3-D parameters there)
    no_lora_modules: tuple[str, ...] = ()
    # ModelConfig field -> the values this family can write (fields not listed: any value)
    needs: dict[str, tuple | None] = {}

    def export_problems(self, config: ModelConfig) -> list[str]:
        """Why `config` cannot be written as this family (empty list: it can)."""
        return unmet_needs(self.needs, config)

    def normalize_keys(self, keys: list[str]) -> dict[str, str]:
        """Map the file's tensor names to canonical ones (identity unless a family has aliases)."""
        return {k: k for k in keys}


# HF hidden_act of a gated MLP -> our MLP kind, and back.
_GLU_ACTS = {"silu": "swiglu", "swish": "swiglu", "gelu": "geglu", "gelu_new": "geglu_tanh",
             "gelu_pytorch_tanh": "geglu_tanh"}  # fmt: skip
_GLU_ACTS_BACK = {"swiglu": "silu", "geglu": "gelu", "geglu_tanh": "gelu_pytorch_tanh",
                  "moe": "silu"}  # fmt: skip


# Llama-family shape fields: our ModelConfig name -> HF config.json name (both directions).
_LLAMA_SHAPE = {"vocab_size": "vocab_size", "n_layer": "num_hidden_layers",
                "n_head": "num_attention_heads", "d_model": "hidden_size",
                "d_ff": "intermediate_size"}  # fmt: skip


class Llama(Family):
    """Llama and its close relatives: RMSNorm, RoPE (rotate-half), SwiGLU, optional biases."""

    model_type, architecture = "llama", "LlamaForCausalLM"
    needs = {**PLAIN_BLOCK, "pos": ("rope",), "norm": ("rmsnorm",), "bias": (False,),
             "mlp": ("swiglu", "geglu", "geglu_tanh"), "qk_norm": (False,),
             "sliding_window": (None,), "lm_head_bias": (False,)}  # fmt: skip
    one_attention_bias = True  # config.json's attention_bias covers q/k/v and o_proj alike

    def config_from_hf(self, hf: dict[str, Any]) -> dict[str, Any]:
        n_head = hf["num_attention_heads"]
        act = hf.get("hidden_act", "silu")
        if (mlp := _GLU_ACTS.get(act)) is None:
            raise ConfigError(
                f"hidden_act {act!r} is not supported (supported: {', '.join(_GLU_ACTS)})"
            )
        rope_base, rope_scaling, max_len = rope_from_hf(hf)
        attention_bias = bool(hf.get("attention_bias", False))
        return dict(
            {ours: hf[key] for ours, key in _LLAMA_SHAPE.items()},
            n_kv_head=hf.get("num_key_value_heads") or n_head,
            head_dim=hf.get("head_dim") or hf["hidden_size"] // n_head,
            max_seq_len=max_len,
            norm="rmsnorm",
            norm_eps=hf.get("rms_norm_eps", 1e-6),
            pos="rope",
            rope_base=rope_base,
            rope_scaling=rope_scaling,
            mlp=mlp,
            bias=False,
            attention_bias=attention_bias,
            attention_out_bias=attention_bias,
            mlp_bias=bool(hf.get("mlp_bias", False)),
            tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        )

    def config_to_hf(self, config: ModelConfig) -> dict[str, Any]:
        hf = dict(
            {key: getattr(config, ours) for ours, key in _LLAMA_SHAPE.items()},
            num_key_value_heads=config.n_kv_head,
            head_dim=config.head_dim,
            rms_norm_eps=config.norm_eps,
            hidden_act=_GLU_ACTS_BACK[config.mlp],
            attention_bias=config.attention_bias,
            mlp_bias=config.mlp_bias,
            tie_word_embeddings=config.tie_embeddings,
        )
        return {**hf, **rope_to_hf(config)}

    def export_problems(self, config: ModelConfig) -> list[str]:
        problems = super().export_problems(config)
        if self.one_attention_bias and config.attention_bias != config.attention_out_bias:
            problems.append("q/k/v and o_proj biases differ (config.json has one attention_bias)")
        return problems

    def key_map(self, config: ModelConfig) -> dict[str, Rule]:
        m = {
            "embed.weight": Rule(("model.embed_tokens.weight",)),
            "norm.weight": Rule(("model.norm.weight",)),
        }
        if not config.tie_embeddings:
            m["lm_head.weight"] = Rule(("lm_head.weight",))
        q, kv = config.n_head * config.head_dim, config.n_kv_head * config.head_dim
        for i in range(config.n_layer):
            ours, hf = f"blocks.{i}", f"model.layers.{i}"
            m[f"{ours}.attn_norm.weight"] = Rule((f"{hf}.input_layernorm.weight",))
            m[f"{ours}.mlp_norm.weight"] = Rule((f"{hf}.post_attention_layernorm.weight",))
            for kind in ("weight", "bias") if config.attention_bias else ("weight",):
                parts = tuple(f"{hf}.self_attn.{x}_proj.{kind}" for x in "qkv")
                m[f"{ours}.attn.qkv_proj.{kind}"] = Rule(parts, "cat", (q, kv, kv))
            _linear(m, f"{ours}.attn.o_proj", f"{hf}.self_attn.o_proj", config.attention_out_bias)
            for x in "qk" if config.qk_norm else "":  # Qwen3, Gemma 3: per-head q/k RMSNorm
                m[f"{ours}.attn.{x}_norm.weight"] = Rule((f"{hf}.self_attn.{x}_norm.weight",))
            self.mlp_keys(m, config, f"{ours}.mlp", f"{hf}.mlp")
        return m

    def mlp_keys(self, m: dict, config: ModelConfig, ours: str, hf: str) -> None:
        for name in ("gate_proj", "up_proj", "down_proj"):
            _linear(m, f"{ours}.{name}", f"{hf}.{name}", config.mlp_bias)


class Mistral(Llama):
    """Llama plus a sliding attention window; no biases."""

    model_type, architecture = "mistral", "MistralForCausalLM"
    needs = {**Llama.needs, "sliding_window": ANY, "attention_bias": (False,), "mlp_bias": (False,)}

    def config_from_hf(self, hf: dict[str, Any]) -> dict[str, Any]:
        return {**super().config_from_hf(hf), "sliding_window": hf.get("sliding_window")}

    def config_to_hf(self, config: ModelConfig) -> dict[str, Any]:
        hf = super().config_to_hf(config)
        del hf["attention_bias"], hf["mlp_bias"]
        return {**hf, "sliding_window": config.sliding_window}


class Qwen2(Llama):
    """Llama with q/k/v biases (o_proj and MLP without); sliding window on all layers or none."""

    model_type, architecture = "qwen2", "Qwen2ForCausalLM"
    needs = {**Llama.needs, "sliding_window": ANY, "attention_bias": (True,),
             "attention_out_bias": (False,), "mlp_bias": (False,)}  # fmt: skip
    one_attention_bias = False

    def config_from_hf(self, hf: dict[str, Any]) -> dict[str, Any]:
        data = super().config_from_hf(hf)
        data.update(attention_bias=True, attention_out_bias=False, mlp_bias=False)
        return {**data, "sliding_window": _uniform_window(hf)}

    def config_to_hf(self, config: ModelConfig) -> dict[str, Any]:
        hf = super().config_to_hf(config)
        del hf["attention_bias"], hf["mlp_bias"]
        window = config.sliding_window
        hf.update(use_sliding_window=window is not None, sliding_window=window, max_window_layers=0)
        kind = "sliding_attention" if window is not None else "full_attention"
        return {**hf, "layer_types": [kind] * config.n_layer}


def _uniform_window(hf: dict[str, Any]) -> int | None:
    """Qwen2's per-layer window as one value; a mix of windowed and full layers is rejected."""
    if (types := hf.get("layer_types")) is None:
        n = hf["num_hidden_layers"]
        first = hf.get("max_window_layers", n) if hf.get("use_sliding_window", False) else n
        types = ["full_attention" if i < first else "sliding_attention" for i in range(n)]
    kinds = set(types)
    if kinds == {"full_attention"}:
        return None
    if kinds == {"sliding_attention"}:
        return hf["sliding_window"]
    raise ConfigError(
        "layers mixing sliding-window and full attention (layer_types / max_window_layers) "
        "are not supported"
    )


class Mixtral(Mistral):
    """Mistral with a sparse MoE feed-forward layer: softmax router, top-k, renormalised."""

    model_type, architecture = "mixtral", "MixtralForCausalLM"
    no_lora_modules = (".experts.", ".router")
    needs = {**Mistral.needs, "mlp": ("moe",)}

    def config_from_hf(self, hf: dict[str, Any]) -> dict[str, Any]:
        data = super().config_from_hf(hf)
        if data["mlp"] != "swiglu":
            raise ConfigError(f"mixtral: hidden_act {hf.get('hidden_act')!r} (supported: silu)")
        n_experts, top_k = hf["num_local_experts"], hf["num_experts_per_tok"]
        return {**data, "mlp": "moe", "n_experts": n_experts, "experts_top_k": top_k}

    def config_to_hf(self, config: ModelConfig) -> dict[str, Any]:
        hf = super().config_to_hf(config)
        hf.update(num_local_experts=config.n_experts, num_experts_per_tok=config.experts_top_k)
        return hf

    def mlp_keys(self, m: dict, config: ModelConfig, ours: str, hf: str) -> None:
        hf = hf.replace(".mlp", ".block_sparse_moe")
        m[f"{ours}.router.weight"] = Rule((f"{hf}.gate.weight",))
        for e in range(config.n_experts):
            for our_name, w in (("gate_proj", "w1"), ("down_proj", "w2"), ("up_proj", "w3")):
                m[f"{ours}.experts.{e}.{our_name}.weight"] = Rule((f"{hf}.experts.{e}.{w}.weight",))


# GPT-2 activation names -> our MLP kinds and back.
_GPT2_ACTS = {"gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu": "gelu",
              "relu": "relu", "silu": "silu", "swish": "silu"}  # fmt: skip
_GPT2_ACTS_BACK = {"gelu_tanh": "gelu_new", "gelu": "gelu", "relu": "relu", "silu": "silu"}


class GPT2(Family):
    """GPT-2: learned positions, LayerNorm, fused c_attn, Conv1D weights stored [in, out]."""

    model_type, architecture = "gpt2", "GPT2LMHeadModel"
    ignored_suffixes = (".attn.bias", ".attn.masked_bias")  # causal-mask buffers in old files
    needs = {**PLAIN_BLOCK, "pos": ("learned",), "norm": ("layernorm",),
             "mlp": tuple(_GPT2_ACTS_BACK), "sliding_window": (None,), "lm_head_bias": (False,),
             "bias": (True,), "attention_bias": (True,), "attention_out_bias": (True,),
             "mlp_bias": (True,)}  # fmt: skip

    def config_from_hf(self, hf: dict[str, Any]) -> dict[str, Any]:
        act = hf.get("activation_function", "gelu_new")
        if act not in _GPT2_ACTS:
            raise ConfigError(f"activation_function {act!r} is not supported")
        for key, ok in (("scale_attn_by_inverse_layer_idx", False), ("add_cross_attention", False),
                        ("scale_attn_weights", True)):  # fmt: skip
            if bool(hf.get(key, ok)) != ok:
                raise ConfigError(f"{key}={hf[key]!r} is not supported")
        d = hf["n_embd"]
        return dict(
            vocab_size=hf["vocab_size"], n_layer=hf["n_layer"], n_head=hf["n_head"], d_model=d,
            d_ff=hf.get("n_inner") or 4 * d, max_seq_len=hf["n_positions"], norm="layernorm",
            norm_eps=hf.get("layer_norm_epsilon", 1e-5), pos="learned", mlp=_GPT2_ACTS[act],
            bias=True, tie_embeddings=bool(hf.get("tie_word_embeddings", True)),
        )  # fmt: skip

    def config_to_hf(self, config: ModelConfig) -> dict[str, Any]:
        return dict(
            vocab_size=config.vocab_size, n_layer=config.n_layer, n_head=config.n_head,
            n_embd=config.d_model, n_inner=config.d_ff, n_positions=config.max_seq_len,
            layer_norm_epsilon=config.norm_eps, activation_function=_GPT2_ACTS_BACK[config.mlp],
            tie_word_embeddings=config.tie_embeddings, scale_attn_weights=True,
        )  # fmt: skip

    def export_problems(self, config: ModelConfig) -> list[str]:
        problems = super().export_problems(config)
        if config.n_kv_head != config.n_head or config.head_dim * config.n_head != config.d_model:
            problems.append("needs MHA with head_dim = d_model / n_head")
        return problems

    def normalize_keys(self, keys: list[str]) -> dict[str, str]:
        """The original OpenAI files name tensors without the `transformer.` prefix."""
        return {
            (k if k.startswith(("transformer.", "lm_head.")) else f"transformer.{k}"): k
            for k in keys
        }

    def key_map(self, config: ModelConfig) -> dict[str, Rule]:
        m = {"embed.weight": Rule(("transformer.wte.weight",)),
             "abs_pos.weight": Rule(("transformer.wpe.weight",))}  # fmt: skip
        _linear(m, "norm", "transformer.ln_f", True)
        if not config.tie_embeddings:
            m["lm_head.weight"] = Rule(("lm_head.weight",))
        for i in range(config.n_layer):
            ours, hf = f"blocks.{i}", f"transformer.h.{i}"
            _linear(m, f"{ours}.attn_norm", f"{hf}.ln_1", True)
            _linear(m, f"{ours}.mlp_norm", f"{hf}.ln_2", True)
            _linear(m, f"{ours}.attn.qkv_proj", f"{hf}.attn.c_attn", True, "transpose")
            _linear(m, f"{ours}.attn.o_proj", f"{hf}.attn.c_proj", True, "transpose")
            _linear(m, f"{ours}.mlp.up_proj", f"{hf}.mlp.c_fc", True, "transpose")
            _linear(m, f"{ours}.mlp.down_proj", f"{hf}.mlp.c_proj", True, "transpose")
        return m


class Qwen3(Qwen2):
    """Qwen2 with a per-head RMSNorm on q and k, explicit head_dim and one attention_bias flag."""

    model_type, architecture = "qwen3", "Qwen3ForCausalLM"
    needs = {**Llama.needs, "qk_norm": (True,), "sliding_window": ANY, "mlp_bias": (False,)}
    one_attention_bias = True

    def config_from_hf(self, hf: dict[str, Any]) -> dict[str, Any]:
        data = Llama.config_from_hf(self, hf)
        return {**data, "qk_norm": True, "sliding_window": _uniform_window(hf)}

    def config_to_hf(self, config: ModelConfig) -> dict[str, Any]:
        return {**super().config_to_hf(config), "attention_bias": config.attention_bias}


class Phi3(Mistral):
    """Llama with fused weights: qkv_proj (our layout already) and gate_up_proj (gate first)."""

    model_type, architecture = "phi3", "Phi3ForCausalLM"
    needs = {**Mistral.needs, "rope_interleaved": (False,)}  # its fused qkv is copied as it is

    def key_map(self, config: ModelConfig) -> dict[str, Rule]:
        m = super().key_map(config)
        for i in range(config.n_layer):
            hf = f"model.layers.{i}.self_attn.qkv_proj.weight"
            m[f"blocks.{i}.attn.qkv_proj.weight"] = Rule((hf,))
        return m

    def mlp_keys(self, m: dict, config: ModelConfig, ours: str, hf: str) -> None:
        fused, sizes = (f"{hf}.gate_up_proj.weight",), (config.d_ff, config.d_ff)
        m[f"{ours}.gate_proj.weight"] = Rule(fused, "slice", sizes, 0)
        m[f"{ours}.up_proj.weight"] = Rule(fused, "slice", sizes, 1)
        m[f"{ours}.down_proj.weight"] = Rule((f"{hf}.down_proj.weight",))


# what Gemma 2 / 3 add (soft caps, a query scale, a local RoPE base) and Gemma 1 lacks
class Gemma(Llama):
    """Gemma: Llama with GeGLU (tanh), embeddings scaled by sqrt(d_model), tied head, head_dim
    apart from d_model / n_head, and RMSNorms that scale by 1 + weight (stored as weight - 1)."""

    model_type, architecture = "gemma", "GemmaForCausalLM"
    needs = {**Llama.needs, "mlp": ("geglu_tanh",), "embed_scale": (True,)}

    def config_from_hf(self, hf: dict[str, Any]) -> dict[str, Any]:
        act = hf.get("hidden_activation") or "gelu_pytorch_tanh"  # Gemma 1 files say "gelu"
        data = super().config_from_hf({**hf, "hidden_act": act})
        tied = bool(hf.get("tie_word_embeddings", True))
        return {**data, "embed_scale": True, "tie_embeddings": tied}

    def config_to_hf(self, config: ModelConfig) -> dict[str, Any]:
        hf = super().config_to_hf(config)
        hf["hidden_activation"] = hf.pop("hidden_act")
        return hf

    def key_map(self, config: ModelConfig) -> dict[str, Rule]:
        m = super().key_map(config)
        for key, rule in m.items():  # every norm (q/k norms too) stores weight - 1
            if "norm" in key:
                m[key] = Rule(rule.hf_keys, "plus_one")
        return m


# Gemma 2's norms after each branch (sandwich) and before the MLP: ours -> HF's
_SANDWICH_NORMS = {"mlp_norm": "pre_feedforward_layernorm",
                   "attn_post_norm": "post_attention_layernorm",
                   "mlp_post_norm": "post_feedforward_layernorm"}  # fmt: skip


class Gemma2(Gemma):
    """Gemma 2: Gemma plus a norm after each branch (sandwich), soft-capped attention scores and
    logits, query scale query_pre_attn_scalar^-1/2, and a sliding window on alternate layers."""

    model_type, architecture = "gemma2", "Gemma2ForCausalLM"
    needs = {**Gemma.needs, "sliding_window": ANY, "norm_position": ("sandwich",),
             "attn_logit_softcap": ANY, "final_logit_softcap": ANY, "attn_scale": ANY}  # fmt: skip
    window_every = 2  # without layer_types: every second layer sees every key

    def config_from_hf(self, hf: dict[str, Any]) -> dict[str, Any]:
        data = super().config_from_hf(hf)
        # per-layer attention kinds: `layer_types`, else every `window_every`-th layer full
        n, every = hf["num_hidden_layers"], hf.get("sliding_window_pattern") or self.window_every
        default = [
            "full_attention" if (i + 1) % every == 0 else "sliding_attention" for i in range(n)
        ]
        types = hf.get("layer_types") or default
        full = [i for i, kind in enumerate(types) if kind == "full_attention"]
        window = hf.get("sliding_window")
        if window is None or len(full) == len(types):
            full, window = None, None
        scalar = hf.get("query_pre_attn_scalar")
        return {
            **data, "norm_position": "sandwich", "sliding_window": window,
            "full_attention_layers": full,
            "attn_logit_softcap": hf.get("attn_logit_softcapping"),
            "final_logit_softcap": hf.get("final_logit_softcapping"),
            "attn_scale": None if scalar in (None, data["head_dim"]) else float(scalar) ** -0.5,
        }  # fmt: skip

    def config_to_hf(self, config: ModelConfig) -> dict[str, Any]:
        hf = super().config_to_hf(config)
        full = set(config.full_attention_layers or range(config.n_layer))
        scale = config.attn_scale
        hf.update(
            sliding_window=config.sliding_window,
            layer_types=["full_attention" if i in full else "sliding_attention"
                         for i in range(config.n_layer)],
            attn_logit_softcapping=config.attn_logit_softcap,
            final_logit_softcapping=config.final_logit_softcap,
            query_pre_attn_scalar=config.head_dim if scale is None else round(scale**-2),
        )  # fmt: skip
        return hf

    def key_map(self, config: ModelConfig) -> dict[str, Rule]:
        m = super().key_map(config)
        for i in range(config.n_layer):
            ours, hf = f"blocks.{i}", f"model.layers.{i}"
            for our_norm, hf_norm in _SANDWICH_NORMS.items():
                m[f"{ours}.{our_norm}.weight"] = Rule((f"{hf}.{hf_norm}.weight",), "plus_one")
        return m


class Gemma3(Gemma2):
    """Gemma 3 (text): Gemma 2 with QK-norm instead of the attention soft cap, a window on five
    layers of six, and its own RoPE base on the windowed layers (the full ones may be scaled)."""

    model_type, architecture = "gemma3_text", "Gemma3ForCausalLM"
    needs = {**Gemma2.needs, "qk_norm": (True,), "rope_local_base": ANY}
    window_every = 6

    def config_from_hf(self, hf: dict[str, Any]) -> dict[str, Any]:
        params = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
        local_theta = hf.get("rope_local_base_freq", 10000.0)
        if "full_attention" in params:  # transformers 5: one RoPE setting per layer kind
            local_theta = params.get("sliding_attention", {}).get("rope_theta", local_theta)
            hf = {**hf, "rope_parameters": params["full_attention"], "rope_scaling": None}
        data = super().config_from_hf(hf)
        local = float(local_theta) if data["sliding_window"] is not None else None
        return {**data, "qk_norm": True, "rope_local_base": local}

    def config_to_hf(self, config: ModelConfig) -> dict[str, Any]:
        hf = super().config_to_hf(config)
        return {**hf, "rope_local_base_freq": config.rope_local_base or config.rope_base}


def unmet_needs(needs: dict[str, tuple | None], config: ModelConfig) -> list[str]:
    """`config`'s fields whose value is not among those `needs` allows, each in words."""
    return [
        f"{field}={getattr(config, field)!r} (needs {' or '.join(map(repr, allowed))})"
        for field, allowed in needs.items()
        if allowed is not ANY and getattr(config, field) not in allowed
    ]


# in export preference order (hf.choose_family tries them in turn)
FAMILIES: dict[str, Family] = {
    f.model_type: f
    for f in (
        Llama(),
        Mistral(),
        Qwen2(),
        Qwen3(),
        Mixtral(),
        GPT2(),
        Phi3(),
        Gemma(),
        Gemma2(),
        Gemma3(),
    )  # fmt: skip
}
