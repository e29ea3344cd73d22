"""Autoregressive engine: public API, determinism, stop handling, input validation."""

import pytest
import torch
from tiny_models import random_model

from ssd import LLM, SamplingParams
from ssd.config import Config


@pytest.fixture(scope="module")
def llm():
    m = LLM(target=random_model(vocab=48, seed=1, scale=3.0), mode="ar", dtype="float32", max_batch=4, max_len=128)
    yield m
    m.shutdown()


def reference_greedy(model, prompt: list[int], n: int) -> list[int]:
    """Slow, obvious greedy decoding: re-run the whole sequence every step, no KV cache."""
    from ssd.workers.model_runner import ModelRunner

    ids = list(prompt)
    out = []
    for _ in range(n):
        runner = ModelRunner(model, max_slots=1, max_len=256)
        s = runner.allocate()
        logits = runner.forward([s], [ids], last_only=True)[0]
        t = int(torch.argmax(logits))
        ids.append(t)
        out.append(t)
    return out


def test_greedy_matches_no_cache_reference(llm):
    prompts = [[1, 2, 3], [5, 9, 11, 13, 2, 7], [40]]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    for p, o in zip(prompts, outs):
        assert o.token_ids == reference_greedy(llm.engine.target.worker.model, p, 12)
        assert o.finish_reason == "length"
        assert len(o.token_ids) == 12


def test_seeded_request_same_alone_and_in_batch(llm):
    sp = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=16, seed=1234, ignore_eos=True)
    alone = llm.generate([[3, 4, 5]], sp)[0].token_ids
    others = SamplingParams(temperature=0.8, max_tokens=10, seed=7, ignore_eos=True)
    batch = llm.generate([[9, 9], [3, 4, 5], [1]], [others, sp, others])
    assert batch[1].token_ids == alone
    again = llm.generate([[3, 4, 5]], sp)[0].token_ids
    assert again == alone


def test_continuous_batching_more_requests_than_slots(llm):
    sp = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    prompts = [[i + 1, i + 2] for i in range(10)]  # 10 requests, 4 slots
    outs = llm.generate(prompts, sp)
    assert [len(o.token_ids) for o in outs] == [5] * 10
    solo = [llm.generate([p], sp)[0].token_ids for p in prompts[:3]]
    assert [o.token_ids for o in outs[:3]] == solo


def test_eos_and_stop_token_ids_finish_the_request(llm):
    sp = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    full = llm.generate([[1, 2, 3]], sp)[0].token_ids
    stop_at = full[4]
    first = full.index(stop_at)
    out = llm.generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=20, stop_token_ids=[stop_at]))[0]
    assert out.token_ids == full[: first + 1]
    assert out.finish_reason == "stop"


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"temperature": -0.1}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"top_k": -1}, "top_k"),
    ],
)
def test_invalid_sampling_values(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


def test_bad_prompts_rejected_before_anything_is_queued(llm):
    with pytest.raises(ValueError, match="tokenizer"):
        llm.generate(["text prompt but no tokenizer"])
    with pytest.raises(ValueError, match="token ids"):
        llm.generate([[1, 2, 999]])
    with pytest.raises(ValueError, match="context"):
        llm.generate([[1] * 120], SamplingParams(max_tokens=20))
    with pytest.raises(ValueError, match="SamplingParams"):
        llm.generate([[1], [2]], [SamplingParams()])
    assert not llm.engine.has_work


def test_config_errors():
    with pytest.raises(ValueError, match="unknown mode"):
        LLM(target=random_model(), mode="fast")
    with pytest.raises(ValueError, match="needs a draft"):
        LLM(target=random_model(), mode="sd")
    with pytest.raises(ValueError, match="vocabulary"):
        LLM(target=random_model(vocab=32), draft=random_model(vocab=40), mode="sd", dtype="float32")
    with pytest.raises(ValueError, match="ray_channel must be True or False"):
        LLM(target=random_model(), mode="ar", ray_channel="false")
    with pytest.raises(ValueError, match="use_ray must be True, False or None"):
        LLM(target=random_model(), mode="ar", use_ray="no")
    with pytest.raises(ValueError, match="ray_address.*needs use_ray"):
        LLM(target=random_model(), mode="ar", use_ray=False, ray_address="auto")


def test_default_layout():
    """Ray actors by default only where they are measured faster: ssd/auto with a draft on CPU (core loans)."""
    assert Config(target="t", draft="d").use_ray is True  # mode auto
    assert Config(target="t", draft="d", mode="ssd").use_ray is True
    assert Config(target="t", draft="d", mode="sd").use_ray is False
    assert Config(target="t").use_ray is False
    assert Config(target="t", draft="d", device="cuda:0", draft_device="cuda:1").use_ray is False
    assert Config(target="t", draft="d", draft_device="cuda:0").use_ray is False
    assert Config(target="t", mode="ar", ray_address="auto").use_ray is True
    assert Config(target="t", draft="d", use_ray=False).use_ray is False


def test_default_quantization_follows_the_target_file():
    """quantization="auto" (the default): a quantised GGUF target on CPU runs in its own block mode (the packaged
    Q4_K_M files: w4a8, so their draft in w4a8-g64); on CUDA, in-memory models and explicit settings as given."""
    cpu = Config(target="qwen-coder-1.5b", draft="qwen-coder-0.5b")
    assert (cpu.quantization, cpu.draft_quantization) == ("w4a8", "w4a8-g64")
    gpu_draft = Config(target="qwen-coder-1.5b", draft="qwen-coder-0.5b", draft_device="cuda:0")
    assert (gpu_draft.quantization, gpu_draft.draft_quantization) == ("w4a8", None)  # block kernels: CPU only
    assert Config(target="qwen-coder-1.5b", device="cuda:0").quantization is None
    assert Config(target="llama-70b").quantization is None  # a Hugging Face model: as stored
    assert Config(target="t", draft="d").quantization is None
    assert Config(target="qwen-coder-1.5b", quantization=None).quantization is None
    assert Config(target="qwen-coder-1.5b", quantization="int8").quantization == "int8"
    assert Config(target="qwen-coder-1.5b", device="cpu:0").quantization == "w4a8"
    # an unquantised target keeps a packaged (quantised) draft in 4 bits on CPU; an in-memory draft follows the target
    bf16 = Config(target="qwen-coder-1.5b", draft="qwen-coder-0.5b", quantization=None)
    assert (bf16.quantization, bf16.draft_quantization) == (None, "w4a8-g64")
    assert Config(target="t", draft="d", quantization=None).draft_quantization is None
    assert Config(target="qwen-coder-1.5b", draft="qwen-coder-0.5b", quantization="int8").draft_quantization == "int8"
    with pytest.raises(ValueError, match="unknown quantization 'w3'"):
        Config(target="t", draft="d", quantization="w3")


def test_default_draft_quantization():
    """auto: a w4a8 target's draft in w4a8-g64 (fewest bytes), any other target's draft as the target."""
    assert Config(target="t", draft="d", quantization="w4a8").draft_quantization == "w4a8-g64"
    chosen = Config(target="t", draft="d", quantization="w4a8", draft_quantization="w4a8-all")
    assert chosen.draft_quantization == "w4a8-all"
    assert Config(target="t", draft="d", quantization="w4a8", draft_quantization="same").draft_quantization == "w4a8"
    assert Config(target="t", draft="d", quantization="int8").draft_quantization == "int8"
    assert Config(target="t", draft="d").draft_quantization is None
    assert Config(target="t", draft="d", quantization="w4a8", draft_quantization=None).draft_quantization is None
    with pytest.raises(ValueError, match="draft_quantization"):
        Config(target="t", draft="d", draft_quantization="w3a8")


def test_stats_and_metrics(llm):
    outs = llm.generate([[1, 2]], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    m = outs[0].metrics
    assert m["emitted_tokens"] == 6 and m["rounds"] == 6 and m["tau"] == 1.0
    st = llm.stats()
    assert st["mode"] == "ar" and st["emitted_tokens"] >= 6


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "sampled"])
def test_several_tokens_per_call_equal_one_per_call(sampled):
    """ar_steps: the target worker decodes up to that many tokens per call; every token and random draw is
    that of one token per call, in a batch whose sequences stop at different points (max_tokens not a
    multiple of the steps, a stop token mid-call); the statistics still count one round per forward."""
    model = random_model(vocab=48, seed=1, scale=3.0)
    prompts = [[1, 2, 3], [5, 9, 11, 13, 2, 7], [40], [7, 7]]
    temp = dict(temperature=0.9, top_k=20) if sampled else dict(temperature=0)
    sps = [SamplingParams(max_tokens=n, ignore_eos=True, seed=s, **temp) for n, s in ((13, 1), (7, 2), (16, 3), (1, 4))]
    got = {}
    for steps in (1, 4):
        with LLM(target=model, mode="ar", dtype="float32", max_batch=4, max_len=128, ar_steps=steps) as llm:
            full = [o.token_ids for o in llm.generate(prompts, sps)]
            stop = full[0][5]
            stop_sp = SamplingParams(max_tokens=13, seed=1, stop_token_ids=[stop], **temp)
            stopped = llm.generate([prompts[0]], stop_sp)[0]
            got[steps] = (full, stopped.token_ids, stopped.finish_reason, stopped.metrics["rounds"], llm.stats())
    assert got[4][:4] == got[1][:4]
    assert [len(t) for t in got[4][0]] == [13, 7, 16, 1] and got[4][2] == "stop"
    assert got[4][3] == len(got[4][1])  # a round per forward
    st1, st4 = got[1][4], got[4][4]
    assert st4["rounds"] == st1["rounds"] and st4["tau"] == st1["tau"]  # batch forwards, counted alike
    assert st1["tau"] == 1.0  # per round of a sequence: a batch of 4 is not 4 tokens a round
    assert st1["sequence_rounds"] == st1["emitted_tokens"] > st1["rounds"]


def test_ar_steps_is_checked():
    with pytest.raises(ValueError, match="ar_steps"):
        LLM(target=random_model(), mode="ar", ar_steps=0)


def test_context_beyond_the_trained_positions_is_warned(caplog):
    model = random_model(vocab=32)  # max_position_embeddings 512
    with caplog.at_level("WARNING", logger="ssd"):
        LLM(target=model, mode="ar", dtype="float32", max_len=512).shutdown()
        assert "max_position_embeddings" not in caplog.text
        LLM(target=model, mode="ar", dtype="float32", max_len=600).shutdown()
    assert "max_len 600 exceeds the target's max_position_embeddings 512" in caplog.text


@pytest.mark.parametrize("kwargs,match", [
    ({"fanout": -5, "k": 4}, "fanout must be a budget"),
    ({"fanout": 2.5}, "fanout must be a budget"),
    ({"fanout": (3, 3, 3)}, "fanout must be a budget"),
    ({"fanout": [2, -1, 2]}, "integers >= 0"),
    ({"fanout": [0, 0]}, "positive sum"),
    ({"fanout": [1, 1, 1], "k": 4}, "5 entries for k=4"),
    ({"fanout_kind": "Uniform"}, "fanout_kind"),
    ({"ngram_max": 0}, "ngram_max"),
    ({"k": True}, "k must be"),
])
def test_speculation_options_are_checked(kwargs, match):
    with pytest.raises(ValueError, match=match):
        Config(target="t", draft="d", mode="ssd", **kwargs)


def test_an_explicit_fanout_list_fixes_k_and_tensor_parallel_implies_ray():
    assert Config(target="t", draft="d", mode="ssd", fanout=[2, 1, 1]).k == 2
    with pytest.raises(ValueError, match="at least 2 entries"):  # K = 0 would fail only once the models load
        Config(target="t", draft="d", mode="ssd", fanout=[4])
    with pytest.raises(ValueError, match="too short to auto-configure k"):  # its timings would overrun the cache
        Config(target="t", draft="d", max_len=9)
    assert Config(target="t", draft="d", max_len=9, k=3).max_len == Config(target="t", max_len=9).max_len == 9
    tp = Config(target="t", mode="sd", draft="d", extra={"target_tp": 2})
    assert tp.use_ray is True and not tp.ray_by_default  # its ranks are actors: no in-process fallback
    with pytest.raises(ValueError, match="needs use_ray"):
        from ssd.build import build_engine

        build_engine(Config(target="t", mode="ar", use_ray=False, extra={"target_tp": 2}))


def test_token_id_prompts_of_any_sequence_type(llm):
    """A tuple, a numpy array or a torch tensor of ids is one prompt (a 2-D one, a batch); what is not ids or
    text is refused with a clear error."""
    np = pytest.importorskip("numpy")
    import torch

    sp = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    want = llm.generate([[1, 2, 3]], sp)[0].token_ids
    for p in ((1, 2, 3), np.array([1, 2, 3]), torch.tensor([1, 2, 3]), [np.int64(1), 2, 3]):
        assert llm.generate(p, sp)[0].token_ids == want, type(p)
    assert [o.token_ids for o in llm.generate(torch.tensor([[1, 2, 3], [1, 2, 3]]), sp)] == [want, want]
    assert [o.token_ids for o in llm.generate([(1, 2, 3), np.array([1, 2, 3])], sp)] == [want, want]
    for bad in (5, [[1.5, 2]], [{"a": 1}], [True, 2]):
        with pytest.raises(ValueError, match="prompt"):
            llm.generate(bad, sp)
