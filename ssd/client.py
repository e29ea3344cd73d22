"""A small HTTP client for an `ssd` server (or any OpenAI-compatible one).

    from ssd import Client
    c = Client("http://127.0.0.1:8000")
    c.generate("def fib(n):", max_tokens=64, temperature=0)        # -> str
    for piece in c.stream("def fib(n):", max_tokens=64): print(piece, end="")
    c.chat([{"role": "user", "content": "hi"}])                      # -> str
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx


class ServerError(RuntimeError):
    """The server answered with an error body; `.status` and `.body` say what it was."""

    def __init__(self, status: int, body: Any) -> None:
        err = body.get("error") if isinstance(body, dict) else None
        msg = err.get("message") if isinstance(err, dict) else str(body)
        super().__init__(f"HTTP {status}: {msg}")
        self.status = status
        self.body = body


class Client:
    def __init__(self, base_url: str = "http://127.0.0.1:8000", model: str | None = None,
                 timeout: float | None = 600.0, api_key: str | None = None) -> None:
        base_url = base_url.rstrip("/")
        if base_url.endswith("/v1"):
            base_url = base_url[: -len("/v1")]
        self.base_url = base_url
        self.model = model
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._http = httpx.Client(base_url=base_url, timeout=timeout, headers=headers)

    # -- plumbing ----------------------------------------------------------------------------------
    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _body(self, extra: dict, sampling: dict) -> dict:
        body = {k: v for k, v in sampling.items() if v is not None}
        if self.model is not None:
            body.setdefault("model", self.model)
        body.update(extra)
        return body

    @staticmethod
    def _check(r: httpx.Response) -> None:
        if r.status_code >= 400:
            try:
                body = r.json()
            except ValueError:
                body = r.text
            raise ServerError(r.status_code, body)

    def _post(self, path: str, body: dict) -> dict:
        r = self._http.post(path, json=body)
        self._check(r)
        return r.json()

    def _sse(self, path: str, body: dict) -> Iterator[dict]:
        with self._http.stream("POST", path, json=body) as r:
            if r.status_code >= 400:
                r.read()
                self._check(r)
            for line in r.iter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[len("data:"):].strip()
                if data == "[DONE]":
                    return
                chunk = json.loads(data)
                if "error" in chunk:
                    raise ServerError(500, chunk)
                yield chunk

    # -- API ---------------------------------------------------------------------------------------
    def health(self) -> dict:
        r = self._http.get("/health")
        self._check(r)
        return r.json()

    def models(self) -> list[str]:
        r = self._http.get("/v1/models")
        self._check(r)
        return [m["id"] for m in r.json()["data"]]

    def completion(self, prompt: str | list[int], **sampling: Any) -> dict:
        """The full /v1/completions response (usage, ssd_metrics, token_ids, ...)."""
        return self._post("/v1/completions", self._body({"prompt": prompt, "stream": False}, sampling))

    def generate(self, prompt: str | list[int], **sampling: Any) -> str:
        """Completion text of one prompt; `sampling`: max_tokens, temperature, top_p, top_k, seed, stop."""
        return self.completion(prompt, **sampling)["choices"][0]["text"]

    def stream(self, prompt: str | list[int], **sampling: Any) -> Iterator[str]:
        """Text pieces of one completion as the server produces them."""
        for chunk in self._sse("/v1/completions", self._body({"prompt": prompt, "stream": True}, sampling)):
            for c in chunk.get("choices", []):
                if c.get("text"):
                    yield c["text"]

    def chat(self, messages: list[dict], stream: bool = False, **sampling: Any) -> str | Iterator[str]:
        """The assistant's reply (str), or an iterator of its pieces with stream=True."""
        body = self._body({"messages": messages, "stream": stream}, sampling)
        if not stream:
            return self._post("/v1/chat/completions", body)["choices"][0]["message"]["content"]
        return self._chat_stream(body)

    def _chat_stream(self, body: dict) -> Iterator[str]:
        for chunk in self._sse("/v1/chat/completions", body):
            for c in chunk.get("choices", []):
                piece = (c.get("delta") or {}).get("content")
                if piece:
                    yield piece
