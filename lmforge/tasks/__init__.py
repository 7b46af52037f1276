"""Built-in tasks and answer checking, below training and evaluation alike:

- ``synthetic``: seeded arithmetic and string tasks with a hash-based train/validation/test
  split (SFT records, RL prompts, verifier-labelled preference pairs), so post-training needs no
  downloads;
- ``answers``: answer extraction, the one answer normaliser / exact match, and ``verify`` (the
  verifier reward);
- ``gsm8k``: the GSM8K loader; ``hh``: the Anthropic HH-RLHF preference parser.
"""
