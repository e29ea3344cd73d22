"""Stop conditions and request hygiene: a round that emits several tokens ends the output where one token at a
time would have; bad sampling values are rejected; a failed call leaves nothing behind in the engine."""

import math

import pytest
import torch
from tiny_models import random_model

from ssd import LLM, SamplingParams
from ssd.sequence import Sequence


class CharTokenizer:
    """One character per token id (A, B, C, ...), so stop strings can be placed on chosen tokens."""

    eos_token_ids: list[int] = []

    def decode(self, ids: list[int]) -> str:
        return "".join(chr(0x41 + i) for i in ids)

    def encode(self, text: str) -> list[int]:
        return [ord(c) - 0x41 for c in text]


def make_seq(stop=(), stop_token_ids=(), max_tokens=32, decode=None) -> Sequence:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, stop=list(stop), stop_token_ids=list(stop_token_ids))
    return Sequence(0, [1], params, [], decode or CharTokenizer().decode)


def test_stop_string_cuts_the_tokens_of_a_multi_token_round():
    seq = make_seq(stop=["C"])
    kept = seq.append([0, 1, 2, 3, 4])  # A B C D E: "C" completes at the third token
    assert kept == [0, 1, 2] and seq.metrics.first_tokens == 3  # the first delivery: what was kept of it
    assert seq.output_ids == [0, 1, 2]  # the completing token is kept, as one token at a time would
    assert (seq.text, seq.finish_reason) == ("AB", "stop")


def test_stop_string_before_a_stop_id_in_the_same_round_wins():
    seq = make_seq(stop=["B"], stop_token_ids=[3])
    assert seq.append([0, 1, 2, 3]) == [0, 1]
    assert (seq.text, seq.finish_reason) == ("A", "stop")


def test_stop_id_before_a_stop_string_wins():
    seq = make_seq(stop=["D"], stop_token_ids=[2])
    assert seq.append([0, 2, 3]) == [0, 2]
    assert (seq.text, seq.finish_reason) == ("A", "stop")  # the stop token's text is not output


def test_earliest_stop_string_wins_whatever_their_order():
    pairs = {0: "xa", 1: "b", 2: "c"}
    seq = make_seq(stop=["b", "a"], decode=lambda ids: "".join(pairs[i] for i in ids))
    assert seq.append([0, 1, 2]) == [0]  # "xa" already holds "a"
    assert seq.text == "x"


def test_stop_string_across_rounds_and_max_tokens():
    seq = make_seq(stop=["CD"])
    assert seq.append([0, 1, 2]) == [0, 1, 2] and not seq.finished
    assert seq.append([3, 4]) == [3]
    assert (seq.text, seq.output_ids) == ("AB", [0, 1, 2, 3])
    seq = make_seq(stop=["Z"], max_tokens=3)
    assert seq.append([0, 1, 2, 3]) == [0, 1, 2]
    assert seq.finish_reason == "length"


@pytest.fixture(scope="module")
def target():
    return random_model(vocab=40, layers=2, seed=3, scale=2.0)


def _run(target, mode: str, params: SamplingParams, **kw):
    extra = {"draft": target, "k": 4, "fanout": 10} if mode in ("sd", "ssd") else {}
    with LLM(target=target, mode=mode, dtype="float32", max_batch=2, max_len=128, use_ray=False, **extra,
             **kw) as llm:
        llm.engine.tokenizer = CharTokenizer()
        o = llm.generate([[1, 2, 3, 4]], params)[0]
        return o.token_ids, o.text, o.finish_reason


def test_every_mode_stops_where_one_token_at_a_time_stops(target):
    free = _run(target, "ar", SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), ar_steps=1)[0]
    i = next(i for i in range(1, 6) if free[i] not in free[:i])  # a token first seen at i: its char stops there
    stop = CharTokenizer().decode([free[i]])
    for stop_ids in ([], [t for t in free[i + 1:] if t not in free[: i + 1]][:1]):
        params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, stop=[stop], stop_token_ids=stop_ids)
        want = _run(target, "ar", params, ar_steps=1)
        assert want == (free[: i + 1], CharTokenizer().decode(free[:i]), "stop")
        for mode, kw in (("ar", {"ar_steps": 4}), ("sd", {}), ("ssd", {}), ("ngram", {})):
            assert _run(target, mode, params, **kw) == want, (mode, stop_ids)


def test_ar_rounds_past_a_stop_string_are_not_counted(target):
    """ar_steps=4 decodes on past a stop string inside a call; the request's rounds (and tau = 1) count as one
    token per call would, the same as ar_steps=1."""
    free = _run(target, "ar", SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), ar_steps=1)[0]
    i = next(i for i in range(1, 4) if free[i] not in free[:i])
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, stop=[CharTokenizer().decode([free[i]])])
    for steps in (1, 4):
        with LLM(target=target, mode="ar", dtype="float32", max_len=128, ar_steps=steps) as llm:
            llm.engine.tokenizer = CharTokenizer()
            o = llm.generate([[1, 2, 3, 4]], params)[0]
            assert len(o.token_ids) == i + 1
            assert o.metrics["rounds"] == i + 1 and o.metrics["tau"] == 1.0, (steps, o.metrics)
            assert llm.stats()["sequence_rounds"] == i + 1 and llm.stats()["tau"] == 1.0


def test_stop_strings_need_a_tokenizer(target):
    with LLM(target=target, mode="ar", dtype="float32", max_len=64) as llm:
        with pytest.raises(ValueError, match="stop strings need a tokenizer"):
            llm.generate([[1, 2]], SamplingParams(stop=["x"], max_tokens=4))
        assert not llm.engine.has_work


def test_a_failed_round_leaves_nothing_in_the_engine(target):
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    with LLM(target=target, mode="ar", dtype="float32", max_batch=2, max_len=64) as llm:
        want = llm.generate([[5, 6]], params)[0].token_ids
        orig = llm.engine.mode.round

        def fail_once(running):
            llm.engine.mode.round = orig
            raise RuntimeError("injected round failure")

        llm.engine.mode.round = fail_once
        with pytest.raises(RuntimeError, match="injected round failure"):
            llm.generate([[1, 2], [3, 4]], params)
        assert not llm.engine.has_work
        assert llm.generate([[5, 6]], params)[0].token_ids == want  # the slots were given back


def test_stream_holds_back_a_possible_stop_string_and_raises_on_failure(target):
    with LLM(target=target, mode="ar", dtype="float32", max_len=64) as llm:
        llm.engine.tokenizer = CharTokenizer()
        free = llm.generate([[1, 2, 3, 4]], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))[0]
        stop = CharTokenizer().decode(free.token_ids[3:5])  # two characters: the first is held back
        params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, stop=[stop])
        pieces = list(llm.stream([1, 2, 3, 4], params))
        final = llm.last_stream_output.text
        assert "".join(pieces) == final == free.text[: free.text.find(stop)]
        orig = llm.engine._admit

        def admit(seq):
            raise RuntimeError("injected admission failure")

        llm.engine._admit = admit
        with pytest.raises(RuntimeError, match="injected admission failure"):
            list(llm.stream([1, 2], params))
        llm.engine._admit = orig
        assert not llm.engine.has_work


@pytest.mark.parametrize("kwargs,match", [
    ({"temperature": math.nan}, "temperature"),
    ({"temperature": math.inf}, "temperature"),
    ({"temperature": True}, "temperature"),
    ({"max_tokens": True}, "max_tokens"),
    ({"top_k": False}, "top_k"),
    ({"seed": True}, "seed"),
    ({"stop": [1]}, "stop"),
    ({"stop": "x\x00"[:0]}, "stop"),
    ({"stop_token_ids": [-1]}, "stop_token_ids"),
    ({"stop_token_ids": ["x"]}, "stop_token_ids"),
    ({"stop_token_ids": "5"}, "stop_token_ids"),
    ({"ignore_eos": "no"}, "ignore_eos"),
])
def test_invalid_sampling_values(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


def test_sampling_values_normalised():
    assert SamplingParams(temperature=1e-40).greedy  # 1 / t overflows: the t -> 0 limit
    assert not SamplingParams(temperature=1e-4).greedy
    assert SamplingParams(top_k=2**64).top_k == 2**31 - 1  # beyond any vocabulary: still "no limit"
    assert SamplingParams(stop_token_ids=5).stop_token_ids == [5]
    assert SamplingParams(stop="x").stop == ["x"]
    # Seeds beyond int64 (which the actors' wire carries) reduce mod 2^63: the generators draw the same numbers.
    from ssd.workers.messages import SamplingSpec
    from ssd.workers.seq_state import make_generator

    for seed in (2**64 + 5, -3, 2**63):
        reduced = SamplingParams(seed=seed).seed
        assert 0 <= reduced < 2**63
        assert torch.equal(torch.rand(4, generator=make_generator(seed, 1)),
                           torch.rand(4, generator=make_generator(reduced, 1)))
        assert SamplingSpec.from_msgpack(SamplingSpec(1.0, 0, 1.0, reduced).to_msgpack()).seed == reduced


def test_config_rejects_a_context_too_short(target):
    for bad in (0, -5, 1, "64"):
        with pytest.raises(ValueError, match="max_len"):
            LLM(target=target, mode="ar", max_len=bad)


@pytest.mark.parametrize("kwargs,match", [
    ({"device": "gpu"}, "device must be"), ({"device": None}, "device must be"),
    ({"draft_device": "tpu"}, "draft_device must be"), ({"device": "cuda:x"}, "device must be"),
    ({"target_threads": 0}, "target_threads must be"), ({"draft_threads": "2"}, "draft_threads must be"),
    ({"saguaro_c": "0.5"}, "saguaro_c must be"), ({"extra": None}, "extra must be a dict"),
    ({"max_batch": True}, "max_batch"), ({"ar_steps": True}, "ar_steps"), ({"draft_lookahead": False}, "lookahead"),
    ({"draft_vocab": True}, "draft_vocab"),
])
def test_config_refuses_bad_settings_up_front(kwargs, match):
    from ssd.config import Config

    with pytest.raises(ValueError, match=match):
        Config(target="t", **kwargs)
    with pytest.raises(ValueError, match="target is required"):
        Config(target=None)


def test_generate_refuses_unordered_prompts_and_wrong_params_and_a_shut_down_llm(target):
    llm = LLM(target=target, mode="ar", dtype="float32", max_len=64)
    params = SamplingParams(temperature=0, max_tokens=3)
    with llm:
        for prompts in ({"prompt": [1, 2]}, {(1, 2)}):
            with pytest.raises(ValueError, match="prompts must be"):
                llm.generate(prompts, params)
        with pytest.raises(ValueError, match="must be SamplingParams, got NoneType"):
            llm.generate([[1, 2]], [None])
        with pytest.raises(ValueError, match="must be SamplingParams, got dict"):
            list(llm.stream([1, 2], {"max_tokens": 3}))
        assert not llm.engine.has_work
    with pytest.raises(RuntimeError, match="shut down"):
        llm.generate([[1, 2]], params)


def test_generate_can_return_failed_requests_beside_the_others(target):
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    with LLM(target=target, mode="ar", dtype="float32", max_batch=2, max_len=64) as llm:
        want = llm.generate([[5, 6], [7, 8]], params)
        admit = llm.engine._admit

        def admit_all_but(seq):
            if seq.prompt_ids == [9, 9]:
                raise RuntimeError("injected admission failure")
            admit(seq)

        llm.engine._admit = admit_all_but
        outs = llm.generate([[5, 6], [9, 9], [7, 8]], params, raise_errors=False)
        assert [o.token_ids for o in (outs[0], outs[2])] == [o.token_ids for o in want]
        assert outs[1].finish_reason == "error" and "injected admission failure" in outs[1].error
        assert outs[0].error is None
        llm.engine._admit = admit
        orig = llm.engine.mode.round

        def fail_once(running):  # a failed round fails what is still running of this call, not the call
            llm.engine.mode.round = orig
            raise RuntimeError("injected round failure")

        llm.engine.mode.round = fail_once
        outs = llm.generate([[5, 6], [7, 8], [5, 6]], params, raise_errors=False)  # the third waits for a slot
        assert all(o.finish_reason == "error" and "injected round failure" in o.error for o in outs[:2])
        assert outs[2].error is None and outs[2].token_ids == want[0].token_ids
        assert not llm.engine.has_work
        assert [o.token_ids for o in llm.generate([[5, 6], [7, 8]], params)] == [o.token_ids for o in want]
