"""Multi-turn tool use in GRPO rollouts: the policy may call a sandboxed calculator between turns.

Format (plain text, so it works with any tokenizer, chat template or not): the model writes
``<tool>EXPR</tool>``; generation stops at ``</tool>``, EXPR is evaluated in the sandbox and the
tool turn ``<result>VALUE</result>`` (or ``<result>error: ...</result>``) is appended to the
context, then generation continues, up to `max_tool_calls` calls per completion (after the last
one ``</tool>`` no longer stops generation). `max_new_tokens` bounds the tokens the *model*
writes in all its turns together. The reward is the task verifier on the final answer: the text
after the last tool result (`Rollout.completions`); the whole transcript is kept in
`ToolRollout.transcripts`.

Loss masking: tool-result tokens are context, not actions. They stay in `attention_mask` (the
policy conditions on them), but `completion_mask` is 0 on them, so neither the GRPO loss, the KL
term nor the token counts of `dapo`/`bnpo` include them.

The sandbox: EXPR is parsed with `ast` (mode "eval") and only numbers, + - * / // % ** << >> and
unary signs are allowed (no names, calls, attributes, subscripts, comprehensions, so no imports or
builtins). The evaluation runs in a child Python (`-I -S`, no lmforge or torch imported) under
`resource` limits on CPU seconds and address space, with a wall-clock timeout on top, so
``9**9**9`` or a huge allocation ends as an error instead of a hang. A completion whose tool call
fails (bad syntax, forbidden node, limit, arithmetic error) ends there, gets reward 0 and its
error is recorded in `ToolRollout.tool_errors`; the run goes on.
"""

from __future__ import annotations

import itertools
import resource
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor

from lmforge.align.rollout import Rollout, RolloutEngine

TOOL_OPEN, TOOL_CLOSE = "<tool>", "</tool>"
RESULT_OPEN, RESULT_CLOSE = "<result>", "</result>"

# The evaluator runs in the child process; it is one source string so the child needs no import
# of lmforge (a torch import would cost seconds per call) and the parent checks with the same code.
_EVALUATOR = r'''
import ast, operator, sys
sys.set_int_max_str_digits(4300)
BIN = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
       ast.Div: operator.truediv, ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod,
       ast.Pow: operator.pow, ast.LShift: operator.lshift, ast.RShift: operator.rshift}
UNARY = {ast.USub: operator.neg, ast.UAdd: operator.pos}

def check(expr):
    """The parsed expression, or ValueError naming the first construct that is not arithmetic."""
    try:
        tree = ast.parse(expr, mode="eval")
    except SyntaxError as err:
        raise ValueError(f"syntax error: {err.msg}") from None
    for node in ast.walk(tree):
        ok = isinstance(node, (ast.Expression, ast.BinOp, ast.UnaryOp, *BIN, *UNARY)) or (
            isinstance(node, ast.Constant) and type(node.value) in (int, float))
        if not ok:
            raise ValueError(f"not allowed: {type(node).__name__}")
    return tree

def evaluate(node):
    if isinstance(node, ast.Expression):
        return evaluate(node.body)
    if isinstance(node, ast.Constant):
        return node.value
    if isinstance(node, ast.UnaryOp):
        return UNARY[type(node.op)](evaluate(node.operand))
    return BIN[type(node.op)](evaluate(node.left), evaluate(node.right))

if __name__ == "__main__":
    try:
        value = evaluate(check(sys.stdin.read()))
        out = repr(value) if isinstance(value, float) else str(value)
        sys.stdout.write("ok " + out)
    except MemoryError:
        sys.stdout.write("error memory limit exceeded")
    except Exception as err:
        sys.stdout.write(f"error {type(err).__name__}: {err}")
'''
_CHECKER: dict = {"__name__": "lmforge_calculator"}
exec(compile(_EVALUATOR, "<calculator>", "exec"), _CHECKER)  # defines check() for the parent


@dataclass
class ToolResult:
    """One calculator call: the value's text when ok, else the error."""

    ok: bool
    text: str

    @property
    def turn(self) -> str:
        """The tool turn appended to the context."""
        return f"{RESULT_OPEN}{self.text if self.ok else 'error: ' + self.text}{RESULT_CLOSE}"


@dataclass
class Calculator:
    """The sandboxed arithmetic tool: limits on the child's CPU seconds, address space (MiB)
    and wall-clock seconds (the last catches a child blocked without using CPU)."""

    cpu_seconds: int = 1
    memory_mb: int = 512
    wall_seconds: float = 3.0

    def _limits(self) -> None:  # runs in the child between fork and exec
        resource.setrlimit(resource.RLIMIT_CPU, (self.cpu_seconds, self.cpu_seconds))
        size = self.memory_mb * 2**20
        resource.setrlimit(resource.RLIMIT_AS, (size, size))

    def __call__(self, expr: str) -> ToolResult:
        try:
            _CHECKER["check"](expr)  # refuse non-arithmetic without starting a process
        except ValueError as err:
            return ToolResult(False, str(err))
        try:
            proc = subprocess.run(
                [sys.executable, "-I", "-S", "-c", _EVALUATOR], input=expr, text=True,
                capture_output=True, timeout=self.wall_seconds, preexec_fn=self._limits,
            )  # fmt: skip
        except subprocess.TimeoutExpired:
            return ToolResult(False, f"wall time limit ({self.wall_seconds:g} s) exceeded")
        status, _, text = proc.stdout.partition(" ")
        if status in ("ok", "error"):
            return ToolResult(status == "ok", text)
        if proc.returncode in (-9, -24):  # SIGKILL / SIGXCPU from RLIMIT_CPU
            return ToolResult(False, f"CPU time limit ({self.cpu_seconds} s) exceeded")
        if "MemoryError" in proc.stderr:
            return ToolResult(False, "memory limit exceeded")
        return ToolResult(False, f"sandbox exited with status {proc.returncode}")


def tool_call(text: str) -> str | None:
    """The expression of a turn that ends in a tool call (``...<tool>EXPR</tool>``), else None."""
    end = text.find(TOOL_CLOSE)
    if end < 0:
        return None
    start = text.rfind(TOOL_OPEN, 0, end)
    return text[start + len(TOOL_OPEN) : end] if start >= 0 else ""


@dataclass
class ToolRollout(Rollout):
    """A Rollout of multi-turn completions: full transcripts, tool calls and errors per row."""

    transcripts: list[str] = field(default_factory=list)
    tool_calls: list[int] = field(default_factory=list)
    tool_errors: list[str | None] = field(default_factory=list)


class ToolRolloutEngine(RolloutEngine):
    """RolloutEngine whose completions may call the calculator (see the module docstring)."""

    def __init__(self, *args, max_tool_calls: int = 2, calculator: Calculator | None = None,
                 **kwargs):  # fmt: skip
        super().__init__(*args, **kwargs)
        self.max_tool_calls = max_tool_calls
        self.calculator = calculator or Calculator()

    def finish(self, base: Rollout) -> ToolRollout:
        """The tool turns `generate` recorded: completion_mask is 0 on tool-result tokens and
        `completions` holds the final answer turn (what the verifier scores)."""
        rollout = ToolRollout(**vars(base))
        model_mask = torch.zeros_like(rollout.completion_mask)
        for row, t in enumerate(self._turns):
            model_mask[row, : len(t["mask"])] = torch.tensor(t["mask"], dtype=model_mask.dtype)
        rollout.completion_mask = rollout.completion_mask * model_mask
        rollout.transcripts = rollout.completions
        finals = [t["tokens"][t["final_start"] :] for t in self._turns]
        rollout.completions = self.tokenizer.decode_batch(finals, skip_special_tokens=True)
        rollout.tool_calls = [t["calls"] for t in self._turns]
        rollout.tool_errors = [t["error"] for t in self._turns]
        return rollout

    def generate(self, prompts, n, seed, greedy=False):
        """Completion tokens (model turns and tool turns) of n samples per prompt; each row's
        model-token mask, calls, error and where its final answer starts go to `self._turns`."""
        rows = [p for p in prompts for _ in range(n)]
        state = [{"tokens": [], "mask": [], "calls": 0, "error": None, "final_start": 0,
                  "done": False} for _ in rows]  # fmt: skip
        limit = self.policy.config.max_seq_len
        for turn in itertools.count():
            # what each unfinished row may still write: the model's token budget, or the room
            # left in the context window if that is less
            left = {i: min(self.max_new_tokens - sum(s["mask"]),
                           limit - len(rows[i]) - len(s["tokens"]))
                    for i, s in enumerate(state) if not s["done"]}  # fmt: skip
            active = [i for i, n in left.items() if n > 0]  # a row out of room stays out
            if not active:
                break
            new = self._generate_turn([rows[i] + state[i]["tokens"] for i in active],
                                      [left[i] for i in active],
                                      [state[i]["calls"] < self.max_tool_calls for i in active],
                                      None if seed is None else seed + 1_000_003 * turn,
                                      greedy)  # fmt: skip
            for i, tokens in zip(active, new):
                s = state[i]
                s["tokens"] += tokens
                s["mask"] += [1] * len(tokens)
                text = self.tokenizer.decode(tokens, skip_special_tokens=True)
                expr = tool_call(text) if s["calls"] < self.max_tool_calls else None
                if expr is None:
                    s["done"] = True
                    continue
                result = self.calculator(expr)
                s["calls"] += 1
                # the tool turn is context: cut to what still fits the model's window
                room_left = limit - len(rows[i]) - len(s["tokens"])
                result_ids = self.tokenizer.encode(result.turn)[: max(0, room_left)]
                s["tokens"] += result_ids
                s["mask"] += [0] * len(result_ids)
                s["final_start"] = len(s["tokens"])
                if not result.ok:
                    s["error"] = f"tool call {s['calls']} <tool>{expr}</tool>: {result.text}"
                    s["done"] = True
        self._turns = state
        return [s["tokens"] for s in state]

    def _generate_turn(self, contexts, budgets, may_call, seed, greedy) -> list[list[int]]:
        """One model turn per context, stopping at EOS, at ``</tool>`` (if a call is still
        allowed) or after its budget of tokens."""
        result: dict[int, list[int]] = {}
        # rows sharing a budget and a stop rule run as one batch on the engine
        for budget, call in sorted(set(zip(budgets, may_call))):
            idx = [j for j, key in enumerate(zip(budgets, may_call)) if key == (budget, call)]
            new = super().generate([contexts[j] for j in idx], 1, seed, greedy, budget,
                                   [TOOL_CLOSE] if call else [])  # fmt: skip
            result.update(zip(idx, new))
        return [result[j] for j in range(len(contexts))]


class ToolReward:
    """Wraps the task reward: a completion whose tool call failed scores 0 (its error is in
    `rollout.tool_errors`); the others get the inner reward on their final answer."""

    def __init__(self, inner: Callable[[Rollout], Tensor]):
        self.inner = inner
        self.name = getattr(inner, "name", "reward")

    def __call__(self, rollout: Rollout) -> Tensor:
        rewards = self.inner(rollout)
        failed = [e is not None for e in getattr(rollout, "tool_errors", [])]
        if any(failed):
            rewards = rewards.masked_fill(torch.tensor(failed, device=rewards.device), 0.0)
        return rewards
