"""`lmforge model-info`: parameters by component, FLOPs per token, KV-cache bytes per token."""

from __future__ import annotations


def register(sub) -> None:
    from lmforge.model.config import PRESETS

    p = sub.add_parser("model-info", help="parameter count, FLOPs/token and KV-cache size of a "
                       "preset or config", description="Give --preset, --config (YAML with "
                       "ModelConfig fields or a `model:` section) or --checkpoint; override "
                       "fields with --KEY value.")  # fmt: skip
    p.add_argument("--preset", choices=sorted(PRESETS))
    p.add_argument("--config", help="YAML file")
    p.add_argument("--checkpoint", help="checkpoint directory (config.json)")
    p.add_argument("--list", action="store_true", help="list presets with their sizes")
    p.set_defaults(func=run, accepts_overrides=True)


def run(args) -> int:
    from lmforge.fileio import load_yaml
    from lmforge.interop.checkpoint import load_config
    from lmforge.model.config import PRESETS, ModelConfig
    from lmforge.model.info import describe, parameter_counts
    from lmforge.train.config import parse_overrides

    if args.list:
        for name in PRESETS:
            total = parameter_counts(ModelConfig.from_preset(name))["total"]
            print(f"{name:<14}{total:>16,}")
        return 0
    overrides = parse_overrides(args.overrides)
    if args.checkpoint:
        config = load_config(args.checkpoint)
    elif args.config:
        data = load_yaml(args.config)
        fields = dict(data.get("model", data))
        if "preset" in data:
            config = ModelConfig.from_preset(data["preset"], **fields, **overrides)
        else:
            config = ModelConfig.from_dict({**fields, **overrides}, source=args.config)
    else:
        config = ModelConfig.from_preset(args.preset or "gpt2-micro", **overrides)
    print(describe(config))
    return 0
