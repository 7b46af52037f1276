"""TRL is the oracle for the preference and reward losses (DPO, reward model, KTO, ORPO, CPO,
SimPO): loss and every parameter gradient agree to 1e-5 (see trl_oracle_common.py for how).

Where lmforge and TRL differ on purpose, the test says so: DPO ``sigmoid`` with label smoothing
ε > 0 is the soft-label (conservative) DPO (Mitchell 2023); TRL >= 1.0 ignores ε there, so that
form is checked against TRL's ``CPOTrainer.cpo_loss`` (the same expression, applied to the DPO
log-ratios) and against TRL's DPO ``robust`` for ε = 0.
"""

import warnings
from types import SimpleNamespace

import pytest
import torch
import trl
from datasets import Dataset
from torch import nn
from transformers import LlamaForSequenceClassification
from trl_oracle_common import (
    PAD,
    PAIRS,
    LMForgeView,
    assert_same,
    first_batch,
    llama_config,
    perturb,
    trl_args,
    trl_experimental,
)

from lmforge.align import dpo as lm_dpo
from lmforge.align.logprobs import sequence_logprobs, sft_loss
from lmforge.align.preference_losses import (
    bradley_terry_loss,
    cpo_loss,
    dpo_loss,
    kto_loss,
    orpo_loss,
)

pytestmark = pytest.mark.filterwarnings("ignore")


def test_trl_version_is_known():
    """The report cites this version; a major TRL bump must be re-checked, not silently passed."""
    assert trl.__version__.split(".")[0] == "1", trl.__version__


# ----------------------------------------------------------------------------- DPO


@pytest.mark.parametrize(
    "loss_type,label_smoothing", [("sigmoid", 0.0), ("robust", 0.2), ("hinge", 0.0), ("ipo", 0.0)]
)
def test_dpo_loss_types_match_trl(tok, policy_and_ref, loss_type, label_smoothing):
    """lmforge's DPOTrainer.pair_loss (completion log-probs, IPO lengths, dpo_loss) = TRL's
    DPOTrainer._compute_loss for every loss_type both have."""
    policy, ref = policy_and_ref
    args = trl_args(trl.DPOConfig, loss_type=[loss_type], beta=0.7,
                    label_smoothing=label_smoothing, per_device_train_batch_size=4,
                    precompute_ref_log_probs=False)  # fmt: skip
    trainer = trl.DPOTrainer(model=policy, ref_model=ref, args=args, processing_class=tok,
                             train_dataset=Dataset.from_dict(PAIRS))  # fmt: skip
    b = first_batch(trainer)
    ours_batch = {
        "input_ids": b["input_ids"],
        "labels": b["input_ids"].masked_fill(b["completion_mask"] == 0, -100),
    }
    with torch.no_grad():  # lmforge precomputes π_ref log-probs per pair: [N, 2]
        ours_batch["ref"] = (
            lm_dpo.completion_logprob_sums(LMForgeView(ref), ours_batch).view(2, -1).T
        )
    cfg = lm_dpo.DPOConfig(loss_type=loss_type, beta=0.7, label_smoothing=label_smoothing)
    ours = SimpleNamespace(lm=SimpleNamespace(model=LMForgeView(policy)), cfg=cfg)

    trainer.model.train()
    loss = assert_same(
        policy,
        lambda: trainer._compute_loss(trainer.model, b, False),
        lambda: lm_dpo.DPOTrainer.pair_loss(ours, ours_batch)[0],
    )
    if loss_type == "sigmoid":
        assert abs(loss.item() - 0.6931) > 1e-3  # policy ≠ ref: not the trivial ln 2


def test_dpo_label_smoothing_is_trls_conservative_sigmoid(policy_and_ref):
    """Our sigmoid with ε > 0 (soft label p = 1 - ε) is TRL's conservative sigmoid form —
    in TRL 1.x that lives in CPOTrainer.cpo_loss (DPOTrainer's sigmoid dropped ε). Fed the DPO
    log-ratios, TRL's function must give our loss and gradients."""
    policy, ref = policy_and_ref
    ids = torch.tensor([[3, 4, 5, 6, 1], [3, 7, 8, 1, 0], [3, 4, 9, 1, 0], [3, 10, 11, 12, 1]])
    labels = ids.masked_fill(torch.tensor([[0, 0, 1, 1, 1], [0, 1, 1, 1, 0]] * 2) == 0, -100)
    with torch.no_grad():
        rc, rr = sequence_logprobs(ref(ids).logits[:, :-1], labels[:, 1:]).chunk(2)
    eps, beta = 0.25, 0.5
    cpo = SimpleNamespace(alpha=0.0, loss_type="sigmoid", beta=beta, label_smoothing=eps,
                          accelerator=SimpleNamespace(device=torch.device("cpu")))  # fmt: skip

    def logratios():
        pc, pr = sequence_logprobs(policy(ids).logits[:, :-1], labels[:, 1:]).chunk(2)
        return pc, pr

    def trl_compute():
        pc, pr = logratios()
        return trl_experimental("cpo").CPOTrainer.cpo_loss(cpo, pc - rc, pr - rr)[0].mean()

    assert_same(policy, trl_compute, lambda: dpo_loss(*logratios(), rc, rr, beta, eps)[0])


# ----------------------------------------------------------------------------- reward model


def test_bradley_terry_with_margin_and_centering_matches_trl(tok):
    """bradley_terry_loss(margin, center_coef) = TRL RewardTrainer.compute_loss with a "margin"
    column and center_rewards_coefficient, on a tiny LlamaForSequenceClassification."""
    torch.manual_seed(0)
    model = LlamaForSequenceClassification(llama_config(num_labels=1))
    perturb(model.score, 0.5, seed=2)  # a non-trivial reward head
    data = Dataset.from_dict({**PAIRS, "margin": [0.5, 0.0, 1.5, -0.25]})
    args = trl_args(trl.RewardConfig, per_device_train_batch_size=4, center_rewards_coefficient=0.1)
    trainer = trl.RewardTrainer(model=model, args=args, train_dataset=data, processing_class=tok)
    b = first_batch(trainer)

    def ours():
        r = model(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).logits[:, 0]
        rc, rr = r.chunk(2)
        return bradley_terry_loss(rc, rr, margin=b["margin"], center_coef=0.1)

    trainer.model.train()
    assert_same(model, lambda: trainer.compute_loss(trainer.model, dict(b)), ours)


# ----------------------------------------------------------------------------- KTO


@pytest.mark.parametrize("loss_type", ["kto", "apo_zero_unpaired"])
def test_kto_matches_trl(tok, policy_and_ref, loss_type):
    """kto_loss on lmforge sequence log-probs (incl. the mismatched-pair KL reference point) =
    TRL KTOTrainer._compute_loss, with unequal desirable/undesirable weights."""
    # Roles swapped so the mismatched-pair KL estimate is positive for these weights (it is
    # clamped at 0, and a zero reference point would leave that part of the formula untested).
    ref, policy = policy_and_ref
    policy.requires_grad_(True)
    ref.requires_grad_(False)
    data = Dataset.from_dict({"prompt": PAIRS["prompt"], "completion": PAIRS["chosen"],
                              "label": [True, False, True, False]})  # fmt: skip
    args = trl_args(trl.KTOConfig, per_device_train_batch_size=4, beta=0.5, loss_type=loss_type,
                    desirable_weight=1.0, undesirable_weight=1.5)  # fmt: skip
    trainer = trl.KTOTrainer(model=policy, ref_model=ref, args=args, train_dataset=data,
                             processing_class=tok)  # fmt: skip
    b = first_batch(trainer)

    def seq(model, prefix=""):
        ids, cmask = b[prefix + "input_ids"], b[prefix + "completion_mask"]
        labels = ids.masked_fill(cmask == 0, -100)
        return sequence_logprobs(LMForgeView(model)(ids)[:, :-1], labels[:, 1:])

    with torch.no_grad():
        ref_logps = seq(ref)
        kl = (seq(policy, "KL_"), seq(ref, "KL_")) if loss_type == "kto" else (None, None)

    def ours():
        return kto_loss(seq(policy), ref_logps, b["label"], *kl, beta=0.5, desirable_weight=1.0,
                        undesirable_weight=1.5, loss_type=loss_type)[0]  # fmt: skip

    if loss_type == "kto":
        assert kto_loss(seq(policy), ref_logps, b["label"], *kl)[1] > 0.05  # z0 in play
    trainer.model.train()
    assert_same(policy, lambda: trainer._compute_loss(trainer.model, b, False), ours)


# ----------------------------------------------------------------------------- ORPO, CPO, SimPO


def concatenated(b: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """(ids, attention, labels) of chosen rows then rejected rows, right-padded to one width."""
    width = max(b["chosen_input_ids"].shape[1], b["rejected_input_ids"].shape[1])

    def pad(x, value):
        return nn.functional.pad(x, (0, width - x.shape[1]), value=value)

    cat = lambda k, v: torch.cat([pad(b[f"chosen_{k}"], v), pad(b[f"rejected_{k}"], v)])  # noqa: E731
    n_chosen = len(b["chosen_input_ids"])
    return cat("input_ids", PAD), cat("attention_mask", 0), cat("labels", -100), n_chosen


def test_orpo_matches_trl(tok, policy_and_ref):
    """orpo_loss (length-averaged log-probs, NLL over the whole chosen sequence as TRL does) =
    TRL ORPOTrainer.get_batch_loss_metrics."""
    policy, _ = policy_and_ref
    orpo = trl_experimental("orpo")
    args = trl_args(orpo.ORPOConfig, per_device_train_batch_size=4, beta=0.3, max_length=16)
    trainer = orpo.ORPOTrainer(model=policy, args=args, train_dataset=Dataset.from_dict(PAIRS),
                             processing_class=tok)  # fmt: skip
    b = first_batch(trainer)
    ids, attn, labels, n = concatenated(b)

    def ours():
        logits = policy(input_ids=ids, attention_mask=attn).logits
        avg = sequence_logprobs(logits[:, :-1], labels[:, 1:], average=True)
        nll = sft_loss(logits[:n], ids[:n].masked_fill(attn[:n] == 0, -100))
        return orpo_loss(avg[:n], avg[n:], nll, beta=0.3)[0]

    trainer.model.train()
    assert_same(policy, lambda: trainer.get_batch_loss_metrics(trainer.model, b)[0], ours)


@pytest.mark.parametrize(
    "loss_type,label_smoothing,cpo_alpha",
    [("simpo", 0.0, 0.0), ("simpo", 0.1, 0.5), ("sigmoid", 0.0, 1.0), ("hinge", 0.0, 0.0),
     ("ipo", 0.0, 0.0)],
)  # fmt: skip
def test_cpo_and_simpo_match_trl(tok, policy_and_ref, loss_type, label_smoothing, cpo_alpha):
    """cpo_loss (simpo included) + cpo_alpha·NLL(chosen response) = TRL CPOTrainer
    .get_batch_loss_metrics (SimPO is TRL's CPO with loss_type="simpo")."""
    policy, _ = policy_and_ref
    cpo = trl_experimental("cpo")
    args = trl_args(cpo.CPOConfig, per_device_train_batch_size=4, beta=2.0, max_length=16,
                    loss_type=loss_type, label_smoothing=label_smoothing, cpo_alpha=cpo_alpha,
                    simpo_gamma=0.7)  # fmt: skip
    trainer = cpo.CPOTrainer(model=policy, args=args, train_dataset=Dataset.from_dict(PAIRS),
                            processing_class=tok)  # fmt: skip
    b = first_batch(trainer)
    ids, attn, labels, n = concatenated(b)
    average = loss_type in ("simpo", "ipo")

    def ours():
        logits = policy(input_ids=ids, attention_mask=attn).logits
        lp = sequence_logprobs(logits[:, :-1], labels[:, 1:], average=average)
        loss = cpo_loss(lp[:n], lp[n:], 2.0, loss_type, label_smoothing, simpo_gamma=0.7)
        return loss + cpo_alpha * sft_loss(logits[:n], labels[:n]) if cpo_alpha else loss

    trainer.model.train()
    assert_same(policy, lambda: trainer.get_batch_loss_metrics(trainer.model, b)[0], ours)


def test_oracle_detects_a_wrong_formula(tok, policy_and_ref):
    """The harness can fail: IPO without TRL's length normalisation must not pass as IPO."""
    policy, ref = policy_and_ref
    args = trl_args(trl.DPOConfig, loss_type=["ipo"], beta=0.7, per_device_train_batch_size=4,
                    precompute_ref_log_probs=False)  # fmt: skip
    trainer = trl.DPOTrainer(model=policy, ref_model=ref, args=args, processing_class=tok,
                             train_dataset=Dataset.from_dict(PAIRS))  # fmt: skip
    b = first_batch(trainer)
    labels = b["input_ids"].masked_fill(b["completion_mask"] == 0, -100)
    with torch.no_grad():
        rc, rr = sequence_logprobs(ref(b["input_ids"]).logits[:, :-1], labels[:, 1:]).chunk(2)
    ones = torch.ones(len(rc))

    def unnormalised():
        pc, pr = sequence_logprobs(policy(b["input_ids"]).logits[:, :-1], labels[:, 1:]).chunk(2)
        return dpo_loss(pc, pr, rc, rr, 0.7, loss_type="ipo", chosen_lengths=ones,
                        rejected_lengths=ones)[0]  # fmt: skip

    with warnings.catch_warnings(), pytest.raises(AssertionError):
        warnings.simplefilter("ignore")
        assert_same(policy, lambda: trainer._compute_loss(trainer.model, b, False), unnormalised)
