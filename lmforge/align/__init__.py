"""Post-training: loss functions (``logprobs``, ``preference_losses``, ``rl_losses``),
regularisers, and the SFT / preference / RL trainers (registered in ``lmforge.cli.post_train``;
parameter-efficient fine-tuning lives in ``lmforge.peft``, the built-in tasks in
``lmforge.tasks``). Import from the module that defines a name: this package re-exports nothing,
so importing one module does not load them all."""
