"""The OpenAI-compatible HTTP server: FastAPI routes over one Engine that a thread steps.

    app = create_app(Engine.from_lm(lm, max_batch=16), model_name="tiny", api_key="secret")
    uvicorn.Server(guards.uvicorn_config(app, "127.0.0.1", 8000)).run()  # as `lmforge serve`

Every request joins the engine's running batch (`AsyncEngine` below), so concurrent clients are
served together, not one at a time. Streaming uses server-sent events exactly as OpenAI does
(`data: {chunk}` lines, then `data: [DONE]`); a client that disconnects cancels its handler, which
aborts the request and frees its batch slot. Every failure is an OpenAI-style error body
{"error": {"message", "type", "param", "code"}} with a 4xx status for bad input. Host, API key,
body size, read deadlines and the queue limit are checked in guards.py, before any route runs;
a route tokenizes in a worker thread, after checking the prompt's length in characters, so a
long prompt never holds up the event loop.

With `warm_up` (what `lmforge serve` passes unless --no-compile: the engine compiling its
decode step for every batch size, a minute or more per range on a small CPU), the socket
serves at once but /health answers 503 {"status": "warming up"} and the generation routes 503
with Retry-After until the warm-up has finished; only then does the engine start stepping. So a
load balancer or a client polling /health never sends a request that would sit behind the
compiler.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import logging
import sys
import threading
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Annotated, Any

import torch
from fastapi import Body, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, JSONResponse, Response, StreamingResponse
from fastapi.staticfiles import StaticFiles
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException

from lmforge.chat_completion import ChatPlan, ChatRequestError, plan_chat
from lmforge.errors import ConfigError, LMForgeError
from lmforge.infer.engine import Engine, GenerationParams, StepOutput
from lmforge.serve import DEFAULT_MAX_BODY_BYTES, DEFAULT_MAX_QUEUE, DEFAULT_READ_TIMEOUT
from lmforge.serve.embeddings import HiddenStateEmbedder, SentenceEmbedder, embed
from lmforge.serve.guards import Admission, APIError, RequestGuard
from lmforge.serve.metrics import ServerMetrics
from lmforge.serve.responses import ChatFormat, CompletionFormat, EngineFailure, collect, sse_stream
from lmforge.serve.schemas import (
    ChatCompletionRequest,
    CompletionRequest,
    ConversationBody,
    EmbeddingRequest,
    SearchBody,
)
from lmforge.serve.store import ConversationStore

__all__ = ["APIError", "create_app"]

STATIC = Path(__file__).parent / "static"
WARMING_HEADERS = {"Retry-After": "10"}  # seconds: one compile of a range takes a minute or more
log = logging.getLogger(__name__)


class AsyncEngine:
    """Shares one Engine's batch between many concurrent asyncio callers.

    The model runs in a plain thread (PyTorch releases the GIL inside its kernels), so the event
    loop keeps accepting connections and streaming bytes while a step computes. Each step's outputs
    are handed to the loop in one `call_soon_threadsafe` and appended to the request's inbox. A
    consumer takes everything in its inbox at once: when the loop falls behind the engine (many
    clients, each token costing JSON + HTTP work), one chunk carries several tokens instead of the
    loop paying that per-token cost again and again, so per-client overhead shrinks exactly when the
    batch is large, and a lone client still gets every token as soon as it exists. A request whose
    consumer stops early (client disconnect -> task cancelled) is aborted, which frees its batch
    slot at the next step. An exception inside a step fails only the requests running at that moment
    (`EngineFailure`); the thread resets the engine and keeps serving.
    """

    def __init__(self, engine: Engine):
        self.engine = engine
        self._inboxes: dict[str, asyncio.Queue] = {}  # request id -> its pending outputs
        self._wake = threading.Event()
        self._running = False
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._ids = itertools.count()

    def start(self) -> None:
        """Start the stepping thread (call from inside the running event loop, once)."""
        self._loop = asyncio.get_running_loop()
        self._running = True
        self._thread = threading.Thread(target=self._run, name="lmforge-engine", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._running = False
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
            self._thread = None

    @torch.inference_mode()  # once for the thread, not per step
    def _run(self) -> None:
        engine = self.engine
        while self._running:
            if not engine.has_work():
                self._wake.wait(timeout=0.5)
                self._wake.clear()
                continue
            try:
                outputs = [(out.request_id, out) for out in engine.step()]
            except Exception as err:  # keep serving: fail the running requests, start clean
                log.exception("engine step failed")
                failed = {s.request_id for s in [*engine.rows, *engine.waiting]}
                engine.reset()
                outputs = [(rid, EngineFailure(f"generation failed: {err}")) for rid in failed]
            if outputs:
                self._loop.call_soon_threadsafe(self._dispatch, outputs)

    def _dispatch(self, outputs: list[tuple[str, StepOutput | EngineFailure]]) -> None:
        for rid, out in outputs:
            if (inbox := self._inboxes.get(rid)) is not None:
                inbox.put_nowait(out)

    async def generate(
        self, prompt: str | Sequence[int], params: GenerationParams, n: int = 1
    ) -> AsyncIterator[list[StepOutput]]:
        """Outputs of all n samples of one request until every one finished, in lists: each
        list is everything produced since the consumer last asked (in order, samples mixed).

        Raises ConfigError (bad prompt/params) before anything is queued.
        """
        rid = f"req-{next(self._ids)}"
        self.engine.add_request(prompt, params, n, request_id=rid)
        # Outputs reach inboxes through callbacks on this event loop, which cannot run before
        # the next await: the inbox made now misses none of them.
        inbox = self._inboxes[rid] = asyncio.Queue()
        self._wake.set()
        remaining = n
        try:
            while remaining:
                outs = [await inbox.get()]  # wait for one, then take all that is there
                while not inbox.empty():
                    outs.append(inbox.get_nowait())
                failure = next((o for o in outs if isinstance(o, Exception)), None)
                if failure is not None:
                    raise failure
                remaining -= sum(out.finished for out in outs)
                yield outs
        finally:
            self._inboxes.pop(rid, None)
            if remaining:
                self.engine.abort(rid)
                self._wake.set()


def as_api_error(err: Exception) -> APIError:
    """Any exception a route raised, as the OpenAI-style error the client gets."""
    if isinstance(err, APIError):
        return err
    if isinstance(err, RequestValidationError):
        first = err.errors()[0] if err.errors() else {}
        if first.get("type") == "json_invalid":
            return APIError(400, "malformed JSON body")
        msg = first.get("msg", "invalid request")
        loc = [str(p) for p in first.get("loc", ()) if p != "body"]
        param = ".".join(loc) or first.get("ctx", {}).get("param")
        return APIError(400, f"{param or 'the request body'}: {msg}", param, first.get("type"))
    if isinstance(err, HTTPException):
        kind = "invalid_request_error" if err.status_code < 500 else "server_error"
        return APIError(err.status_code, str(err.detail), type=kind)
    if isinstance(err, LMForgeError):
        return APIError(400, str(err))
    return APIError(500, f"internal error: {type(err).__name__}", type="server_error")


async def _error_response(request: Request, err: Exception) -> Response:
    return as_api_error(err).response()


def max_token_chars(tokenizer) -> int:
    """The longest token's text in the vocabulary (specials included): a text of more than
    `context * this` characters cannot fit the context, so it is refused without tokenizing."""
    vocab = tokenizer.backend.get_vocab(with_added_tokens=True)
    return max((len(t) for t in vocab), default=1)


def pdf_text(data: bytes) -> str:
    """The text of a PDF's pages (pypdf), for an attachment sent as context."""
    try:
        import pypdf
    except ImportError:
        raise APIError(400, "reading PDFs needs pypdf on the server (pip install pypdf); "
                       "attach a text file instead") from None  # fmt: skip
    import io

    try:
        reader = pypdf.PdfReader(io.BytesIO(data))
        return "\n\n".join(page.extract_text() or "" for page in reader.pages)
    except Exception as err:  # a malformed upload: pypdf raises many kinds
        raise APIError(400, f"not a readable PDF ({type(err).__name__})") from None


def create_app(
    engine: Engine,
    model_name: str = "lmforge",
    api_key: str | None = None,
    max_tokens_limit: int | None = None,
    stream_interval: float = 0.02,
    *,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    max_queue: int = DEFAULT_MAX_QUEUE,
    read_timeout: float = DEFAULT_READ_TIMEOUT,
    check_host: bool | None = None,
    warm_up: Callable[[], None] | None = None,
    embedding_model: str | None = None,
    history: str | Path | None = None,
    rag_index: str | Path | None = None,
) -> FastAPI:
    """The FastAPI app serving `engine` (which must have a tokenizer). A stream sends at most
    one chunk per `stream_interval` seconds (with all the tokens made meanwhile); 0 sends one
    chunk per token.

    Guards (guards.py): request bodies over `max_body_bytes` get 413, bodies that take longer
    than `read_timeout` seconds to arrive 408, and past `max_queue` samples waiting for a batch
    slot requests get 429. `check_host` (default: when there is no `api_key`) refuses Host
    headers other than localhost/127.0.0.1/[::1]; pass False when serving a non-loopback
    address without a key.

    `warm_up` runs in a background thread when the server starts (e.g. `engine.warm_up`);
    until it returns, /health and the generation routes answer 503 and the engine does not
    step. If it raises, the error is printed and the engine serves as it is (uncompiled
    ranges then compile on first use).

    /v1/embeddings embeds with `embedding_model` (a sentence-transformers folder or
    'all-MiniLM-L6-v2') when given, else with the served model's pooled hidden states
    (serve/embeddings.py). /metrics serves Prometheus metrics (serve/metrics.py).
    /api/conversations keeps the chat page's conversations in the SQLite file `history`
    (serve/store.py; None: in memory, for this process only). With `rag_index` (a folder
    written by `lmforge rag index`), /api/rag/search returns its passages for the page's
    "answer from my documents" switch."""
    if engine.tokenizer is None:
        raise LMForgeError("serving needs a checkpoint with a tokenizer (tokenizer.json)")
    runner = AsyncEngine(engine)
    limit = min(max_tokens_limit or engine.max_len, engine.max_len)
    tok = engine.tokenizer
    max_chars = engine.max_len * max_token_chars(tok)
    admission = Admission(engine.max_batch, max_queue)
    chat_stop_ids = tok.chat_stop_ids(engine.eos_ids)

    state = {"ready": warm_up is None, "stopping": False}
    metrics = ServerMetrics(engine)
    store = ConversationStore(history if history is not None else ":memory:")
    retriever = None
    if rag_index is not None:
        from lmforge.retrieval.retriever import Retriever

        retriever = Retriever.load(rag_index)
    embedding_name = embedding_model or model_name
    if embedding_model is not None:
        embedder = SentenceEmbedder(embedding_model)
    else:
        embedder = HiddenStateEmbedder(engine.model, tok, engine.max_len)

    def warm(loop: asyncio.AbstractEventLoop) -> None:  # in a daemon thread: exit never waits
        try:
            warm_up()
        except Exception as err:  # reported, then served without: the engine still works
            print(f"warm-up failed ({type(err).__name__}: {err}); serving without it",
                  file=sys.stderr)  # fmt: skip
            engine.reset()  # a failed warm-up request may have left rows behind
        with contextlib.suppress(RuntimeError):  # the loop closed: the server stopped meanwhile
            loop.call_soon_threadsafe(start_serving)

    def start_serving() -> None:  # on the event loop
        if not state["stopping"]:
            runner.start()
            state["ready"] = True
            print("ready: warm-up finished", flush=True)

    @asynccontextmanager
    async def lifespan(app):
        if warm_up is None:
            runner.start()
        else:
            loop = asyncio.get_running_loop()
            threading.Thread(target=warm, args=(loop,), name="lmforge-warm-up",
                             daemon=True).start()  # fmt: skip
        yield
        state["stopping"] = True
        runner.stop()
        store.close()

    app = FastAPI(title="lmforge", version="1", lifespan=lifespan)
    for kind in (APIError, RequestValidationError, HTTPException, LMForgeError, Exception):
        app.add_exception_handler(kind, _error_response)
    app.state.engine, app.state.admission = runner, admission
    if check_host is None:  # with a key, a rebinding page cannot call anything anyway
        check_host = api_key is None
    app.add_middleware(RequestGuard, api_key=api_key, check_host=check_host,
                       max_body_bytes=max_body_bytes, read_timeout=read_timeout,
                       admission=admission)  # fmt: skip

    def encode(text: str, field: str) -> list[int]:
        """Token ids of a prompt (run in a worker thread); a text too long to possibly fit the
        context is refused on its length alone, without the cost of tokenizing it."""
        if len(text) > max_chars:
            message = (f"the prompt has {len(text)} characters, more than a {engine.max_len}-"
                       "token context can hold")  # fmt: skip
            raise APIError(400, message, field, "context_length_exceeded")
        return tok.encode(text)

    def check_request(name: str | None) -> None:
        """503 while warming up; 404 for a model this server does not have."""
        if not state["ready"]:
            message = "the server is warming up (compiling the decode step); retry shortly"
            raise APIError(503, message, None, "warming_up", "server_error", WARMING_HEADERS)
        if name is not None and name != model_name:
            raise APIError(404, f"model {name!r} does not exist; this server has {model_name!r}",
                           "model", "model_not_found")  # fmt: skip

    def params_for(req, ids, max_tokens: int | None, default: int, logprobs, stop_ids, field):
        if len(ids) == 0:
            raise APIError(400, "the prompt is empty", field)
        if len(ids) >= engine.max_len:
            message = f"the prompt has {len(ids)} tokens; the context is {engine.max_len}"
            raise APIError(400, message, field, "context_length_exceeded")
        if max_tokens is not None and max_tokens > limit:
            raise APIError(400, f"max_tokens must be <= {limit}, got {max_tokens}", "max_tokens")
        return GenerationParams(
            max_new_tokens=max_tokens or min(default, limit),
            temperature=req.temperature, top_k=req.top_k, seed=req.seed,
            top_p=None if req.top_p == 1 else req.top_p,  # 1 keeps all: skip the sort
            stop=req.stop or [], stop_token_ids=stop_ids, repetition_penalty=req.repetition_penalty,
            presence_penalty=req.presence_penalty, frequency_penalty=req.frequency_penalty,
            logprobs=logprobs,
        )  # fmt: skip

    async def respond(request: Request, req, ids, params, fmt):
        admission.admit(request.scope, req.n)  # given back by RequestGuard when this ends
        endpoint = "chat" if isinstance(fmt, ChatFormat) else "completions"
        outputs = metrics.metered(runner.generate(ids, params, req.n), len(ids), endpoint)
        usage = req.stream_options.include_usage if req.stream_options else False
        if req.stream:
            return StreamingResponse(
                sse_stream(outputs, fmt, req.n, usage, stream_interval),
                media_type="text/event-stream", headers={"Cache-Control": "no-cache"},
            )  # fmt: skip
        task = asyncio.ensure_future(collect(outputs, fmt, req.n))
        while not task.done():  # a client that hangs up frees its slots
            await asyncio.wait({task}, timeout=0.5)
            if not task.done() and await request.is_disconnected():
                task.cancel()
                raise APIError(499, "client disconnected")
        return task.result()

    @app.get("/health")
    async def health():
        if not state["ready"]:
            return JSONResponse({"status": "warming up"}, status_code=503, headers=WARMING_HEADERS)
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models():
        names = [model_name] + ([embedding_name] if embedding_name != model_name else [])
        cards = [{"id": n, "object": "model", "created": 0, "owned_by": "lmforge"} for n in names]
        return {"object": "list", "data": cards}

    @app.get("/metrics", include_in_schema=False)
    async def prometheus_metrics():
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.post("/v1/embeddings")
    async def embeddings(req: EmbeddingRequest):
        if req.model is not None and req.model not in (model_name, embedding_name):
            raise APIError(404, f"model {req.model!r} does not exist; embeddings come from "
                           f"{embedding_name!r}", "model", "model_not_found")  # fmt: skip
        if isinstance(req.input, str) and len(req.input) > max_chars:
            raise APIError(400, "input is longer than the context can hold", "input",
                           "context_length_exceeded")  # fmt: skip
        try:
            data, tokens = await asyncio.to_thread(embed, embedder, req.input, req.encoding_format)
        except ConfigError as err:
            raise APIError(400, str(err), "input") from None
        usage = {"prompt_tokens": tokens, "total_tokens": tokens}
        return {"object": "list", "data": data, "model": embedding_name, "usage": usage}

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, request: Request):
        check_request(req.model)
        text = req.prompt if isinstance(req.prompt, str) else req.prompt[0]
        ids = await asyncio.to_thread(encode, text, "prompt")
        params = params_for(req, ids, req.max_tokens, 16, req.logprobs, None, "prompt")
        fmt = CompletionFormat(tok, model_name, len(ids), req.logprobs)
        return await respond(request, req, ids, params, fmt)

    @functools.cache  # built on first use: it reads the whole vocabulary once
    def grammars_for():
        from lmforge.infer.structured import Grammars

        return Grammars(tok, engine.config.vocab_size, chat_stop_ids)

    def plan_for(req: ChatCompletionRequest) -> ChatPlan:
        """The turn's prompt and grammar (in a worker thread: templates, grammar compiles)."""
        body = req.model_dump(by_alias=True, exclude_none=True)
        try:
            return plan_chat(
                tok, grammars_for, body["messages"], tools=body.get("tools", []),
                tool_choice=body.get("tool_choice"), response_format=body.get("response_format"),
                parallel_tool_calls=req.parallel_tool_calls,
            )  # fmt: skip
        except ChatRequestError as err:
            raise APIError(400, str(err), err.param) from None

    @app.post("/v1/chat/completions")
    async def chat_completions(req: ChatCompletionRequest, request: Request):
        check_request(req.model)
        plan = await asyncio.to_thread(plan_for, req)
        ids = await asyncio.to_thread(encode, plan.prompt, "messages")
        max_tokens = req.max_completion_tokens or req.max_tokens
        top = (req.top_logprobs or 0) if req.logprobs else None
        params = params_for(req, ids, max_tokens, limit, top, chat_stop_ids, "messages")
        params.constraint = plan.constraint
        fmt = ChatFormat(tok, model_name, len(ids), top, plan)
        return await respond(request, req, ids, params, fmt)

    @app.get("/api/info")
    async def info():
        """What the chat page shows: the model's name and whether documents can be searched."""
        return {"model": model_name, "rag": retriever is not None, "max_tokens": limit,
                "embedding_model": embedding_name}  # fmt: skip

    @app.post("/api/rag/search")
    async def rag_search(body: SearchBody):
        if retriever is None:
            raise APIError(404, "no document index: start the server with --rag INDEX")
        mode = "hybrid" if "hybrid" in retriever.modes else "bm25"  # BM25-only indexes too
        hits = await asyncio.to_thread(retriever.search, body.query, body.k, mode)
        passages = [
            {"n": i + 1, "title": h.chunk.title, "source": h.chunk.source, "text": h.chunk.text,
             "score": h.score}
            for i, h in enumerate(hits)
        ]  # fmt: skip
        return {"passages": passages}

    @app.post("/api/extract")
    async def extract(request: Request):
        """The text of an attached PDF (needs `pip install pypdf`)."""
        data = await request.body()
        return {"text": await asyncio.to_thread(pdf_text, data)}

    # The conversation routes are plain functions: FastAPI runs them in its thread pool, so a
    # slow disk never holds up the event loop.
    @app.get("/api/conversations")
    def list_conversations():
        return {"conversations": store.list()}

    @app.post("/api/conversations")
    def create_conversation(body: ConversationBody):
        return store.save(body.title, body.data)

    @app.get("/api/conversations/export")
    def export_conversations():
        return store.export()

    @app.post("/api/conversations/import")
    def import_conversations(document: Annotated[Any, Body()]):
        return {"imported": store.import_(document)}

    @app.get("/api/conversations/{conversation_id}")
    def get_conversation(conversation_id: str):
        found = store.get(conversation_id)
        if found is None:
            raise APIError(404, f"no conversation {conversation_id!r}", "conversation_id")
        return found

    @app.put("/api/conversations/{conversation_id}")
    def put_conversation(conversation_id: str, body: ConversationBody):
        return store.save(body.title, body.data, conversation_id)

    @app.delete("/api/conversations/{conversation_id}")
    def delete_conversation(conversation_id: str):
        if not store.delete(conversation_id):
            raise APIError(404, f"no conversation {conversation_id!r}", "conversation_id")
        return {"deleted": conversation_id}

    @app.get("/", include_in_schema=False)
    async def index():
        return FileResponse(STATIC / "index.html")

    app.mount("/static", StaticFiles(directory=STATIC), name="static")
    return app
