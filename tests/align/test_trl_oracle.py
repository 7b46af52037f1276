"""TRL is the oracle for every post-training loss lmforge shares with it.

Each test builds one tiny random Llama (Hugging Face transformers) and one batch, then computes the
loss AND its gradients twice on that same model: once with TRL's own trainer code (a real
``DPOTrainer``/``GRPOTrainer``/... built on the tiny model, calling the method TRL's training step
calls) and once with lmforge (the trainer's loss method where one exists, else the pure functions
in ``lmforge.align.preference_losses`` / ``rl_losses`` on log-probs from ``lmforge.align``
helpers). Losses and every parameter gradient must agree to 1e-5. lmforge's side applies the LM
head two tokens at a time (its chunked path), TRL's to the whole batch.

lmforge's side sees the HF model through `LMForgeView`, which only exposes the interface lmforge's
trainers call (``model(ids) -> logits``, ``hidden_states``, ``norm``, ``lm_head``), so both sides
differentiate the very same parameters.

Where lmforge and TRL differ on purpose, the test says so:
- DPO ``sigmoid`` with label smoothing ε > 0: the soft-label (conservative) DPO (Mitchell 2023).
  TRL >= 1.0 ignores ε there, so that form is checked against TRL's ``CPOTrainer.cpo_loss``
  (the same expression, applied to the DPO log-ratios) and against TRL's DPO ``robust`` for ε = 0.
- GRPO advantages: lmforge's ``scale: std`` is TRL's ``scale_rewards="group"`` and ``none`` is
  ``"none"``; TRL's ``"batch"`` is not offered.
"""

import copy
import importlib
import tempfile
import warnings
from types import SimpleNamespace

import pytest
import torch
import trl
from datasets import Dataset
from tokenizers import Tokenizer, models, pre_tokenizers
from torch import nn
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    LlamaForSequenceClassification,
    PreTrainedTokenizerFast,
)

from lmforge.align import dpo as lm_dpo
from lmforge.align import grpo as lm_grpo
from lmforge.align import logprobs
from lmforge.align.logprobs import sequence_logprobs, sft_loss
from lmforge.align.preference_losses import (
    bradley_terry_loss,
    cpo_loss,
    dpo_loss,
    kto_loss,
    orpo_loss,
)
from lmforge.align.rl_losses import grpo_loss
from lmforge.align.rollout import Rollout, completion_logprobs
from lmforge.errors import ConfigError

TOL = 1e-5
PAD, EOS = 0, 1

pytestmark = pytest.mark.filterwarnings("ignore")


# ----------------------------------------------------------------------------- fixtures, helpers


@pytest.fixture(autouse=True)
def two_token_chunks(monkeypatch):
    """lmforge's LM head runs two tokens at a time (logprobs.map_token_chunks): every loss below
    is checked against TRL, which builds the whole logits tensor, through chunk borders."""
    monkeypatch.setattr(logprobs, "CHUNK_ELEMENTS", 2 * 32)  # vocabulary 32


@pytest.fixture(scope="module")
def tok() -> PreTrainedTokenizerFast:
    """A 32-word whitespace tokenizer: w0..w28 are single tokens 3..31."""
    words = ["<pad>", "<eos>", "<unk>"] + [f"w{i}" for i in range(29)]
    tk = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(
        tokenizer_object=tk, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>"
    )


def llama_config(**kw) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=32, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        pad_token_id=PAD, eos_token_id=EOS, bos_token_id=None, **kw,
    )  # fmt: skip


def perturb(model: nn.Module, scale: float, seed: int) -> None:
    """Move every weight a little, so policy ≠ reference (and π ≠ π_old): no ratio is exactly 1."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(scale * torch.randn(p.shape, generator=gen))


@pytest.fixture
def policy_and_ref() -> tuple[LlamaForCausalLM, LlamaForCausalLM]:
    torch.manual_seed(0)
    ref = LlamaForCausalLM(llama_config()).eval()
    policy = copy.deepcopy(ref)
    perturb(policy, 0.05, seed=1)
    return policy, ref.requires_grad_(False)


@pytest.fixture(scope="module")
def model_dir(tok) -> str:
    """A saved tiny Llama + tokenizer: GRPO/RLOO build their reference model from the path."""
    torch.manual_seed(0)
    path = tempfile.mkdtemp(prefix="trl_oracle_")
    LlamaForCausalLM(llama_config()).save_pretrained(path)
    tok.save_pretrained(path)
    return path


class LMForgeView(nn.Module):
    """An HF causal LM seen through the interface lmforge's align code calls on its Transformer."""

    def __init__(self, hf: LlamaForCausalLM):
        super().__init__()
        self.hf = hf
        self.norm = nn.Identity()  # HF's backbone output is already final-normed
        self.lm_head = hf.lm_head

    def forward(self, input_ids):
        return self.hf(input_ids=input_ids).logits

    def hidden_states(self, input_ids, attention_mask):
        return self.hf.model(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state


def loss_and_grads(model: nn.Module, compute) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    loss = compute()
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return loss.detach().float(), grads


def assert_same(model: nn.Module, trl_compute, ours_compute) -> torch.Tensor:
    """TRL's and lmforge's loss and every parameter gradient agree to TOL (and are not trivial)."""
    trl_loss, trl_grads = loss_and_grads(model, trl_compute)
    our_loss, our_grads = loss_and_grads(model, ours_compute)
    torch.testing.assert_close(our_loss, trl_loss, atol=TOL, rtol=0)
    assert trl_grads and our_grads.keys() == trl_grads.keys()
    assert sum(g.abs().sum() for g in trl_grads.values()) > 0, "the oracle's gradient is all zero"
    for name, g in trl_grads.items():
        torch.testing.assert_close(our_grads[name], g, atol=TOL, rtol=TOL, msg=name)
    return trl_loss


def trl_experimental(name: str):
    """A trl.experimental module (ORPO, CPO/SimPO live there), without its import warning."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return importlib.import_module(f"trl.experimental.{name}")


def trl_args(config_cls, **kw):
    """A TRL config for a CPU run in fp32 (TRL defaults to bf16 autocast), writing nothing."""
    return config_cls(output_dir=tempfile.mkdtemp(prefix="trl_oracle_out_"), report_to=[],
                      use_cpu=True, seed=0, bf16=False, **kw)  # fmt: skip


def first_batch(trainer) -> dict:
    return next(iter(trainer.get_train_dataloader()))


PAIRS = {
    "prompt": ["w1 w2", "w3", "w4 w5 w6", "w7"],
    "chosen": [" w8 w9", " w10", " w11 w12 w13", " w14"],
    "rejected": [" w15", " w16 w17", " w18", " w19 w20 w21"],
}


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
        ours_batch["ref"] = lm_dpo.completion_logprobs(LMForgeView(ref), ours_batch).view(2, -1).T
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


# ----------------------------------------------------------------------------- GRPO / RLOO

# Two prompts x two completions; rows 1 and 3 hit max_completion_length (4) without EOS.
PROMPTS = [[5, 6], [5, 6], [7, 8], [7, 8]]
COMPLETIONS = [[9, 10, EOS], [11, 12, 13, 14], [15, EOS], [16, 17, 18, 19]]
REWARDS = [1.0, 0.0, 0.5, 0.25]


def rollout_from(trainer_out: dict, rewards: list[float]) -> Rollout:
    """lmforge's Rollout layout of the same prompts/completions TRL padded (prompt | completion)."""
    lengths = torch.tensor([len(c) for c in COMPLETIONS])
    width = trainer_out["completion_ids"].shape[1]
    completion_mask = (torch.arange(width) < lengths[:, None]).float()  # before any filtering
    prompt_ids, prompt_mask = trainer_out["prompt_ids"], trainer_out["prompt_mask"]
    return Rollout(
        input_ids=torch.cat([prompt_ids, trainer_out["completion_ids"]], 1),
        attention_mask=torch.cat([prompt_mask, completion_mask.long()], 1),
        completion_mask=completion_mask,
        prompt_width=prompt_ids.shape[1],
        group=torch.tensor([0, 0, 1, 1]),
        rewards=torch.tensor(rewards),
    )


def scripted(trainer, rloo: bool = False) -> None:
    """Replace TRL's sampling by the fixed completions above; everything after it is TRL's."""
    texts = ["x"] * len(PROMPTS)
    if rloo:  # RLOO's _generate returns (prompt_ids, completion_ids, completions)
        trainer._generate = lambda prompts: (PROMPTS, COMPLETIONS, texts)
    else:  # GRPO's also returns tool masks, sampling log-probs, extra fields and images
        out = (PROMPTS, COMPLETIONS, None, texts, None, {}, None, None)
        trainer._generate = lambda prompts: out


@pytest.mark.parametrize(
    "loss_type,beta,kl_correction,eps_high,mask_trunc,scale",
    [
        ("grpo", 0.05, False, None, False, "std"),
        ("grpo", 0.05, True, None, False, "std"),
        ("bnpo", 0.0, False, None, False, "std"),
        ("dr_grpo", 0.05, True, None, False, "none"),
        ("dapo", 0.0, False, 0.28, True, "std"),
        ("dapo", 0.05, False, 0.28, False, "std"),
        ("grpo", 0.0, False, 0.28, True, "none"),
    ],
)
def test_grpo_loss_types_match_trl(
    tok, model_dir, loss_type, beta, kl_correction, eps_high, mask_trunc, scale
):
    """TRL GRPOTrainer._generate_and_score_completions (advantages, overlong filtering, π_old and
    π_ref log-probs) + _compute_loss, after one off-policy weight change so ratios leave 1 and
    clipping (incl. clip-higher) acts, = lmforge GRPOTrainer.prepare + minibatch_loss.

    KL: lmforge's default is DeepSeekMath's β·k3 (TRL's ``use_bias_correction_kl=False``);
    ``kl_correction: true`` is TRL 1.x's default k3·ratio (see ``losses.grpo_loss``)."""
    args = trl_args(trl.GRPOConfig, per_device_train_batch_size=4, num_generations=2,
                    max_completion_length=4, beta=beta, num_iterations=2, loss_type=loss_type,
                    epsilon=0.2, epsilon_high=eps_high, mask_truncated_completions=mask_trunc,
                    scale_rewards={"std": "group", "none": "none"}[scale],
                    use_bias_correction_kl=kl_correction)  # fmt: skip
    trainer = trl.GRPOTrainer(model=model_dir, reward_funcs=lambda completions, **_: REWARDS,
                              args=args, train_dataset=Dataset.from_dict({"prompt": ["a", "b"]}),
                              processing_class=tok)  # fmt: skip
    trainer.current_gradient_accumulation_steps = args.gradient_accumulation_steps
    policy = trainer.model
    ref = copy.deepcopy(policy).requires_grad_(False)  # = TRL's ref (same checkpoint)
    scripted(trainer)
    trl_inputs = trainer._generate_and_score_completions([{"prompt": p} for p in "aabb"])

    cfg = lm_grpo.GRPOConfig(group_size=2, beta=beta, clip_eps=0.2, clip_eps_high=eps_high,
                             loss_type=loss_type, mask_truncated=mask_trunc, scale=scale,
                             num_iterations=2, max_new_tokens=4,
                             kl_correction=kl_correction)  # fmt: skip
    ours = SimpleNamespace(lm=SimpleNamespace(model=LMForgeView(policy)), cfg=cfg,
                           engine=SimpleNamespace(stop_ids=[EOS]))  # fmt: skip
    rollout = rollout_from(trl_inputs, REWARDS)
    args4 = (rollout.input_ids, rollout.attention_mask, rollout.prompt_width)
    with torch.no_grad():  # what lmforge's RolloutEngine stores at sampling time
        rollout.old_logprobs = completion_logprobs(LMForgeView(policy), *args4)
        rollout.ref_logprobs = completion_logprobs(LMForgeView(ref), *args4)
    lm_grpo.GRPOTrainer.prepare(ours, rollout)
    torch.testing.assert_close(rollout.advantages, trl_inputs["advantages"], atol=TOL, rtol=0)
    torch.testing.assert_close(rollout.completion_mask, trl_inputs["completion_mask"].float())

    perturb(policy, 0.3, seed=3)  # "after an optimizer step": π ≠ π_old
    policy.train()
    assert_same(
        policy,
        lambda: trainer._compute_loss(policy, trl_inputs),
        lambda: lm_grpo.GRPOTrainer.minibatch_loss(ours, rollout)[0],
    )
    stats = lm_grpo.GRPOTrainer.minibatch_loss(ours, rollout)[1]
    assert stats["clip_frac"] > 0  # the clipped branch was exercised


@pytest.mark.parametrize("beta,normalize", [(0.0, False), (0.1, True)])
def test_rloo_matches_trl(tok, model_dir, beta, normalize):
    """TRL RLOOTrainer (leave-one-out advantages with the k1 KL charged to the reward, optional
    whitening; sequence-level clipped ratio) = lmforge GRPOTrainer with loss_type rloo."""
    args = trl_args(trl.RLOOConfig, per_device_train_batch_size=4, num_generations=2,
                    max_completion_length=4, beta=beta, num_iterations=2, epsilon=0.2,
                    normalize_advantages=normalize)  # fmt: skip
    trainer = trl.RLOOTrainer(model=model_dir, reward_funcs=lambda completions, **_: REWARDS,
                              args=args, train_dataset=Dataset.from_dict({"prompt": ["a", "b"]}),
                              processing_class=tok)  # fmt: skip
    policy = trainer.model
    ref = copy.deepcopy(policy).requires_grad_(False)
    perturb(ref, 0.05, seed=4)  # TRL's ref is the checkpoint; make ours, and TRL's, differ from π
    if trainer.ref_model is not None:
        trainer.ref_model.load_state_dict(ref.state_dict())
    scripted(trainer, rloo=True)
    trl_inputs = trainer._generate_and_score_completions([{"prompt": p} for p in "aabb"])

    cfg = lm_grpo.GRPOConfig(group_size=2, beta=beta, clip_eps=0.2, loss_type="rloo",
                             normalize_advantages=normalize, num_iterations=2,
                             max_new_tokens=4)  # fmt: skip
    ours = SimpleNamespace(lm=SimpleNamespace(model=LMForgeView(policy)), cfg=cfg,
                           engine=SimpleNamespace(stop_ids=[EOS]))  # fmt: skip
    rollout = rollout_from(trl_inputs, REWARDS)
    args4 = (rollout.input_ids, rollout.attention_mask, rollout.prompt_width)
    with torch.no_grad():
        rollout.old_logprobs = completion_logprobs(LMForgeView(policy), *args4)
        rollout.ref_logprobs = completion_logprobs(LMForgeView(ref), *args4)
    lm_grpo.GRPOTrainer.prepare(ours, rollout)
    torch.testing.assert_close(rollout.advantages, trl_inputs["advantages"], atol=TOL, rtol=0)

    perturb(policy, 0.05, seed=5)
    policy.train()
    assert_same(
        policy,
        lambda: trainer._compute_loss(policy, trl_inputs),
        lambda: lm_grpo.GRPOTrainer.minibatch_loss(ours, rollout)[0],
    )


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


# ----------------------------------------------------------------------------- the real trainers

TINY = {"n_layer": 1, "n_head": 2, "d_model": 16, "max_seq_len": 32}


@pytest.mark.parametrize("loss_type", ["robust", "hinge", "ipo"])
def test_lmforge_dpo_trainer_steps_with_every_loss_type(tmp_path, loss_type):
    """The new DPO loss_types run through lmforge's own trainer (real batches, lengths, step)."""
    cfg = lm_dpo.DPOConfig(out_dir=str(tmp_path), init="scratch", model=TINY, data="task:add:1",
                           n_train=16, n_eval=4, batch_size=4, max_iters=1, eval_interval=1,
                           progress=False, threads=1, loss_type=loss_type,
                           label_smoothing=0.1 if loss_type == "robust" else 0.0)  # fmt: skip
    t = lm_dpo.DPOTrainer(cfg, log=lambda *a: None)
    before = [p.detach().clone() for p in t.lm.model.parameters()]
    t.train_step()
    assert any(not torch.equal(p, b) for p, b in zip(t.lm.model.parameters(), before))


@pytest.mark.parametrize(
    "kw",
    [
        {"loss_type": "dapo", "clip_eps_high": 0.28, "mask_truncated": True, "minibatch_size": 4},
        {"loss_type": "dr_grpo", "beta": 0.05, "kl_correction": True},
        {"loss_type": "bnpo", "num_iterations": 2},
        {"loss_type": "rloo", "beta": 0.05, "normalize_advantages": True},
    ],
)
def test_lmforge_grpo_trainer_steps_with_every_loss_type(tmp_path, kw):
    """GRPO's loss_types run through lmforge's trainer: rollout, prepare, minibatches, step."""
    cfg = lm_grpo.GRPOConfig(out_dir=str(tmp_path), init="scratch", model=TINY, data="task:add:1",
                             n_train=16, n_eval=4, batch_size=2, group_size=4, max_new_tokens=4,
                             max_iters=1, eval_interval=1, progress=False, threads=1, lr=1e-2,
                             **kw)  # fmt: skip
    rewards = iter([1.0, 0.0, 0.0, 0.5] * 4)
    t = lm_grpo.GRPOTrainer(cfg, log=lambda *a: None, reward=lambda rec, comp: next(rewards))
    rollout = t.rollout([0, 1])
    if kw.get("mask_truncated"):  # even rows: cut at max_new_tokens; odd rows: stop at token 2
        stop, p = t.engine.stop_ids[0], rollout.prompt_width
        rollout.completion_mask[0::2] = 1.0
        rollout.input_ids[0::2, p:] = 5  # not a stop token
        rollout.completion_mask[1::2] = torch.tensor([1.0, 1.0, 0.0, 0.0])
        rollout.input_ids[1::2, p + 1] = stop
    before = [p.detach().clone() for p in t.lm.model.parameters()]
    stats = t.update(rollout)
    assert all(torch.isfinite(torch.tensor(v)) for v in stats.values())
    assert any(not torch.equal(p, b) for p, b in zip(t.lm.model.parameters(), before))
    if kw.get("mask_truncated"):  # the cut rows no longer count, the finished ones do
        assert rollout.completion_mask.sum(-1).tolist() == [0.0, 2.0] * 4


def test_bad_loss_types_are_config_errors():
    with pytest.raises(ConfigError, match="loss_type"):
        lm_dpo.DPOConfig(loss_type="sppo")
    with pytest.raises(ConfigError, match="label_smoothing"):
        lm_dpo.DPOConfig(loss_type="robust", label_smoothing=0.5)
    with pytest.raises(ConfigError, match="loss_type"):
        lm_grpo.GRPOConfig(group_size=2, loss_type="cispo")
    with pytest.raises(ConfigError, match="max_completion_length"):
        ones = torch.ones(1, 2)
        grpo_loss(ones, None, None, torch.ones(1), ones, loss_type="dr_grpo")
    with pytest.raises(ConfigError, match="lengths"):
        dpo_loss(*torch.zeros(4, 2), loss_type="ipo")
