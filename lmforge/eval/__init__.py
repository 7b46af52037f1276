"""Evaluation: perplexity, exact-match tasks (GSM8K; answer extraction and the GSM8K loader
live in lmforge.tasks), multiple choice, hallucination and sycophancy rates, ICL/CoT prompt
builders, and results reports. The lm-evaluation-harness adapter lives in
lmforge.eval.lm_eval_adapter (import it to register the "lmforge" model)."""

from lmforge.eval.hallucination import (
    ContainsAnswer,
    DecodingSetting,
    decoding_grid,
    hallucination_rate,
    sweep,
)
from lmforge.eval.multiple_choice import evaluate_choices, load_choices
from lmforge.eval.perplexity import PerplexityResult, perplexity
from lmforge.eval.prompts import (
    COT_TRIGGER,
    FIXTURES,
    PROMPT_STYLES,
    CoTPrompt,
    Example,
    ICLPrompt,
    Template,
    build_prompt,
)
from lmforge.eval.report import Report, ResultRow
from lmforge.eval.scoring import generate_texts, loglikelihood, rolling_loglikelihood
from lmforge.eval.sycophancy import FALSE_STATEMENTS, classify_reply, evaluate_sycophancy
from lmforge.eval.tasks import TaskResult, evaluate_gsm8k

__all__ = [
    "COT_TRIGGER",
    "FALSE_STATEMENTS",
    "FIXTURES",
    "PROMPT_STYLES",
    "ContainsAnswer",
    "CoTPrompt",
    "DecodingSetting",
    "Example",
    "ICLPrompt",
    "PerplexityResult",
    "Report",
    "ResultRow",
    "TaskResult",
    "Template",
    "build_prompt",
    "classify_reply",
    "decoding_grid",
    "evaluate_choices",
    "evaluate_gsm8k",
    "evaluate_sycophancy",
    "generate_texts",
    "hallucination_rate",
    "load_choices",
    "loglikelihood",
    "perplexity",
    "rolling_loglikelihood",
    "sweep",
]
