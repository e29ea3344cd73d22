"""Public in-process API: `LLM(target=..., draft=..., mode=...)` and `llm.generate(prompts, params)`."""

from __future__ import annotations

import logging
import numbers
import time
from collections.abc import Iterator, Mapping, Set
from typing import Any

from ssd.config import Config
from ssd.outputs import Output
from ssd.sampling_params import SamplingParams
from ssd.sequence import Sequence, stable_text_len

log = logging.getLogger("ssd")


def _is_token_ids(x: Any) -> bool:
    """One prompt's token ids: a list or tuple of integers, or a 1-D array / tensor."""
    if getattr(x, "ndim", None) == 1:
        return True
    return isinstance(x, (list, tuple)) and bool(x) and isinstance(x[0], numbers.Integral)


def _one_prompt(p: Any) -> str | list[int]:
    """A prompt as the engine takes it: text, or a list of token ids (numpy / torch integers made ints)."""
    if isinstance(p, str):
        return p
    if not _is_token_ids(p) and not (isinstance(p, (list, tuple)) and not p):
        raise ValueError(f"a prompt must be a string or a sequence of token ids, got {type(p).__name__}")
    ids = p.tolist() if hasattr(p, "tolist") else list(p)
    return [int(t) if isinstance(t, numbers.Integral) and not isinstance(t, bool) else t for t in ids]


def _check_params(sp: Any) -> None:
    if not isinstance(sp, SamplingParams):
        raise ValueError(f"sampling params must be SamplingParams, got {type(sp).__name__}")


class LLM:
    def __init__(self, target: Any, draft: Any = None, mode: str | None = None, **kwargs: Any) -> None:
        self.config = Config(target=target, draft=draft, mode=mode, **kwargs)
        from ssd.build import build_engine

        self._t0 = time.perf_counter()
        self._closed = False
        self.engine, self._handles, self.tokenizer = build_engine(self.config)

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("this LLM was shut down; create a new one")

    # -- generation ---------------------------------------------------------------------------
    def _normalise(
        self, prompts: Any, params: SamplingParams | list[SamplingParams] | None
    ) -> tuple[list[Any], list[SamplingParams]]:
        if isinstance(prompts, (Mapping, Set)):  # iterating one would give its keys, or an arbitrary order
            raise ValueError(f"prompts must be a string, a sequence of token ids, or a list of those, not a "
                             f"{type(prompts).__name__}")
        if isinstance(prompts, str) or _is_token_ids(prompts):
            prompts = [prompts]
        elif getattr(prompts, "ndim", None) == 2:  # a [N, T] array or tensor: N prompts
            prompts = prompts.tolist()
        try:
            prompts = [_one_prompt(p) for p in prompts]
        except TypeError:
            raise ValueError("prompts must be a string, a sequence of token ids, or a list of those") from None
        if params is None:
            params = SamplingParams()
        plist = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
        if len(plist) != len(prompts):
            raise ValueError(f"got {len(plist)} SamplingParams for {len(prompts)} prompts")
        for sp in plist:
            _check_params(sp)
        return prompts, plist

    def generate(
        self, prompts: Any, params: SamplingParams | list[SamplingParams] | None = None, *,
        raise_errors: bool = True,
    ) -> list[Output]:
        """Generate for a batch of prompts (strings or token-id lists); one Output per prompt, in order.
        A request that fails raises RuntimeError, or with raise_errors=False comes back with
        finish_reason "error" and the reason in `Output.error`, beside the others' outputs."""
        self._check_open()
        prompts, plist = self._normalise(prompts, params)
        # Validate every prompt before queueing any, so a bad one rejects the call without side effects.
        seqs = [self.engine.make_sequence(p, sp) for p, sp in zip(prompts, plist)]
        for s in seqs:
            self.engine.add(s)
        try:
            while any(not s.finished for s in seqs):
                try:
                    self.engine.step()
                except Exception as e:
                    if raise_errors:
                        raise
                    if self.engine.target_down is None:  # a lost target: the engine failed what it lost
                        self._fail_running(seqs, f"{type(e).__name__}: {e}")
        finally:  # a failed round (or Ctrl-C) must not leave this call's requests in the engine
            self._abort_unfinished(seqs)
        failed = [s for s in seqs if s.error]
        if failed and raise_errors:
            raise RuntimeError(f"{len(failed)} request(s) failed: {failed[0].error}")
        return [self._output(s) for s in seqs]

    def stream(self, prompt: Any, params: SamplingParams | None = None) -> Iterator[str]:
        """Yield text pieces of one request as they are produced."""
        self._check_open()
        if params is not None:
            _check_params(params)
        seq = self.engine.make_sequence(_one_prompt(prompt), params or SamplingParams())
        self.engine.add(seq)
        sent = 0
        try:
            while not seq.finished:
                self.engine.step()
                # Hold back a partial character, and text that may yet turn out to start a stop string.
                ready = len(seq.text) if seq.finished else stable_text_len(seq.text, seq.params.stop)
                if ready > sent:
                    yield seq.text[sent:ready]
                    sent = ready
            if seq.error:
                raise RuntimeError(f"request failed: {seq.error}")
            if len(seq.text) > sent:
                yield seq.text[sent:]
        finally:
            self._abort_unfinished([seq])
        self.last_stream_output = self._output(seq)

    def _fail_running(self, seqs: list[Sequence], message: str) -> None:
        """After a failed round: this call's requests in it fail with its error; those waiting go on."""
        for s in seqs:
            if not s.finished and s in self.engine.scheduler.running:
                self.engine.abort(s)
                s.error, s.finish_reason = message, "error"

    def _abort_unfinished(self, seqs: list[Sequence]) -> None:
        for s in seqs:
            if not s.finished or s in self.engine.scheduler.running:
                self.engine.abort(s)

    @staticmethod
    def _output(s: Sequence) -> Output:
        return Output(
            request_id=s.seq_id,
            prompt=s.prompt_text,
            prompt_token_ids=s.prompt_ids,
            text=s.text,
            token_ids=list(s.output_ids),
            finish_reason=s.finish_reason,
            metrics=s.metrics.as_dict(),
            error=s.error,
        )

    def stats(self) -> dict:
        return self.engine.stats_dict()

    def shutdown(self) -> None:
        self._closed = True
        for h in self._handles:
            if h is self.engine.target and self.engine.target_down is not None and hasattr(h, "abandon"):
                h.abandon()  # an in-process target that stopped answering: its thread cannot be waited for
            else:
                h.shutdown()
        self._handles = []

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()
