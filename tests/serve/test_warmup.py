"""`lmforge serve --compile` compiles before it reports ready, and a restart reuses the compiled
steps: /health and the generation routes answer 503 while the warm-up runs, the warm-up covers
every batch-size range the engine can run, the first request compiles nothing, and a second
engine over the same weights loads the compiled step from the cache folder instead of
compiling (counted by wrapping torch's AOTInductor entry points, not by timing)."""

import threading
import time

import pytest
import requests
import torch

from lmforge.infer import steps
from lmforge.infer.engine import Engine, GenerationParams
from lmforge.infer.steps import ExportedStep
from lmforge.lm import LM
from lmforge.model.config import ModelConfig
from lmforge.serve.app import create_app
from lmforge.tokenizer import Tokenizer

WORDS = "the cat sat on the mat and the dog ran to the park. " * 20
GREEDY = GenerationParams(max_new_tokens=5, temperature=0.0, stop_token_ids=[])


def _one_layer_lm() -> LM:
    """A one-layer model with a tokenizer: compiling it costs what any model's C++ costs, but no
    more (the time goes to the C++ compiler, not the model's size)."""
    tok = Tokenizer.train_bpe([WORDS], vocab_size=280)
    config = ModelConfig.from_preset("llama-micro", vocab_size=tok.vocab_size, max_seq_len=32,
                                     n_layer=1)  # fmt: skip
    return LM.from_config(config, tokenizer=tok, seed=0)


def _wait_ready(url: str, seconds: float = 600) -> None:
    deadline = time.time() + seconds
    while requests.get(f"{url}/health").status_code != 200:
        assert time.time() < deadline, "the server never became ready"
        time.sleep(0.05)


def _complete(url: str) -> requests.Response:
    body = {"prompt": "the cat", "max_tokens": 4, "temperature": 0}
    return requests.post(f"{url}/v1/completions", json=body)


def test_health_and_routes_answer_503_until_the_warm_up_returns(make_engine, live_server):
    engine = make_engine()
    release, entered = threading.Event(), threading.Event()

    def warm_up() -> None:  # held until the test has looked at the warming server
        entered.set()
        assert release.wait(60)

    live = live_server(create_app(engine, "tiny", warm_up=warm_up))
    assert entered.wait(30)
    health = requests.get(f"{live.url}/health")
    assert health.status_code == 503 and health.json() == {"status": "warming up"}
    assert health.headers["Retry-After"].isdigit()
    refused = _complete(live.url)
    assert refused.status_code == 503 and refused.json()["error"]["code"] == "warming_up"
    assert "Retry-After" in refused.headers
    release.set()
    _wait_ready(live.url, 30)
    reply = _complete(live.url)
    assert reply.status_code == 200 and reply.json()["choices"][0]["finish_reason"] == "length"


def test_a_failed_warm_up_is_reported_and_the_server_still_serves(make_engine, live_server,
                                                                   capsys):  # fmt: skip
    def warm_up() -> None:
        raise RuntimeError("no compiler here")

    live = live_server(create_app(make_engine(), "tiny", warm_up=warm_up))
    _wait_ready(live.url, 30)
    assert _complete(live.url).status_code == 200
    assert "warm-up failed (RuntimeError: no compiler here)" in capsys.readouterr().err


def test_warm_up_compiles_every_range_of_rows_once(monkeypatch):
    """The ranges an export holds for come from the model (Int8Linear switches kernels at 8
    rows); warm-up asks for a step at the first size each range leaves uncovered, up to
    max_batch, and afterwards no batch size from 1 to max_batch compiles anything. The
    compiler is replaced by one that reports those ranges and runs the step eagerly."""
    asked: list[int] = []

    def compile_fake(self, ids, positions, key_mask):
        asked.append(ids.shape[0])
        rows = next(r for r in (range(1, 2), range(2, 8), range(8, 2**62)) if ids.shape[0] in r)
        return rows, range(2, 10**6), lambda flat: list(self.step(*flat[:3], self.cache.k,
                                                                  self.cache.v))  # fmt: skip

    monkeypatch.setattr(ExportedStep, "_compile", compile_fake)
    lm = _one_layer_lm()
    engine = Engine.from_lm(lm, max_batch=10, compile=True)
    lines: list[str] = []
    engine.warm_up(progress=lines.append)
    assert asked == [1, 2, 8]
    assert sum("compiling the decode step" in line for line in lines) == 3
    assert any("rows 8-10" in line for line in lines)
    eager = Engine.from_lm(lm, max_batch=10)
    for n in (1, 3, 10):
        prompts = [[1 + i, 2, 3] for i in range(n)]
        got = [c.token_ids for c in engine.generate(prompts, GREEDY)]
        assert got == [c.token_ids for c in eager.generate(prompts, GREEDY)]
    assert asked == [1, 2, 8]


@pytest.mark.slow
def test_served_compile_happens_before_ready_and_a_restart_loads_it(tmp_path, live_server,
                                                                    monkeypatch):  # fmt: skip
    """Real AOTInductor compiles (one range: max_batch 1). ~30 s on a quiet 2-core machine,
    about two minutes under heavy load: all of it is the C++ compiler."""
    calls = {"compile": 0, "load": 0}
    real_compile = torch._inductor.aoti_compile_and_package
    real_load = steps._load

    def counting_compile(*args, **kwargs):
        calls["compile"] += 1
        return real_compile(*args, **kwargs)

    def counting_load(*args, **kwargs):
        calls["load"] += 1
        return real_load(*args, **kwargs)

    monkeypatch.setattr(torch._inductor, "aoti_compile_and_package", counting_compile)
    monkeypatch.setattr(steps, "_load", counting_load)
    lm = _one_layer_lm()
    want = Engine.from_lm(lm, max_batch=1).generate([[5, 6, 7, 8]], GREEDY)[0].token_ids
    cache = tmp_path / "compile"

    engine = Engine.from_lm(lm, max_batch=1, compile=True)
    seen_when_ready, health_while_compiling, started = {}, [], threading.Event()
    where = {}

    def progress(line: str) -> None:  # called before each range compiles: ask the server
        if line.startswith("compiling"):
            assert started.wait(30)
            health_while_compiling.append(requests.get(f"{where['url']}/health").status_code)

    def warm_up() -> None:
        engine.warm_up(progress=progress, cache_dir=cache)
        seen_when_ready.update(calls)

    live = live_server(create_app(engine, "tiny", warm_up=warm_up))
    where["url"] = live.url
    started.set()
    _wait_ready(live.url)
    assert health_while_compiling == [503]
    assert seen_when_ready == {"compile": 1, "load": 1}  # compiled (then loaded) before ready
    assert engine.decode_step.counts == {"compiled": 1, "loaded": 0}  # not the eager fallback
    assert _complete(live.url).status_code == 200
    assert engine.generate([[5, 6, 7, 8]], GREEDY)[0].token_ids == want
    assert calls == {"compile": 1, "load": 1}  # the requests compiled nothing
    assert len(list(next(cache.iterdir()).glob("*.pt2"))) == 1

    again = Engine.from_lm(lm, max_batch=1, compile=True)
    again.warm_up(progress=lambda line: None, cache_dir=cache)
    assert again.decode_step.dir == engine.decode_step.dir  # the same key
    assert calls == {"compile": 1, "load": 2}  # the cache hit: loaded, not compiled
    assert again.decode_step.counts == {"compiled": 0, "loaded": 1}
    assert again.generate([[5, 6, 7, 8]], GREEDY)[0].token_ids == want
    assert calls == {"compile": 1, "load": 2}

    # other weights of the same shapes share the key (the library reads the model's own
    # tensors, it holds none) and decode their own tokens, never the first model's; the same
    # weights in another precision are another key
    folder = again.decode_step.dir
    other = LM.from_config(lm.config, tokenizer=lm.tokenizer, seed=1)
    theirs = Engine.from_lm(other, max_batch=1).generate([[5, 6, 7, 8]], GREEDY)[0].token_ids
    assert theirs != want
    shared = Engine.from_lm(other, max_batch=1, compile=True)
    shared.warm_up(progress=lambda line: None, cache_dir=cache)
    assert shared.decode_step.dir == folder and calls == {"compile": 1, "load": 3}
    assert shared.generate([[5, 6, 7, 8]], GREEDY)[0].token_ids == theirs
    bf16 = Engine.from_lm(lm, max_batch=1, compile=True, dtype="bfloat16").decode_step
    assert bf16.use_cache_dir(cache) != folder
    assert calls == {"compile": 1, "load": 3}
