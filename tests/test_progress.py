"""progress_bar: a tqdm bar on a terminal, plain lines every few seconds in a redirected log."""

import io

from lmforge.progress import PlainProgress, progress_bar


class FakeClock:
    def __init__(self):
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


class TtyStringIO(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_plain_lines_every_interval_and_one_at_the_end():
    out, clock = io.StringIO(), FakeClock()
    bar = PlainProgress(total=100, desc="train", interval=5.0, file=out, clock=clock)
    for step in range(100):
        clock.t = step * 0.5  # 2 steps/s: a line every 10 steps
        bar.update(1)
        bar.set_postfix({"loss": f"{1.0 / (step + 1):.3g}"})
    bar.write("step 100: val 1.5")
    bar.close()
    bar.close()  # idempotent
    text = out.getvalue()
    lines = text.splitlines()
    assert "\r" not in text
    # updates at t = 5.0, 10.0, ..., 45.0 (9 lines), the eval message, the closing line
    assert len(lines) == 11
    assert lines[0].startswith("train: 11/100 it, 2.2 it/s, ")  # 11 steps in 5 s
    assert "left" in lines[0] and "loss=" in lines[1]
    assert lines[-2] == "step 100: val 1.5"
    assert lines[-1].startswith("train: 100/100 it") and "elapsed" in lines[-1]


def test_iteration_and_disable():
    out = io.StringIO()
    assert list(progress_bar(range(3), desc="scoring", file=out)) == [0, 1, 2]
    assert out.getvalue().splitlines() == [out.getvalue().splitlines()[0]]
    assert out.getvalue().startswith("scoring: 3/3 it")
    quiet = io.StringIO()
    with progress_bar(total=5, disable=True, file=quiet) as bar:
        bar.update(5)
        bar.write("x")
    assert quiet.getvalue() == ""


def test_terminal_gets_a_tqdm_bar_and_a_log_does_not():
    from tqdm import tqdm

    assert isinstance(progress_bar(total=1, file=TtyStringIO()), tqdm)
    assert isinstance(progress_bar(total=1, file=io.StringIO()), PlainProgress)
