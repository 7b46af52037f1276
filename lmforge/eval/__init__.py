"""Evaluation: perplexity, exact-match tasks (GSM8K; answer extraction and the GSM8K loader
live in lmforge.tasks), multiple choice, hallucination and sycophancy rates, ICL/CoT prompt
builders, and results reports. The lm-evaluation-harness adapter lives in
lmforge.eval.lm_eval_adapter (import it to register the "lmforge" model). Each name is
imported from its module."""
