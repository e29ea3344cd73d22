"""OpenAI-compatible HTTP server over one `LLM`.

One background thread owns the engine: it admits new requests, runs `engine.step()` while there is work
(continuous batching: every in-flight request shares the running batch) and publishes each request's new
text to that request's asyncio queue with `loop.call_soon_threadsafe`. HTTP handlers never step the engine
and never take the engine lock, so a long decoding round does not stall the event loop.

Endpoints: POST /v1/completions, POST /v1/chat/completions, GET /v1/models, GET /health, GET /metrics.
Extensions to the OpenAI schema: request fields `top_k`, `ignore_eos`, `stop_token_ids`; response field
`ssd_metrics` (per-request decoding metrics) and `token_ids` on each choice.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from starlette.exceptions import HTTPException as StarletteHTTPException

from ssd.engine import TargetLost
from ssd.sampling_params import SamplingParams, is_int
from ssd.sequence import Sequence, Status, stable_text_len

log = logging.getLogger("ssd.server")

MAX_PROMPTS_PER_REQUEST = 256
_SAMPLING_FIELDS = (
    "temperature", "top_p", "top_k", "max_tokens", "seed", "stop", "stop_token_ids", "ignore_eos",
)


# -- errors ----------------------------------------------------------------------------------------
class APIError(Exception):
    def __init__(
        self, status: int, message: str, param: str | None = None, code: str | None = None,
        type_: str = "invalid_request_error",
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = status, message, param, code, type_
        self.counted = False  # already recorded in the request metrics

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def _error_response(status: int, message: str, param: str | None = None, code: str | None = None,
                    type_: str | None = None, headers: dict[str, str] | None = None) -> JSONResponse:
    type_ = type_ or ("invalid_request_error" if status < 500 else "server_error")
    return JSONResponse(APIError(status, message, param, code, type_).body(), status_code=status, headers=headers)


# -- the engine thread -----------------------------------------------------------------------------
@dataclass(eq=False)
class Track:
    """One sequence being served: where to send its events, and what has been sent so far."""

    seq: Sequence
    index: int
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    sent_text: str = ""
    sent_ids: int = 0
    done: bool = False
    error: str | None = None
    t_submit: float = field(default_factory=time.perf_counter)

    def emit(self, event: tuple) -> None:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, event)
        except RuntimeError:  # the event loop is closed: nobody is listening any more
            pass


class EngineLoop:
    """Steps the engine on a background thread while there is work."""

    def __init__(self, llm: Any, stats_interval_s: float = 0.25) -> None:
        self.llm = llm
        self.engine = llm.engine
        self.stats_interval_s = stats_interval_s
        self._cv = threading.Condition()
        self._inbox: list[Track] = []
        self._aborts: list[Track] = []
        self._live: dict[int, Track] = {}  # engine thread only
        self._stop = False
        self._thread: threading.Thread | None = None
        self._last_stats = 0.0
        self.stats: dict = {}  # snapshot of llm.stats(), refreshed from the engine thread
        self.running = 0
        self.waiting = 0
        self.peak_running = 0  # most sequences ever decoded in one batch (continuous batching at work)
        self.steps = 0
        self.step_errors = 0

    # -- called from the event loop ------------------------------------------------------------
    def start(self) -> None:
        self._refresh_stats(force=True)
        self._thread = threading.Thread(target=self._run, name="ssd-engine", daemon=True)
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def submit(self, tracks: list[Track]) -> None:
        with self._cv:
            if self._stop or not self.alive:
                raise APIError(503, "server is shutting down", type_="server_error")
            self._inbox.extend(tracks)
            self._cv.notify()

    def abort(self, track: Track) -> None:
        if track.done:
            return
        with self._cv:
            if track in self._inbox:  # never reached the engine
                self._inbox.remove(track)
                track.done = True
                return
            self._aborts.append(track)
            self._cv.notify()

    def stop(self, timeout: float = 30.0) -> None:
        with self._cv:
            self._stop = True
            self._cv.notify()
        if self._thread is not None:
            self._thread.join(timeout)
        # The engine thread is gone: fail whatever is left so no handler waits forever.
        leftovers = list(self._live.values()) + self._inbox + self._aborts
        self._inbox, self._aborts = [], []
        for t in leftovers:
            if t.done:
                continue
            try:
                if not t.seq.finished:
                    self.engine.abort(t.seq)
            except Exception:  # noqa: BLE001 - best effort at shutdown
                pass
            self._fail(t, "server is shutting down")
        self._live.clear()

    # -- engine thread -------------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            with self._cv:
                while not (self._stop or self._inbox or self._aborts or self.engine.has_work):
                    self._cv.wait(timeout=1.0)
                if self._stop:
                    return
                new, aborts = self._inbox, self._aborts
                self._inbox, self._aborts = [], []
            try:
                self._iteration(new, aborts)
            except Exception as e:  # noqa: BLE001 - keep serving; fail what was in flight
                log.exception("engine loop error", extra={"fields": {"error": repr(e)}})
                for t in list(self._live.values()):
                    try:
                        if not t.seq.finished:
                            self.engine.abort(t.seq)
                    except Exception:  # noqa: BLE001
                        pass
                    self._fail(t, f"engine error: {type(e).__name__}: {e}")
                self._live.clear()
                time.sleep(0.05)

    def _iteration(self, new: list[Track], aborts: list[Track]) -> None:
        eng = self.engine
        for t in new:
            self._live[t.seq.seq_id] = t
            eng.add(t.seq)
        for t in aborts:
            if t.done:
                continue
            try:
                eng.abort(t.seq)
            except Exception:  # noqa: BLE001
                log.exception("abort failed", extra={"fields": {"seq": t.seq.seq_id}})
            self._live.pop(t.seq.seq_id, None)
            t.done = True
        if eng.has_work:
            try:
                eng.step()
                self.steps += 1
            except Exception as e:  # noqa: BLE001 - one bad round must not take the server down
                self.step_errors += 1
                log.exception("engine step failed", extra={"fields": {"error": repr(e)}})
                self._fail_running(f"engine error: {type(e).__name__}: {e}")
        self._publish()
        self.running = len(eng.scheduler.running)
        self.waiting = len(eng.scheduler.waiting)
        self.peak_running = max(self.peak_running, self.running)
        self._refresh_stats(force=not eng.has_work)

    def _fail_running(self, message: str) -> None:
        """After a failed round: every sequence that was in the batch (or failed admission) is lost."""
        for t in list(self._live.values()):
            seq = t.seq
            if seq.status is Status.RUNNING or seq.finish_reason == "error":
                try:
                    self.engine.abort(seq)
                except Exception:  # noqa: BLE001
                    pass
                seq.finish_reason = "error"
                self._live.pop(seq.seq_id, None)
                self._fail(t, message)

    @staticmethod
    def _fail(t: Track, message: str) -> None:
        t.done = True
        t.error = message
        t.emit(("error", t.index, message))

    def _publish(self) -> None:
        text_mode = self.engine.tokenizer is not None
        for sid, t in list(self._live.items()):
            seq = t.seq
            if seq.error is not None:  # e.g. its admission failed: an error, not a finished completion
                del self._live[sid]
                self._fail(t, f"request failed: {seq.error}")
                continue
            fin = seq.finished
            text = seq.text
            upto = len(text) if fin else stable_text_len(text, seq.params.stop)
            n_sent = len(t.sent_text)
            delta = text[n_sent:upto] if upto > n_sent else ""
            ids = seq.output_ids[t.sent_ids:]
            # With a tokenizer, a chunk goes out when there is new text (ids ride along with it); without
            # one (token-id prompts on a bare checkpoint) the ids are the output.
            if delta or (ids and (fin or not text_mode)):
                t.sent_text += delta
                t.sent_ids += len(ids)
                t.emit(("delta", t.index, delta, list(ids)))
            if fin:
                del self._live[sid]
                t.done = True
                t.emit(("done", t.index))

    def _refresh_stats(self, force: bool = False) -> None:
        now = time.perf_counter()
        if not force and now - self._last_stats < self.stats_interval_s:
            return
        self._last_stats = now
        try:
            self.stats = dict(self.llm.stats())
        except Exception:  # noqa: BLE001 - stats are best effort
            log.debug("stats failed", exc_info=True)


# -- metrics ---------------------------------------------------------------------------------------
class _EngineCollector:
    def __init__(self, loop: EngineLoop, model: str) -> None:
        self.loop, self.model = loop, model

    def collect(self):
        st = self.loop.stats
        for name, key, doc in (
            ("ssd_acceptance_rate", "acceptance_rate", "Fraction of drafted tokens accepted."),
            ("ssd_tau", "tau", "Mean tokens emitted per decoding round of one sequence."),
            ("ssd_cache_hit_rate", "cache_hit_rate", "SSD speculation-cache hit rate (NaN if n/a)."),
            ("ssd_engine_tokens_per_second", "tokens_per_s", "Emitted tokens per second of engine time."),
        ):
            v = st.get(key)
            g = GaugeMetricFamily(name, doc)
            g.add_metric([], float("nan") if v is None else float(v))
            yield g
        pol = CounterMetricFamily("ssd_policy_choices", "Rounds decided by each speculation policy.",
                                  labels=["policy"])
        for k, v in (st.get("policy") or {}).items():
            pol.add_metric([str(k)], float(v))
        yield pol
        cache = CounterMetricFamily("ssd_cache_outcomes", "SSD rounds by what the verified speculation came from "
                                    "(primary, neural or fast backup) and whether the outcome cache held the next "
                                    "round.", labels=["source", "result"])
        for source, counts in (st.get("cache_by_source") or {}).items():
            cache.add_metric([str(source), "hit"], float(counts["hits"]))
            cache.add_metric([str(source), "miss"], float(counts["misses"]))
        yield cache
        rounds = CounterMetricFamily("ssd_engine_rounds", "Decoding rounds run by the engine.")
        rounds.add_metric([], float(st.get("rounds") or 0))
        yield rounds
        for name, val, doc in (
            ("ssd_running_requests", self.loop.running, "Sequences in the running batch."),
            ("ssd_waiting_requests", self.loop.waiting, "Sequences waiting for a batch slot."),
        ):
            g = GaugeMetricFamily(name, doc)
            g.add_metric([], float(val))
            yield g
        info = GaugeMetricFamily("ssd_info", "Served model and decoding mode.", labels=["model", "mode", "k"])
        info.add_metric([self.model, str(st.get("mode", "")), str(st.get("k", ""))], 1.0)
        yield info


class Metrics:
    def __init__(self, loop: EngineLoop, model: str) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("ssd_requests", "HTTP requests by endpoint and status code.",
                                ["endpoint", "status"], registry=r)
        self.prompt_tokens = Counter("ssd_prompt_tokens", "Prompt tokens of completed requests.", registry=r)
        self.generation_tokens = Counter("ssd_generation_tokens", "Generated tokens of completed requests.",
                                         registry=r)
        buckets = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
        self.latency = Histogram("ssd_request_latency_seconds", "End-to-end request latency.",
                                 ["endpoint"], buckets=buckets, registry=r)
        self.ttft = Histogram("ssd_time_to_first_token_seconds", "Time to first generated token.",
                              ["endpoint"], buckets=buckets, registry=r)
        r.register(_EngineCollector(loop, model))

    def render(self) -> bytes:
        return generate_latest(self.registry)


# -- request parsing -------------------------------------------------------------------------------
MAX_BODY_BYTES = 16 << 20  # a request body larger than this is refused (413) before it is read whole


async def _json_body(request: Request, max_bytes: int = MAX_BODY_BYTES) -> dict:
    too_large = APIError(413, f"the request body is larger than {max_bytes} bytes")
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > max_bytes:
        raise too_large
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > max_bytes:
            raise too_large
        chunks.append(chunk)
    try:
        body = json.loads(b"".join(chunks))
    except (ValueError, RecursionError) as e:  # JSONDecodeError, bad UTF-8, a huge integer, deep nesting
        raise APIError(400, f"malformed JSON body: {type(e).__name__}: {str(e)[:200]}") from None
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object")
    return body


IDLE_CHECK_S = 1.0  # a request with no news for this long checks that its client is still there
DISCONNECT_CHECK_S = 1.0  # and one receiving tokens, at most this often

# OpenAI fields that would change the output, accepted only at their "off" values (None: absent).
_UNSUPPORTED_FIELDS: dict[str, tuple] = {
    "logprobs": (None, False),  # and not 0 (below): legacy completions return logprobs at 0
    "top_logprobs": (None, 0),
    "presence_penalty": (None, 0),
    "frequency_penalty": (None, 0),
    "logit_bias": (None, {}),
    "suffix": (None, ""),
    "min_tokens": (None, 0),
    "repetition_penalty": (None, 1),
    "tools": (None, []),
    "functions": (None, []),
    "tool_choice": (None, "none"),
    "function_call": (None, "none"),
}


def _guess_param(message: str) -> str | None:
    first = message.split(" ", 1)[0]
    return first if first in _SAMPLING_FIELDS else None


def _sampling(body: dict, max_tokens_key: tuple[str, ...]) -> tuple[dict, bool]:
    """SamplingParams keyword arguments from an OpenAI body; second value: max_tokens was given."""
    n = body.get("n")
    if n is not None and (not is_int(n) or n != 1):
        raise APIError(400, "only n=1 is supported", param="n")
    best_of = body.get("best_of")
    if best_of is not None and (not is_int(best_of) or best_of != 1):
        raise APIError(400, "best_of is not supported", param="best_of")
    if body.get("echo"):
        raise APIError(400, "echo is not supported", param="echo")
    for key, off in _UNSUPPORTED_FIELDS.items():
        if body.get(key) not in off:
            raise APIError(400, f"{key} is not supported", param=key)
    if body.get("logprobs") == 0 and body.get("logprobs") is not False:  # legacy completions: 0 asks for them
        raise APIError(400, "logprobs is not supported", param="logprobs")
    fmt = body.get("response_format")
    if fmt is not None and fmt != {"type": "text"}:
        raise APIError(400, "response_format is not supported (only {\"type\": \"text\"})", param="response_format")
    kw: dict[str, Any] = {}
    for key in ("temperature", "top_p"):
        v = body.get(key)
        if v is not None:
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                raise APIError(400, f"{key} must be a number, got {v!r}", param=key)
            kw[key] = float(v)
    for key in ("top_k", "seed"):
        v = body.get(key)
        if v is not None:
            if not is_int(v):
                raise APIError(400, f"{key} must be an integer, got {v!r}", param=key)
            kw[key] = v
    if body.get("top_k") == -1:  # vLLM's spelling of "off"
        kw["top_k"] = 0
    given = False
    for key in max_tokens_key:
        v = body.get(key)
        if v is not None:
            if not is_int(v):
                raise APIError(400, f"{key} must be an integer, got {v!r}", param=key)
            kw["max_tokens"] = v
            given = True
            break
    stop = body.get("stop")
    if stop is not None:
        if isinstance(stop, str):
            stop = [stop]
        if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
            raise APIError(400, "stop must be a string or a list of strings", param="stop")
        kw["stop"] = stop
    sti = body.get("stop_token_ids")
    if sti is not None:
        if not isinstance(sti, list) or not all(is_int(t) for t in sti):
            raise APIError(400, "stop_token_ids must be a list of integers", param="stop_token_ids")
        kw["stop_token_ids"] = sti
    if body.get("ignore_eos") is not None:
        if not isinstance(body["ignore_eos"], bool):
            raise APIError(400, "ignore_eos must be a boolean", param="ignore_eos")
        kw["ignore_eos"] = body["ignore_eos"]
    return kw, given


def _stream_flags(body: dict) -> tuple[bool, bool]:
    """(stream, stream_options.include_usage), checked before any request is queued."""
    stream = body.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise APIError(400, f"stream must be a boolean, got {stream!r}", param="stream")
    opts = body.get("stream_options")
    if opts is not None and not isinstance(opts, dict):
        raise APIError(400, f"stream_options must be an object, got {opts!r}", param="stream_options")
    usage = (opts or {}).get("include_usage")
    if usage is not None and not isinstance(usage, bool):
        raise APIError(400, f"stream_options.include_usage must be a boolean, got {usage!r}",
                       param="stream_options")
    return bool(stream), bool(usage)


def _make_params(kw: dict) -> SamplingParams:
    try:
        return SamplingParams(**kw)
    except (ValueError, TypeError) as e:
        raise APIError(400, str(e), param=_guess_param(str(e))) from None


def _completion_prompts(body: dict) -> list[str | list[int]]:
    if "prompt" not in body or body["prompt"] is None:
        raise APIError(400, "missing required field 'prompt'", param="prompt")
    p = body["prompt"]
    if isinstance(p, str):
        return [p]
    if isinstance(p, list) and p:
        if all(is_int(x) for x in p):
            return [p]
        if all(isinstance(x, str) for x in p):
            prompts = list(p)
        elif all(isinstance(x, list) and x and all(is_int(t) for t in x) for x in p):
            prompts = [list(x) for x in p]
        else:
            prompts = []
        if prompts:
            if len(prompts) > MAX_PROMPTS_PER_REQUEST:
                raise APIError(400, f"at most {MAX_PROMPTS_PER_REQUEST} prompts per request", param="prompt")
            return prompts
    raise APIError(
        400,
        "prompt must be a non-empty string, list of token ids, list of strings or list of token-id lists",
        param="prompt",
    )


def _chat_messages(body: dict) -> list[dict]:
    msgs = body.get("messages")
    if msgs is None:
        raise APIError(400, "missing required field 'messages'", param="messages")
    if not isinstance(msgs, list) or not msgs:
        raise APIError(400, "messages must be a non-empty list", param="messages")
    out = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise APIError(400, f"messages[{i}] must be an object with a string 'role'", param="messages")
        content = m.get("content")
        if isinstance(content, list):  # content parts: keep the text ones
            texts = []
            for part in content:
                if not (isinstance(part, dict) and part.get("type") == "text"
                        and isinstance(part.get("text"), str)):
                    raise APIError(400, f"messages[{i}].content: only text parts are supported",
                                   param="messages")
                texts.append(part["text"])
            content = "".join(texts)
        elif content is None:
            content = ""
        elif not isinstance(content, str):
            raise APIError(400, f"messages[{i}].content must be a string or a list of parts",
                           param="messages")
        out.append({**m, "content": content})
    if body.get("tools"):
        raise APIError(400, "tools are not supported", param="tools")
    return out


# -- the app ---------------------------------------------------------------------------------------
def create_app(llm: Any, model_name: str, *, shutdown_llm: bool = False) -> FastAPI:
    """The OpenAI-compatible app. Its lifespan starts/stops the engine thread (and shuts the LLM down
    when `shutdown_llm`)."""
    from contextlib import asynccontextmanager

    engine = llm.engine
    loop_ = EngineLoop(llm)
    metrics = Metrics(loop_, model_name)
    created = int(time.time())

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        loop_.start()
        log.info("engine loop started", extra={"fields": {"model": model_name}})
        try:
            yield
        finally:
            loop_.stop()
            log.info("engine loop stopped")
            if shutdown_llm:
                llm.shutdown()

    app = FastAPI(title="ssd", lifespan=lifespan)
    app.state.engine_loop = loop_
    app.state.metrics = metrics
    app.state.llm = llm

    known = {"/v1/completions", "/v1/chat/completions", "/v1/models"}

    def count(endpoint: str, status: int) -> None:
        # Unknown paths share one label value, so scanners cannot blow up the label set.
        label = endpoint if endpoint in known else "other"
        metrics.requests.labels(endpoint=label, status=str(status)).inc()

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        if not exc.counted:
            count(request.url.path, exc.status)
        if exc.status >= 500:
            log.warning("request failed", extra={"fields": {"path": request.url.path, "status": exc.status,
                                                            "error": exc.message}})
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        count(request.url.path, exc.status_code)
        code = "not_found" if exc.status_code == 404 else None
        return _error_response(exc.status_code, str(exc.detail), code=code, headers=getattr(exc, "headers", None))

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError):
        count(request.url.path, 400)
        return _error_response(400, str(exc.errors()))

    @app.exception_handler(Exception)
    async def _internal_error(request: Request, exc: Exception):
        count(request.url.path, 500)
        log.exception("unhandled error", extra={"fields": {"path": request.url.path}})
        return _error_response(500, f"internal error: {type(exc).__name__}: {exc}")

    def check_model(body: dict) -> None:
        m = body.get("model")
        if m not in (None, "") and m != model_name:
            raise APIError(404, f"the model {m!r} does not exist; this server serves {model_name!r}",
                           param="model", code="model_not_found")

    def make_seq(prompt: str | list[int], params: SamplingParams, param: str):
        try:
            return engine.make_sequence(prompt, params)
        except TargetLost as e:
            raise APIError(503, str(e), type_="server_error") from None
        except ValueError as e:
            msg = str(e)
            code = "context_length_exceeded" if "context" in msg else None
            raise APIError(400, msg, param=param, code=code) from None

    def server_error(message: str) -> APIError:
        err = APIError(500, message, type_="server_error")
        err.counted = True
        return err

    def default_max_tokens(n_prompt: int) -> int:
        return max(1, engine.max_len - n_prompt)

    # -- shared request driver -------------------------------------------------------------------
    async def next_event(queue: asyncio.Queue, request: Request) -> tuple:
        while True:
            try:
                return await asyncio.wait_for(queue.get(), timeout=IDLE_CHECK_S)
            except asyncio.TimeoutError:
                if await request.is_disconnected():
                    raise _ClientGone() from None

    def usage(tracks: list[Track]) -> dict:
        p = sum(len(t.seq.prompt_ids) for t in tracks)
        c = sum(len(t.seq.output_ids) for t in tracks)
        return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}

    def finish(endpoint: str, tracks: list[Track], rid: str, status: int, t0: float) -> None:
        count(endpoint, status)
        dt = time.perf_counter() - t0
        if status == 200:
            u = usage(tracks)
            metrics.prompt_tokens.inc(u["prompt_tokens"])
            metrics.generation_tokens.inc(u["completion_tokens"])
            metrics.latency.labels(endpoint=endpoint).observe(dt)
            for t in tracks:
                ttft = t.seq.metrics.as_dict().get("ttft_s")
                if ttft is not None:
                    metrics.ttft.labels(endpoint=endpoint).observe(ttft)
        m = tracks[0].seq.metrics.as_dict() if tracks else {}
        log.info("request done", extra={"fields": {
            "id": rid, "endpoint": endpoint, "status": status, "latency_s": round(dt, 4),
            **({"usage": usage(tracks), "tau": m.get("tau"), "acceptance_rate": m.get("acceptance_rate")}
               if status == 200 else {}),
        }})

    def start_tracks(seqs: list[Sequence]) -> tuple[list[Track], asyncio.Queue]:
        aloop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        tracks = [Track(seq=s, index=i, loop=aloop, queue=queue) for i, s in enumerate(seqs)]
        loop_.submit(tracks)
        return tracks, queue

    def abort_all(tracks: list[Track]) -> None:
        for t in tracks:
            loop_.abort(t)

    async def run_to_end(endpoint: str, rid: str, tracks: list[Track], queue: asyncio.Queue,
                         request: Request, t0: float) -> bool:
        """Wait for every track to finish (non-streaming). False: the client left (all aborted)."""
        pending = len(tracks)
        check = time.monotonic() + DISCONNECT_CHECK_S
        try:
            while pending:
                ev = await next_event(queue, request)
                # While tokens keep coming next_event never times out: check the client here too.
                if time.monotonic() >= check:
                    if await request.is_disconnected():
                        raise _ClientGone()
                    check = time.monotonic() + DISCONNECT_CHECK_S
                if ev[0] == "done":
                    pending -= 1
                elif ev[0] == "error":
                    abort_all(tracks)
                    finish(endpoint, tracks, rid, 500, t0)
                    raise server_error(ev[2])
        except (_ClientGone, asyncio.CancelledError) as e:
            abort_all(tracks)
            finish(endpoint, tracks, rid, 499, t0)
            if isinstance(e, asyncio.CancelledError):
                raise
            return False
        return True

    def seq_metrics(tracks: list[Track]) -> dict | list[dict]:
        ms = [t.seq.metrics.as_dict() for t in tracks]
        return ms[0] if len(ms) == 1 else ms

    def sse(obj: dict) -> str:
        return f"data: {json.dumps(obj)}\n\n"

    async def stream_events(endpoint: str, rid: str, tracks: list[Track], queue: asyncio.Queue,
                            request: Request, t0: float, first: tuple, render) -> AsyncIterator[str]:
        """SSE body: `render(event)` turns an engine event into chunk dicts; ends with [DONE]."""
        pending = len(tracks)
        status = 200
        ev = first
        try:
            while True:
                if ev[0] == "error":
                    status = 500
                    abort_all(tracks)
                    yield sse(APIError(500, ev[2], type_="server_error").body())
                    break
                for chunk in render(ev):
                    yield sse(chunk)
                if ev[0] == "done":
                    pending -= 1
                    if not pending:
                        for chunk in render(("end",)):
                            yield sse(chunk)
                        break
                ev = await queue.get()
            yield "data: [DONE]\n\n"
        except (asyncio.CancelledError, GeneratorExit):
            status = 499
            raise
        finally:
            if status != 200 or pending:
                abort_all(tracks)
                if status == 200:
                    status = 499
            finish(endpoint, tracks, rid, status, t0)

    async def first_event(endpoint, rid, tracks, queue, request, t0) -> tuple | None:
        """Hold the response until the first token (or error), so an engine error can still be a 500."""
        try:
            ev = await next_event(queue, request)
        except (_ClientGone, asyncio.CancelledError) as e:
            abort_all(tracks)
            finish(endpoint, tracks, rid, 499, t0)
            if isinstance(e, asyncio.CancelledError):
                raise
            return None
        if ev[0] == "error":
            abort_all(tracks)
            finish(endpoint, tracks, rid, 500, t0)
            raise server_error(ev[2])
        return ev

    # -- endpoints -------------------------------------------------------------------------------
    @app.get("/health")
    async def health():
        if not loop_.alive:
            return JSONResponse({"status": "error", "message": "engine thread is not running"},
                                status_code=503)
        lost = getattr(engine, "lost", None)  # the target is gone and could not be replaced
        if lost is not None:
            return JSONResponse({"status": "error", "message": str(lost)}, status_code=503)
        return {"status": "ok", "model": model_name, "running": loop_.running, "waiting": loop_.waiting}

    def model_card() -> dict:
        return {"id": model_name, "object": "model", "created": created, "owned_by": "ssd",
                "max_model_len": engine.max_len}

    @app.get("/v1/models")
    async def models():
        count("/v1/models", 200)
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        if model_id != model_name:
            raise APIError(404, f"the model {model_id!r} does not exist; this server serves {model_name!r}",
                           param="model", code="model_not_found")
        count("/v1/models", 200)
        return model_card()

    @app.get("/metrics")
    async def prom():
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.post("/v1/completions")
    async def completions(request: Request):
        endpoint = "/v1/completions"
        t0 = time.perf_counter()
        body = await _json_body(request)
        check_model(body)
        prompts = _completion_prompts(body)
        kw, _ = _sampling(body, ("max_tokens",))
        kw.setdefault("max_tokens", 16)  # the OpenAI default for completions
        params = _make_params(kw)
        stream, include_usage = _stream_flags(body)
        # Tokenising a long prompt takes a while: off the event loop, which serves the other streams meanwhile
        seqs = await asyncio.to_thread(lambda: [make_seq(p, params, "prompt") for p in prompts])
        rid = f"cmpl-{uuid.uuid4().hex}"
        tracks, queue = start_tracks(seqs)
        base = {"id": rid, "object": "text_completion", "created": int(time.time()), "model": model_name}

        if not stream:
            if not await run_to_end(endpoint, rid, tracks, queue, request, t0):
                return Response(status_code=499)
            finish(endpoint, tracks, rid, 200, t0)
            choices = [{
                "index": t.index, "text": t.seq.text, "logprobs": None, "finish_reason": t.seq.finish_reason,
                "token_ids": list(t.seq.output_ids), "ssd_metrics": t.seq.metrics.as_dict(),
            } for t in tracks]
            return {**base, "choices": choices, "usage": usage(tracks), "ssd_metrics": seq_metrics(tracks)}


        def render(ev: tuple) -> list[dict]:
            if ev[0] == "delta":
                _, i, text, ids = ev
                return [{**base, "choices": [{"index": i, "text": text, "logprobs": None,
                                              "finish_reason": None, "token_ids": ids}]}]
            if ev[0] == "done":
                t = tracks[ev[1]]
                return [{**base, "choices": [{"index": t.index, "text": "", "logprobs": None,
                                              "finish_reason": t.seq.finish_reason}],
                         "ssd_metrics": t.seq.metrics.as_dict()}]
            if ev[0] == "end" and include_usage:
                return [{**base, "choices": [], "usage": usage(tracks), "ssd_metrics": seq_metrics(tracks)}]
            return []

        first = await first_event(endpoint, rid, tracks, queue, request, t0)
        if first is None:
            return Response(status_code=499)
        return StreamingResponse(
            stream_events(endpoint, rid, tracks, queue, request, t0, first, render),
            media_type="text/event-stream", headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        endpoint = "/v1/chat/completions"
        t0 = time.perf_counter()
        body = await _json_body(request)
        check_model(body)
        messages = _chat_messages(body)
        kw, given = _sampling(body, ("max_completion_tokens", "max_tokens"))
        stream, include_usage = _stream_flags(body)
        tok = engine.tokenizer
        if tok is None:
            raise APIError(400, "this model has no tokenizer, so chat is unavailable; use /v1/completions "
                                "with token ids", param="messages")
        try:
            text = tok.apply_chat_template(messages, add_generation_prompt=True)
        except Exception as e:  # template errors (e.g. roles must alternate) are the caller's
            raise APIError(400, f"cannot apply the chat template: {e}", param="messages") from None
        try:
            ids = await asyncio.to_thread(engine.encode, text)
        except ValueError as e:
            raise APIError(400, str(e), param="messages") from None
        if not given:
            kw["max_tokens"] = default_max_tokens(len(ids))
        params = _make_params(kw)
        seq = make_seq(ids, params, "messages")
        seq.prompt_text = text
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        tracks, queue = start_tracks([seq])
        base = {"id": rid, "object": "chat.completion", "created": int(time.time()), "model": model_name}

        if not stream:
            if not await run_to_end(endpoint, rid, tracks, queue, request, t0):
                return Response(status_code=499)
            finish(endpoint, tracks, rid, 200, t0)
            return {**base, "choices": [{
                "index": 0, "message": {"role": "assistant", "content": seq.text}, "logprobs": None,
                "finish_reason": seq.finish_reason, "token_ids": list(seq.output_ids),
            }], "usage": usage(tracks), "ssd_metrics": seq.metrics.as_dict()}

        cbase = {**base, "object": "chat.completion.chunk"}
        started = [False]

        def render(ev: tuple) -> list[dict]:
            out = []
            if not started[0] and ev[0] in ("delta", "done"):
                started[0] = True
                out.append({**cbase, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                                  "logprobs": None, "finish_reason": None}]})
            if ev[0] == "delta" and (ev[2] or ev[3]):
                out.append({**cbase, "choices": [{"index": 0, "delta": {"content": ev[2]}, "logprobs": None,
                                                  "finish_reason": None, "token_ids": ev[3]}]})
            elif ev[0] == "done":
                out.append({**cbase, "choices": [{"index": 0, "delta": {}, "logprobs": None,
                                                  "finish_reason": seq.finish_reason}],
                            "ssd_metrics": seq.metrics.as_dict()})
            elif ev[0] == "end" and include_usage:
                out.append({**cbase, "choices": [], "usage": usage(tracks),
                            "ssd_metrics": seq.metrics.as_dict()})
            return out

        first = await first_event(endpoint, rid, tracks, queue, request, t0)
        if first is None:
            return Response(status_code=499)
        return StreamingResponse(
            stream_events(endpoint, rid, tracks, queue, request, t0, first, render),
            media_type="text/event-stream", headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )

    return app


class _ClientGone(Exception):
    pass
