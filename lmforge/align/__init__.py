"""Post-training: loss functions (``logprobs``, ``preference_losses``, ``rl_losses``),
regularisers, and the SFT / preference / RL trainers (parameter-efficient fine-tuning lives in
``lmforge.peft``, the built-in tasks in ``lmforge.tasks``)."""

from lmforge.align.logprobs import (
    masked_mean,
    masked_var,
    masked_whiten,
    sequence_logprobs,
    sft_loss,
    token_logprobs,
)
from lmforge.align.preference_losses import (
    bradley_terry_loss,
    dpo_loss,
    hinge_loss,
    listwise_loss,
    mse_gap_loss,
    plackett_luce_loss,
    preference_accuracy,
)
from lmforge.align.regularizers import (
    diagonal_fisher,
    distillation_loss,
    ewc_penalty,
    l2_to_reference,
)
from lmforge.align.rl_losses import (
    AdaptiveKLController,
    FixedKLController,
    clipped_surrogate,
    dones_from_mask,
    entropy_from_logits,
    gae,
    group_advantages,
    grpo_loss,
    kl_per_token,
    ppo_policy_loss,
    ppo_value_loss,
    shape_rewards,
)

__all__ = [
    "AdaptiveKLController",
    "FixedKLController",
    "bradley_terry_loss",
    "clipped_surrogate",
    "diagonal_fisher",
    "distillation_loss",
    "dones_from_mask",
    "dpo_loss",
    "entropy_from_logits",
    "ewc_penalty",
    "gae",
    "group_advantages",
    "grpo_loss",
    "hinge_loss",
    "kl_per_token",
    "l2_to_reference",
    "listwise_loss",
    "masked_mean",
    "masked_var",
    "masked_whiten",
    "mse_gap_loss",
    "plackett_luce_loss",
    "ppo_policy_loss",
    "ppo_value_loss",
    "preference_accuracy",
    "sequence_logprobs",
    "sft_loss",
    "shape_rewards",
    "token_logprobs",
]
