"""EleutherAI lm-evaluation-harness adapter: evaluate an lmforge checkpoint on harness tasks.

Importing this module registers the model type "lmforge" with the harness:

    lm_eval --model lmforge --model_args pretrained=out/run1 --tasks hellaswag
    # or, in Python:
    import lmforge.eval.lm_eval_adapter
    lm_eval.simple_evaluate(model="lmforge", model_args="pretrained=out/run1", tasks=[...])

The three request types map onto lmforge.eval.scoring: loglikelihood (multiple choice),
loglikelihood_rolling (perplexity tasks) and generate_until (free-form answers).
"""

from __future__ import annotations

import json

from lm_eval.api.model import LM as HarnessLM
from lm_eval.api.registry import register_model

from lmforge.eval.scoring import generate_texts, loglikelihood, rolling_loglikelihood


@register_model("lmforge")
class LMForgeHarnessModel(HarnessLM):
    """An lmforge LM (a checkpoint folder, or an LM object) behind the harness's LM interface."""

    def __init__(
        self,
        pretrained: str | None = None,
        lm=None,
        device: str = "cpu",
        batch_size: int | str = 16,
        max_gen_toks: int = 256,
        **_ignored,
    ):
        super().__init__()
        if lm is None:
            from lmforge.lm import LM

            if pretrained is None:
                raise ValueError("lmforge harness model needs pretrained=<checkpoint folder>")
            lm = LM.load(pretrained, device=device)
        self.lm = lm
        self.batch_size = int(batch_size) if str(batch_size).isdigit() else 16
        self.max_gen_toks = int(max_gen_toks)

    def loglikelihood(self, requests) -> list[tuple[float, bool]]:
        return loglikelihood(self.lm, [tuple(r.args) for r in requests], self.batch_size)

    def loglikelihood_rolling(self, requests) -> list[float]:
        return [rolling_loglikelihood(self.lm, r.args[0]) for r in requests]

    def generate_until(self, requests) -> list[str]:
        # Requests that share generation settings are decoded together, in batches.
        groups: dict[str, list[int]] = {}
        for i, r in enumerate(requests):
            groups.setdefault(json.dumps(r.args[1], sort_keys=True, default=str), []).append(i)
        out = [""] * len(requests)
        for key, idx in groups.items():
            kwargs = dict(json.loads(key))
            until = kwargs.pop("until", None) or []
            until = [until] if isinstance(until, str) else list(until)
            max_new = int(kwargs.pop("max_gen_toks", self.max_gen_toks))
            do_sample = bool(kwargs.pop("do_sample", False))
            temperature = float(kwargs.pop("temperature", 0.0)) if do_sample else 0.0
            top_p = kwargs.pop("top_p", None)
            top_p = float(top_p) if do_sample and top_p is not None else None
            prompts = [requests[i].args[0] for i in idx]
            sampling = dict(temperature=temperature, top_p=top_p)
            texts = generate_texts(self.lm, prompts, max_new, until, self.batch_size, **sampling)
            for i, text in zip(idx, texts):
                out[i] = text
        return out
