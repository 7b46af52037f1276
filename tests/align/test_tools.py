"""Multi-turn tool use for GRPO: the sandboxed calculator's limits, a tool round-trip inside a
rollout with tool-result tokens masked out of the loss, failed calls scoring 0, and a NaN reward
stopping a run with one clear message."""

import math

import pytest
import torch

from lmforge.align.grpo import GRPOConfig, GRPOTrainer
from lmforge.align.rollout import RewardError, VerifierReward
from lmforge.align.tools import Calculator, ToolReward, ToolRolloutEngine, tool_call
from lmforge.align.trainer import load_lm
from lmforge.tasks.answers import verify

TINY = {"n_layer": 1, "d_model": 32, "n_head": 2}


@pytest.fixture(scope="module")
def calc():
    return Calculator(cpu_seconds=1, memory_mb=256, wall_seconds=20)


def test_arithmetic_is_evaluated(calc):
    assert calc("2+3*4").text == "14" and calc("(7 - 1) / 4").text == "1.5"
    assert calc("-2**10 % 7").ok and calc("-2**10 % 7").text == str(-(2**10) % 7)


@pytest.mark.parametrize(
    "expr,error",
    [("__import__('os').system('true')", "not allowed: Call"),
     ("open('/etc/passwd').read()", "not allowed"),
     ("x + 1", "not allowed: Name"),
     ("(1).__class__", "not allowed: Attribute"),
     ("[1] * 10", "not allowed: List"),
     ("while True: pass", "syntax error"),
     ("1/0", "ZeroDivisionError")],
)  # fmt: skip
def test_anything_but_arithmetic_is_an_error(calc, expr, error):
    result = calc(expr)
    assert not result.ok and error in result.text


def test_cpu_and_memory_limits_end_the_call(calc):
    slow = calc("9**9**9")  # minutes of big-int arithmetic: killed by RLIMIT_CPU, no hang
    assert not slow.ok and "time limit" in slow.text
    big = calc("1 << 10**10")  # 1.2 GB integer against a 256 MiB address space
    assert not big.ok and "memory limit" in big.text
    hang = Calculator(cpu_seconds=60, wall_seconds=0.5)("9**9**9")
    assert not hang.ok and "wall time limit" in hang.text


def test_tool_call_parsing():
    assert tool_call("let me see <tool>2+3</tool>") == "2+3"
    assert tool_call("no call here") is None and tool_call("</tool>") == ""


class ScriptedEngine(ToolRolloutEngine):
    """The policy's turns come from a script (per turn, the same for every row), so the rollout
    has known tool calls; scoring passes still run the real tiny model."""

    script: list[str] = []

    def _generate_turn(self, contexts, budgets, may_call, seed, greedy):
        self.turn = getattr(self, "turn", -1) + 1
        text = self.script[min(self.turn, len(self.script) - 1)]
        return [self.tokenizer.encode(text)[:b] for b in budgets]


def scripted(lm, script, **kw):
    engine = ScriptedEngine(lm.model, lm.tokenizer, max_new_tokens=24, reference=lm.model,
                            calculator=Calculator(wall_seconds=20), **kw)  # fmt: skip
    engine.script = script
    return engine


@pytest.fixture(scope="module")
def lm():
    return load_lm("scratch", TINY, 64, 0, "cpu")


def test_round_trip_masks_tool_result_tokens(lm):
    tok = lm.tokenizer
    engine = scripted(lm, ["<tool>17+25</tool>", "42"], max_tool_calls=2)
    records = [{"prompt": "17+25=", "answer": "42"}]
    r = engine.sample([tok.encode("17+25=")], records, n=2, seed=0)
    assert r.transcripts[0] == "<tool>17+25</tool><result>42</result>42"
    assert r.completions == ["42", "42"] and r.tool_calls == [1, 1]
    assert r.tool_errors == [None, None]
    # loss mask: 1 on what the model wrote, 0 on the tool turn, which stays in the context
    n_call, n_result = len(tok.encode("<tool>17+25</tool>")), len(tok.encode("<result>42</result>"))
    mask = r.completion_mask[0]
    assert mask[:n_call].eq(1).all() and mask[n_call : n_call + n_result].eq(0).all()
    assert mask[n_call + n_result :].sum() == len(tok.encode("42"))
    assert r.attention_mask[0, r.prompt_width :].sum() == n_call + n_result + 2
    assert r.old_logprobs[0][mask == 0].eq(0).all() and r.old_logprobs[0][mask == 1].lt(0).all()
    assert r.ref_logprobs is not None
    rewards = ToolReward(VerifierReward(verify))(r)
    assert rewards.tolist() == [1.0, 1.0]  # the verifier scores the final answer turn


def test_failed_tool_call_scores_zero_with_the_error_recorded(lm):
    tok = lm.tokenizer
    engine = scripted(lm, ["<tool>9**9**9</tool>", "42"], max_tool_calls=2)
    engine.calculator = Calculator(cpu_seconds=1, wall_seconds=20)
    r = engine.sample([tok.encode("1+1=")], [{"prompt": "1+1=", "answer": "2"}], n=1, seed=0)
    assert r.tool_calls == [1] and "time limit" in r.tool_errors[0]
    assert "<tool>9**9**9</tool>" in r.tool_errors[0]
    # the row ended at the failed call (its error turn cut to the 64-token window)
    assert r.transcripts[0].startswith("<tool>9**9**9</tool><result>error: ")
    assert "42" not in r.transcripts[0] and r.completions == [""]
    always_one = VerifierReward(lambda rec, c: 1.0)
    assert ToolReward(always_one)(r).tolist() == [0.0]


def test_call_budget_stops_tool_turns(lm):
    engine = scripted(lm, ["<tool>1+1</tool>"], max_tool_calls=1)
    r = engine.sample([lm.tokenizer.encode("q")], n=1, seed=0)
    # the second turn's call is not executed (budget spent): it stays model text, unmasked
    assert r.tool_calls == [1] and r.transcripts[0].count("<result>") == 1
    # max_new_tokens (24) bounds the model's own tokens over all turns: 16 + 8 of the second
    assert r.completions[0] == "<tool>1+" and r.completion_mask[0].sum() == 24


def cfg(tmp_path, **kw):
    base = dict(out_dir=str(tmp_path), model=TINY, data="task:add:1", n_train=16, n_eval=4,
                batch_size=2, group_size=2, max_new_tokens=8, max_iters=1, eval_interval=1,
                progress=False, threads=1, max_len=32)  # fmt: skip
    return GRPOConfig(**{**base, **kw})


def test_grpo_step_with_tools_on_the_engine(tmp_path):
    t = GRPOTrainer(cfg(tmp_path, max_tool_calls=2), log=lambda *a: None)
    assert isinstance(t.engine, ToolRolloutEngine) and isinstance(t.reward, ToolReward)
    stats = t.train_step()
    assert math.isfinite(stats["loss"])


def test_nan_reward_stops_grpo_with_one_line(tmp_path):
    t = GRPOTrainer(cfg(tmp_path), log=lambda *a: None, reward=lambda rec, c: math.nan)
    with pytest.raises(RewardError, match=r"returned nan for sample 0 of 4 \(4 non-finite") as e:
        t.train_step()
    assert "\n" not in str(e.value)
    assert not any(p.grad is not None and p.grad.abs().sum() > 0 for p in t.lm.model.parameters())
    assert torch.isfinite(torch.cat([p.flatten() for p in t.lm.model.parameters()])).all()
