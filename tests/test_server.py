"""OpenAI-compatible server end to end: a real uvicorn on a free port, tiny models from a tmp HF dir."""

from __future__ import annotations

import json
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import uvicorn
from tiny_hf import write_model_dir

from ssd import LLM, SamplingParams
from ssd.launch.server import create_app, stable_text_len

MODEL = "tiny-coder"
PROMPTS = ["def fib(n):", "hello world", "import os\n", "The quick brown fox", "caf\u00e9 \u65e5\u672c",
           "for i in range(10):", "Speculative", "0123"]
MAX_TOKENS = 16


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    target = write_model_dir(root / "target", seed=0)
    draft = write_model_dir(root / "draft", seed=5)
    # k fixed and small: the disconnect test needs generation still running after two streamed chunks.
    llm = LLM(target=str(target), draft=str(draft), mode="sd", k=2, dtype="float32", max_batch=8, max_len=256)
    greedy = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    expected = {p: o for p, o in zip(PROMPTS, llm.generate(PROMPTS, greedy), strict=True)}
    chat_msgs = [{"role": "user", "content": "write fib"}]
    chat_prompt = llm.tokenizer.apply_chat_template(chat_msgs, add_generation_prompt=True)
    expected_chat = llm.generate([chat_prompt], greedy)[0]

    app = create_app(llm, MODEL)
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    th = threading.Thread(target=server.run, daemon=True)
    th.start()
    deadline = time.time() + 30
    while not server.started:
        assert time.time() < deadline, "server did not start"
        time.sleep(0.05)
    base = f"http://127.0.0.1:{port}"
    yield {"base": base, "llm": llm, "app": app, "expected": expected, "chat_msgs": chat_msgs,
           "expected_chat": expected_chat}
    server.should_exit = True
    th.join(30)
    llm.shutdown()


@pytest.fixture
def http(served):
    with httpx.Client(base_url=served["base"], timeout=60) as c:
        yield c


def test_stable_text_len():
    assert stable_text_len("abc", []) == 3
    assert stable_text_len("ab\ufffd\ufffd", []) == 2
    assert stable_text_len("hello wo", ["world"]) == 6  # "wo" may become "world": hold it back
    assert stable_text_len("hello w\ufffd", ["wx"]) == 6
    assert stable_text_len("hello", ["xyz"]) == 5


def test_completion_matches_offline(served, http):
    exp = served["expected"]["def fib(n):"]
    r = http.post("/v1/completions", json={"model": MODEL, "prompt": "def fib(n):", "max_tokens": MAX_TOKENS,
                                           "temperature": 0})
    assert r.status_code == 200, r.text
    body = r.json()
    ch = body["choices"][0]
    assert ch["text"] == exp.text
    assert ch["token_ids"] == exp.token_ids
    assert ch["finish_reason"] == exp.finish_reason
    n_p, n_c = len(exp.prompt_token_ids), len(exp.token_ids)
    assert body["usage"] == {"prompt_tokens": n_p, "completion_tokens": n_c, "total_tokens": n_p + n_c}
    m = body["ssd_metrics"]
    assert m["emitted_tokens"] == len(exp.token_ids) and "acceptance_rate" in m and "tau" in m
    # model omitted, token-id prompt, list of prompts
    r = http.post("/v1/completions", json={"prompt": exp.prompt_token_ids, "max_tokens": MAX_TOKENS,
                                           "temperature": 0})
    assert r.json()["choices"][0]["token_ids"] == exp.token_ids
    r = http.post("/v1/completions", json={"prompt": PROMPTS[:3], "max_tokens": MAX_TOKENS, "temperature": 0})
    assert [c["text"] for c in r.json()["choices"]] == [served["expected"][p].text for p in PROMPTS[:3]]


def test_chat_matches_offline(served, http):
    exp = served["expected_chat"]
    r = http.post("/v1/chat/completions", json={"model": MODEL, "messages": served["chat_msgs"],
                                                "max_tokens": MAX_TOKENS, "temperature": 0})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "chat.completion"
    assert body["choices"][0]["message"] == {"role": "assistant", "content": exp.text}
    assert body["usage"]["completion_tokens"] == len(exp.token_ids)
    assert "ssd_metrics" in body


def _sse(http, path, body):
    chunks = []
    with http.stream("POST", path, json=body) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        lines = [ln for ln in r.iter_lines() if ln]
    assert lines[-1] == "data: [DONE]"
    for ln in lines[:-1]:
        assert ln.startswith("data: ")
        chunks.append(json.loads(ln[6:]))
    return chunks


def test_streaming(served, http):
    exp = served["expected"]["caf\u00e9 \u65e5\u672c"]
    chunks = _sse(http, "/v1/completions", {"prompt": "caf\u00e9 \u65e5\u672c", "max_tokens": MAX_TOKENS,
                                            "temperature": 0, "stream": True,
                                            "stream_options": {"include_usage": True}})
    text = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
    assert text == exp.text
    finals = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]]
    assert finals[-1] == exp.finish_reason and all(f is None for f in finals[:-1])
    assert chunks[-1]["usage"]["completion_tokens"] == len(exp.token_ids)
    ids = [t for c in chunks if c["choices"] for t in c["choices"][0].get("token_ids", [])]
    assert ids == exp.token_ids

    exp = served["expected_chat"]
    chunks = _sse(http, "/v1/chat/completions", {"messages": served["chat_msgs"], "max_tokens": MAX_TOKENS,
                                                 "temperature": 0, "stream": True})
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == exp.text
    assert chunks[-1]["choices"][0]["finish_reason"] == exp.finish_reason


def test_32_concurrent_clients_match_offline(served):
    loop = served["app"].state.engine_loop
    loop.peak_running = 0

    def one(i: int) -> tuple[str, str]:
        p = PROMPTS[i % len(PROMPTS)]
        body = {"prompt": p, "max_tokens": MAX_TOKENS, "temperature": 0}
        with httpx.Client(base_url=served["base"], timeout=120) as c:
            if i % 2:
                return p, "".join(ch["choices"][0]["text"] for ch in
                                  _sse(c, "/v1/completions", {**body, "stream": True}) if ch["choices"])
            r = c.post("/v1/completions", json=body)
            assert r.status_code == 200, r.text
            return p, r.json()["choices"][0]["text"]

    with ThreadPoolExecutor(32) as ex:
        results = list(ex.map(one, range(32)))
    assert len(results) == 32
    for p, text in results:
        assert text == served["expected"][p].text
    assert loop.peak_running > 1  # the requests shared the running batch


BAD = [
    ("malformed json", "/v1/completions", b"{not json", 400, None),
    ("not an object", "/v1/completions", b"[1, 2]", 400, None),
    ("missing prompt", "/v1/completions", {"max_tokens": 4}, 400, "prompt"),
    ("missing messages", "/v1/chat/completions", {"max_tokens": 4}, 400, "messages"),
    ("unknown model", "/v1/completions", {"model": "gpt-9", "prompt": "x"}, 404, "model"),
    ("temperature -1", "/v1/completions", {"prompt": "x", "temperature": -1}, 400, "temperature"),
    ("top_p 2", "/v1/completions", {"prompt": "x", "top_p": 2}, 400, "top_p"),
    ("max_tokens 0", "/v1/completions", {"prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    ("temperature str", "/v1/completions", {"prompt": "x", "temperature": "hot"}, 400, "temperature"),
    ("too long prompt", "/v1/completions", {"prompt": "hello " * 400}, 400, "prompt"),
    ("too long chat", "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi " * 400}],
                                               "max_tokens": 4}, 400, "messages"),
    ("n=2", "/v1/completions", {"prompt": "x", "n": 2}, 400, "n"),
    ("bad prompt type", "/v1/completions", {"prompt": {"a": 1}}, 400, "prompt"),
    ("token id out of range", "/v1/completions", {"prompt": [1, 99999]}, 400, "prompt"),
    ("bad messages", "/v1/chat/completions", {"messages": "hi"}, 400, "messages"),
    ("bad stop", "/v1/completions", {"prompt": "x", "stop": [1]}, 400, "stop"),
    ("stream bad temp", "/v1/completions", {"prompt": "x", "temperature": -1, "stream": True}, 400,
     "temperature"),
    ("temperature NaN", "/v1/completions", b'{"prompt": "x", "temperature": NaN}', 400, "temperature"),
    ("temperature Infinity", "/v1/completions", b'{"prompt": "x", "temperature": Infinity}', 400, "temperature"),
    ("n true", "/v1/completions", {"prompt": "x", "n": True}, 400, "n"),
    ("stream string", "/v1/completions", {"prompt": "x", "stream": "false"}, 400, "stream"),
    ("stream_options list", "/v1/completions", {"prompt": "x", "stream": True, "stream_options": [1]}, 400,
     "stream_options"),
    ("chat stream_options str", "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                                         "stream": True, "stream_options": "x"}, 400,
     "stream_options"),
    ("logit_bias", "/v1/completions", {"prompt": "x", "logit_bias": {"5": 100}}, 400, "logit_bias"),
    ("suffix", "/v1/completions", {"prompt": "x", "suffix": "end"}, 400, "suffix"),
    ("min_tokens", "/v1/completions", {"prompt": "x", "min_tokens": 3}, 400, "min_tokens"),
    ("repetition_penalty", "/v1/completions", {"prompt": "x", "repetition_penalty": 1.2}, 400,
     "repetition_penalty"),
    ("tools", "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                       "tools": [{"type": "function", "function": {"name": "f"}}]}, 400, "tools"),
    ("response_format json", "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                                      "response_format": {"type": "json_object"}}, 400,
     "response_format"),
    ("negative stop id", "/v1/completions", {"prompt": "x", "stop_token_ids": [-1]}, 400, "stop_token_ids"),
    # json.loads raises ValueError / RecursionError here, not JSONDecodeError: still the caller's error
    ("huge integer", "/v1/completions", b'{"prompt": "x", "max_tokens": ' + b"9" * 5000 + b"}", 400, None),
    ("deep nesting", "/v1/completions", b"[" * 100_000 + b"]" * 100_000, 400, None),
    ("logprobs 0", "/v1/completions", {"prompt": "x", "logprobs": 0}, 400, "logprobs"),  # legacy: 0 asks for them
]


@pytest.mark.parametrize("name,path,body,status,param", BAD, ids=[b[0] for b in BAD])
def test_bad_input_is_4xx(http, name, path, body, status, param):
    if isinstance(body, bytes):
        r = http.post(path, content=body, headers={"content-type": "application/json"})
    else:
        r = http.post(path, json=body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error"
    assert isinstance(err["message"], str) and err["message"]
    assert set(err) >= {"message", "type", "param", "code"}
    if param is not None:
        assert err["param"] == param
    assert http.get("/health").json()["status"] == "ok"


def test_unknown_route_is_openai_style_404(http):
    r = http.get("/v1/nope")
    assert r.status_code == 404 and "error" in r.json()


def test_models_and_health(http):
    assert [m["id"] for m in http.get("/v1/models").json()["data"]] == [MODEL]
    assert http.get(f"/v1/models/{MODEL}").json()["id"] == MODEL  # what openai's models.retrieve asks
    r = http.get("/v1/models/gpt-9")
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    h = http.get("/health").json()
    assert h["status"] == "ok" and h["model"] == MODEL
    r = http.get("/v1/completions")
    assert r.status_code == 405 and "POST" in r.headers.get("allow", ""), r.headers


def test_a_lost_target_makes_health_and_new_requests_503(served, http):
    from ssd.engine import TargetLost

    engine = served["llm"].engine
    engine.lost = TargetLost("the target worker is lost and cannot be replaced in this process (killed)")
    try:
        h = http.get("/health")
        assert h.status_code == 503 and "target worker is lost" in h.json()["message"]
        r = http.post("/v1/completions", json={"model": MODEL, "prompt": "def f", "max_tokens": 2})
        assert r.status_code == 503 and "target worker is lost" in r.json()["error"]["message"], r.text
    finally:
        engine.lost = None
    assert http.get("/health").json()["status"] == "ok"


def test_an_oversized_body_is_refused_before_it_is_read(http):
    from ssd.launch.server import MAX_BODY_BYTES

    big = b'{"prompt": "' + b"a" * MAX_BODY_BYTES + b'"}'
    r = http.post("/v1/completions", content=big, headers={"content-type": "application/json"})
    assert r.status_code == 413 and "larger than" in r.json()["error"]["message"]

    def chunks():  # no Content-Length: counted as it arrives
        yield b'{"prompt": "'
        for _ in range(MAX_BODY_BYTES // (1 << 20) + 1):
            yield b"a" * (1 << 20)
        yield b'"}'

    r = http.post("/v1/completions", content=chunks(), headers={"content-type": "application/json"})
    assert r.status_code == 413
    assert http.get("/health").json()["status"] == "ok"


def test_openai_package(served):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=served["base"] + "/v1", api_key="unused", max_retries=0)
    exp = served["expected"]["hello world"]
    c = client.completions.create(model=MODEL, prompt="hello world", max_tokens=MAX_TOKENS, temperature=0)
    assert c.choices[0].text == exp.text
    assert c.usage.completion_tokens == len(exp.token_ids)
    s = client.completions.create(model=MODEL, prompt="hello world", max_tokens=MAX_TOKENS, temperature=0,
                                  stream=True)
    assert "".join(ch.choices[0].text for ch in s if ch.choices) == exp.text
    exp_chat = served["expected_chat"]
    cc = client.chat.completions.create(model=MODEL, messages=served["chat_msgs"], max_tokens=MAX_TOKENS,
                                        temperature=0)
    assert cc.choices[0].message.content == exp_chat.text
    s = client.chat.completions.create(model=MODEL, messages=served["chat_msgs"], max_tokens=MAX_TOKENS,
                                       temperature=0, stream=True)
    assert "".join(ch.choices[0].delta.content or "" for ch in s if ch.choices) == exp_chat.text
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt="x", temperature=-1)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="other", prompt="x")
    assert [m.id for m in client.models.list()] == [MODEL]


def test_ssd_client(served):
    from ssd import Client
    from ssd.client import ServerError

    exp = served["expected"]["0123"]
    with Client(served["base"], model=MODEL) as c:
        assert c.generate("0123", max_tokens=MAX_TOKENS, temperature=0) == exp.text
        assert "".join(c.stream("0123", max_tokens=MAX_TOKENS, temperature=0)) == exp.text
        exp_chat = served["expected_chat"].text
        assert c.chat(served["chat_msgs"], max_tokens=MAX_TOKENS, temperature=0) == exp_chat
        pieces = c.chat(served["chat_msgs"], stream=True, max_tokens=MAX_TOKENS, temperature=0)
        assert "".join(pieces) == served["expected_chat"].text
        assert c.models() == [MODEL]
        with pytest.raises(ServerError) as ei:
            c.generate("0123", top_p=2)
        assert ei.value.status == 400


def _idle(llm, timeout=10.0) -> bool:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if not llm.engine.scheduler.running and not llm.engine.scheduler.waiting:
            return True
        time.sleep(0.05)
    return False


def test_client_disconnect_aborts_sequence(served):
    llm = served["llm"]
    assert _idle(llm)
    before = llm.engine.totals["emitted_tokens"]
    body = {"prompt": "def fib(n):", "max_tokens": 200, "temperature": 0, "ignore_eos": True, "stream": True}
    with httpx.Client(base_url=served["base"], timeout=60) as c:
        with c.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200
            got = 0
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    got += 1
                    if got >= 2:
                        break
            assert llm.engine.scheduler.running  # still generating when we hang up
    assert _idle(llm), "the engine kept the disconnected request"
    assert llm.engine.totals["emitted_tokens"] - before < 200


def test_bad_request_queues_nothing(served, http):
    """A request rejected after parsing (bad stream_options) leaves nothing running in the engine."""
    r = http.post("/v1/completions", json={"prompt": "x", "max_tokens": 200, "ignore_eos": True, "stream": True,
                                           "stream_options": [1]})
    assert r.status_code == 400
    assert _idle(served["llm"], timeout=0.5)


def test_off_values_of_unsupported_fields_are_accepted(served, http):
    exp = served["expected"]["hello world"]
    r = http.post("/v1/completions", json={"prompt": "hello world", "max_tokens": MAX_TOKENS, "temperature": 0,
                                           "logit_bias": {}, "suffix": "", "min_tokens": 0, "repetition_penalty": 1,
                                           "n": 1, "stream": False, "stream_options": None})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == exp.text


def test_tiny_temperature_is_greedy_and_huge_top_k_is_off(served, http):
    exp = served["expected"]["hello world"]
    for extra in ({"temperature": 1e-45}, {"temperature": 0, "top_k": 2**64}):
        r = http.post("/v1/completions", json={"prompt": "hello world", "max_tokens": MAX_TOKENS, **extra})
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == exp.text


def test_non_streaming_client_disconnect_aborts_sequence(served, monkeypatch):
    """A non-streaming request keeps receiving token events, so it must check its client between them too."""
    import ssd.launch.server as server_mod

    llm = served["llm"]
    assert _idle(llm)
    monkeypatch.setattr(server_mod, "DISCONNECT_CHECK_S", 0.05)
    orig = llm.engine.mode.round

    def slow_round(running):  # 200 tokens take seconds, with an event at least every IDLE_CHECK_S
        time.sleep(0.03)
        return orig(running)

    monkeypatch.setattr(llm.engine.mode, "round", slow_round)
    before = llm.engine.totals["emitted_tokens"]
    body = json.dumps({"prompt": "def fib(n):", "max_tokens": 200, "temperature": 0, "ignore_eos": True}).encode()
    port = int(served["base"].rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n" % len(body) + body)
        deadline = time.time() + 10
        while not llm.engine.scheduler.running:
            assert time.time() < deadline, "the request never started"
            time.sleep(0.01)
    assert _idle(llm, timeout=2.0), "the engine kept the disconnected request"
    assert llm.engine.totals["emitted_tokens"] - before < 200


def test_failed_admission_is_a_500(served, http):
    engine = served["llm"].engine
    orig = engine._admit

    def admit(seq):
        if seq.prompt_ids[0] == 7:
            raise RuntimeError("injected admission failure")
        return orig(seq)

    engine._admit = admit
    try:
        for stream in (False, True):
            r = http.post("/v1/completions", json={"prompt": [7, 8, 9], "max_tokens": 4, "stream": stream})
            assert r.status_code == 500, r.text
            assert "injected admission failure" in r.json()["error"]["message"]
    finally:
        del engine._admit
    assert _idle(served["llm"])


def test_engine_error_fails_only_that_request(served, http):
    llm = served["llm"]
    mode = llm.engine.mode
    poison = 7
    orig = mode.round

    def round_(running):
        if any(s.prompt_ids[0] == poison for s in running):
            raise RuntimeError("injected failure")
        return orig(running)

    mode.round = round_
    try:
        r = http.post("/v1/completions", json={"prompt": [poison, 8, 9], "max_tokens": 4, "temperature": 0})
        assert r.status_code == 500
        assert "injected failure" in r.json()["error"]["message"]
        r = http.post("/v1/completions", json={"prompt": [poison, 8, 9], "max_tokens": 4, "stream": True})
        assert r.status_code == 500
    finally:
        del mode.round
    assert http.get("/health").json()["status"] == "ok"
    exp = served["expected"]["hello world"]
    r = http.post("/v1/completions", json={"prompt": "hello world", "max_tokens": MAX_TOKENS,
                                           "temperature": 0})
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == exp.text


def test_metrics_endpoint(http):
    from prometheus_client.parser import text_string_to_metric_families

    http.post("/v1/completions", json={"prompt": "hello", "max_tokens": 4})
    assert http.post("/v1/completions", json={"prompt": "hello", "echo": True}).status_code == 400
    r = http.get("/metrics")
    assert r.status_code == 200
    fams = {f.name: f for f in text_string_to_metric_families(r.text)}
    for name in ("ssd_requests", "ssd_prompt_tokens", "ssd_generation_tokens", "ssd_request_latency_seconds",
                 "ssd_time_to_first_token_seconds", "ssd_acceptance_rate", "ssd_tau", "ssd_cache_hit_rate",
                 "ssd_policy_choices", "ssd_running_requests"):
        assert name in fams, name
    ok = [s for s in fams["ssd_requests"].samples
          if s.name == "ssd_requests_total" and s.labels["status"] == "200"]
    assert sum(s.value for s in ok) >= 1
    assert any(s.labels.get("status") == "400" for s in fams["ssd_requests"].samples)
    gen = [s.value for s in fams["ssd_generation_tokens"].samples if s.name == "ssd_generation_tokens_total"]
    assert gen and gen[0] > 0
    assert [s.value for s in fams["ssd_tau"].samples][0] > 0
    assert any(s.labels.get("policy") == "sd" for s in fams["ssd_policy_choices"].samples)
    assert "ssd_cache_outcomes" in fams  # SD rounds: the family, with no samples


def test_metrics_split_ssd_outcomes_by_source():
    from types import SimpleNamespace

    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    from ssd.launch.server import _EngineCollector

    by_source = {"primary": {"hits": 7, "misses": 2}, "fast": {"hits": 0, "misses": 1}}
    loop = SimpleNamespace(running=0, waiting=0, stats={"mode": "ssd", "k": 3, "cache_by_source": by_source})
    reg = CollectorRegistry()
    reg.register(_EngineCollector(loop, "m"))
    fams = {f.name: f for f in text_string_to_metric_families(generate_latest(reg).decode())}
    got = {(s.labels["source"], s.labels["result"]): s.value for s in fams["ssd_cache_outcomes"].samples
           if s.name == "ssd_cache_outcomes_total"}
    assert got == {("primary", "hit"): 7, ("primary", "miss"): 2, ("fast", "hit"): 0, ("fast", "miss"): 1}
