"""Tensor-parallel target: two gloo ranks give the single-rank model's logits and tokens.

In process: two ranks as two spawned processes (torch.multiprocessing, gloo over a FileStore).
With Ray: `LLM(..., use_ray=True, extra={"target_tp": 2})` gives the TP=1 tokens.
"""

from __future__ import annotations

import os
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from local_ray import start_ray
from tiny_models import random_model
from torch import nn

from ssd.workers.messages import Draft, SamplingSpec
from ssd.workers.model_runner import ModelRunner
from ssd.workers.models.quant import quantize_model
from ssd.workers.models.tensor_parallel import RowParallelLinear, shard_model
from ssd.workers.target_worker import TargetWorker

WORLD = 2
ATOL = 1e-5

# name -> (random_model kwargs, quantization)
CASES = {
    "qwen2": (dict(arch="qwen2", vocab=48, seed=1), None),  # q/k/v bias, tied embeddings
    "llama": (dict(arch="llama", vocab=48, seed=2), None),
    "qwen3": (dict(arch="qwen3", vocab=48, seed=3), None),  # q/k norms
    "qwen2_int8": (dict(arch="qwen2", vocab=48, seed=4), "int8"),  # fused qkv / gate_up, row attention
    "llama_int4": (dict(arch="llama", vocab=48, hidden=64, seed=5), "int4"),
}


def _worker_model():
    return random_model(arch="llama", vocab=48, seed=6, scale=3.0).float()


def _case_model(name: str):
    kw, quant = CASES[name]
    model = random_model(**kw).float()
    if quant is not None:
        quantize_model(model, quant)
    return model


def _score(model) -> list[torch.Tensor]:
    """Prefill, decode, batched multi-token scoring (with padding), a tree, rollback: every logits tensor."""
    r = ModelRunner(model, max_slots=3, max_len=64)
    a, b = r.allocate(), r.allocate()
    out = [r.forward([a], [[1, 5, 9, 2, 7, 3, 11]]), r.forward([b], [[4, 4, 8, 1]])]
    out.append(r.forward([a], [[5]]))
    out.append(r.forward([a, b], [[3], [9]]))
    out.append(r.forward([a, b], [[1, 2, 3, 4], [6, 7]]))
    r.truncate(a, 10)
    out.append(r.forward([a], [[4, 5, 6, 7]], parents=[[-1, -1, 0, 2]]))
    r.keep(a, 10, [0, 2, 3])
    out.append(r.forward([a, b], [[8, 1], [2]], last_only=True))
    return out


def _greedy(model, ids: list[int], n: int) -> list[int]:
    """The model's greedy continuation of `ids` (a fresh cache): an oracle draft that gets accepted."""
    r = ModelRunner(model, max_slots=1, max_len=64)
    slot = r.allocate()
    out = [int(r.forward([slot], [ids], last_only=True)[0].argmax())]
    while len(out) < n:
        out.append(int(r.forward([slot], [out[-1:]], last_only=True)[0].argmax()))
    return out


def _worker_script(w, oracle) -> list[tuple]:
    """Add greedy / seeded / unseeded sequences; verify chains and trees (right and wrong drafts)."""
    specs = [SamplingSpec(temperature=0), SamplingSpec(temperature=0.8, seed=5), SamplingSpec(temperature=1.0)]
    hist = [[1, 2, 3, 4, 5], [7, 7, 9], [3, 1, 4, 1, 5, 9]]
    for i, (p, s) in enumerate(zip(hist, specs)):
        w.add(i, p, s)
    results = []
    for rnd in range(5):
        drafts = []
        for i in range(3):
            toks = _greedy(oracle, hist[i], 3)
            if rnd % 2:
                toks[rnd % 3] = (toks[rnd % 3] + 1) % 48  # a wrong token somewhere
            if rnd == 2 and i != 2:  # a tree: the chain plus a sibling of its first node
                drafts.append(Draft(seq_id=i, tokens=toks + [(toks[0] + 3) % 48], parents=[-1, 0, 1, -1],
                                    q_kind="point"))
            else:
                drafts.append(Draft(seq_id=i, tokens=toks[: 1 + rnd % 3], q_kind="point"))
        for o in w.verify(drafts):
            hist[o.seq_id] += o.tokens
            results.append((o.seq_id, o.num_accepted, tuple(o.tokens), tuple(o.accepted_nodes or ())))
    return results


def _rank_main(rank: int, tmp: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{tmp}/store0", rank=rank, world_size=WORLD,
                            timeout=timedelta(seconds=60))
    logits = {}
    for name in CASES:
        model = shard_model(_case_model(name), rank, WORLD)
        assert model.layers[0].self_attn.n_kv == 1 and isinstance(model.layers[0].mlp.down_proj, RowParallelLinear)
        logits[name] = _score(model)
    dist.destroy_process_group()

    from ssd.workers.tp_worker import TPTargetWorker

    kw = dict(dtype="float32", max_slots=4, max_len=64, tp_rank=rank, tp_size=WORLD, dist_timeout_s=60)
    w = TPTargetWorker(_worker_model(), dist_init=f"file://{tmp}/store1", **kw)
    assert w.runner.kv.k.shape[2] == 1  # this rank's KV head only
    outcomes = _worker_script(w, _worker_model())
    disagree_clean = w.tp_disagreements
    # Rank 1 with a different LM head takes rank 0's (chain) outcomes and stays in step.
    for s in range(3):
        w.remove(s)
    if rank == 1:
        w.model.lm_head = nn.Linear(32, 48, bias=False)
    forced = []
    w.add(0, [1, 2, 3, 4, 5], SamplingSpec(temperature=0))
    for rnd in range(4):
        o = w.verify([Draft(seq_id=0, tokens=[(3 * rnd + j) % 48 for j in range(rnd % 3)])])[0]
        forced.append((o.num_accepted, tuple(o.tokens)))
    torch.save({"logits": logits, "outcomes": outcomes, "disagree_clean": disagree_clean, "forced": forced,
                "disagree_forced": w.tp_disagreements}, f"{tmp}/rank{rank}.pt")
    w.close_tp()


@pytest.fixture(scope="module")
def rank_results(tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("tp"))
    mp.spawn(_rank_main, args=(tmp,), nprocs=WORLD, join=True)
    return [torch.load(f"{tmp}/rank{r}.pt", weights_only=False) for r in range(WORLD)]


def _tp3_rank(rank: int, tmp: str) -> None:
    from ssd.workers.models.dense import apply_linear_kernel

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=rank, world_size=3,
                            timeout=timedelta(seconds=60))
    out = {}
    for dtype in (torch.float32, torch.bfloat16):
        model = random_model(vocab=64, hidden=96, heads=6, kv_heads=3, layers=2, seed=3).to(dtype)
        model = apply_linear_kernel(shard_model(model, rank, 3), "auto")  # as TPTargetWorker.load_model
        runner = ModelRunner(model, max_slots=2, max_len=128)
        a, b = runner.allocate(), runner.allocate()
        prompt, block = [(7 * i) % 64 for i in range(30)], [5, 9, 2, 33, 17, 8, 61, 4]
        runner.forward([a], [prompt])
        runner.forward([b], [prompt])
        together = runner.forward([a], [block])[0]  # [8, V]
        alone = torch.stack([runner.forward([b], [[t]])[0, 0] for t in block])
        out[str(dtype)] = (model.batch_invariant, torch.equal(together, alone))
    torch.save(out, f"{tmp}/tp3_rank{rank}.pt")
    dist.destroy_process_group()


def test_tp3_blocks_keep_the_bits_of_one_token_forwards(tmp_path):
    """Beyond 2 ranks a ring all-reduce sums each chunk in its own rank order, chunked by the buffer's size: a
    verification block's tokens would differ from decoding them one by one (greedy SD != AR). The row-parallel
    sum gathers the partials and adds them in rank order instead."""
    mp.spawn(_tp3_rank, args=(str(tmp_path),), nprocs=3, join=True)
    for r in range(3):
        for dtype, (invariant, equal) in torch.load(f"{tmp_path}/tp3_rank{r}.pt").items():
            assert invariant and equal, (r, dtype)


@pytest.mark.parametrize("name", list(CASES))
def test_tp2_logits_equal_single_rank(rank_results, name):
    ref = _score(_case_model(name))
    for res in rank_results:
        got = res["logits"][name]
        assert len(got) == len(ref)
        for g, e in zip(got, ref):
            assert g.shape == e.shape
            torch.testing.assert_close(g, e, atol=ATOL, rtol=0)
    # Every rank computes the LM head on the same all-reduced hidden states: the same bits.
    for g0, g1 in zip(rank_results[0]["logits"][name], rank_results[1]["logits"][name]):
        assert torch.equal(g0, g1)


def test_tp2_worker_outcomes(rank_results):
    r0, r1 = rank_results
    assert r0["outcomes"] == r1["outcomes"] and r0["disagree_clean"] == r1["disagree_clean"] == 0
    ref = TargetWorker(_worker_model(), dtype="float32", max_slots=4, max_len=64)
    expected = _worker_script(ref, _worker_model())
    assert sum(o[1] for o in expected) >= 10 and any(o[3] for o in expected)  # drafts and tree nodes accepted
    # greedy and seeded sequences: the single-rank outcomes (the unseeded one only matches across ranks)
    assert [o for o in r0["outcomes"] if o[0] != 2] == [o for o in expected if o[0] != 2]
    # a rank whose LM head disagrees follows rank 0
    assert r1["forced"] == r0["forced"] and r0["disagree_forced"] == 0 and r1["disagree_forced"] > 0


def test_shard_errors():
    with pytest.raises(ValueError, match="num_key_value_heads"):
        shard_model(random_model(heads=4, kv_heads=1), 0, 2)
    with pytest.raises(ValueError, match="num_attention_heads"):
        shard_model(random_model(heads=4, kv_heads=2), 0, 3)
    with pytest.raises(ValueError, match="rank"):
        shard_model(random_model(), 2, 2)
    m = random_model()
    assert shard_model(m, 0, 1) is m and isinstance(m.layers[0].self_attn.o_proj, nn.Linear)


# -- placement plans and the CLI (no Ray) ----------------------------------------------------------


def test_tp_placement_plans():
    from ssd.config import Config
    from ssd.launch.placement import plan_placement

    p = plan_placement(Config(target="t", mode="ar", extra={"target_tp": 2}), [0, 1, 2, 3, 4])
    assert [(t.cpu_cores, t.num_threads, t.num_cpus, t.bundle) for t in p.targets] == [
        ([0, 1], 2, 2.0, 0), ([2, 3], 2, 2.0, 1)]  # equal shares; core 4 idle
    assert p.target is p.targets[0] and p.bundles == [{"CPU": 2.0}, {"CPU": 2.0}]
    # this box: 2 cores, a draft: the ranks share the target's core, one thread each
    p = plan_placement(Config(target="t", draft="d", mode="sd", extra={"target_tp": 2}), [0, 1])
    assert [(t.cpu_cores, t.num_threads, t.num_cpus) for t in p.targets] == [([0], 1, 0.5), ([0], 1, 0.5)]
    assert p.draft.cpu_cores == [1] and p.draft.bundle is None
    # the target's two cores shared with the draft (the draft takes "the rest": none left): half a CPU each
    p = plan_placement(Config(target="t", draft="d", mode="sd", target_cores=[0, 1], extra={"target_tp": 2}), [0, 1])
    assert p.draft.cpu_cores == [0, 1]
    assert sum(t.num_cpus for t in p.targets) + p.draft.num_cpus <= 2
    g = plan_placement(Config(target="t", draft="d", mode="sd", device="cuda", extra={"target_tp": 4}), [0])
    assert [t.bundle for t in g.targets] == [0, 1, 2, 3] and g.draft.bundle == 4
    assert g.bundles == [{"GPU": 1, "CPU": 1}] * 5 and all(t.num_gpus == 1 for t in g.targets)
    one = plan_placement(Config(target="t", mode="ar"), [0, 1])
    assert one.targets == [one.target] and not one.bundles
    with pytest.raises(ValueError, match="target_tp"):
        plan_placement(Config(target="t", mode="ar", extra={"target_tp": 0}), [0])


def test_cli_target_tp_on_cpu(monkeypatch):
    from ssd.launch.cli import config_kwargs, serve_parser

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    k = config_kwargs(serve_parser().parse_args(["--target", "llama-70b", "--target-tp", "2"]))
    assert k["device"] == "cpu" and k["extra"]["target_tp"] == 2


def test_tp_without_ray_is_an_error():
    from ssd import LLM

    with pytest.raises(ValueError, match="use_ray"):
        LLM(target=random_model(), mode="ar", use_ray=False, extra={"target_tp": 2})


# -- Ray ------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def ray_local():
    ray = pytest.importorskip("ray")
    start_ray(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield ray
    ray.shutdown()


@pytest.mark.ray
def test_ray_tp2_equals_tp1(ray_local):
    from ssd import LLM, SamplingParams

    target = random_model(vocab=40, layers=2, seed=3, scale=2.0)
    draft = random_model(vocab=40, layers=1, seed=4, scale=2.0)
    common = dict(dtype="float32", max_batch=2, max_len=128)
    prompts = [[1, 2, 3, 4], [7, 7, 7], [20]]
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    sampled = SamplingParams(temperature=0.9, max_tokens=10, seed=7, ignore_eos=True)
    with LLM(target=target, mode="ar", **common) as llm:
        ref = [o.token_ids for o in llm.generate(prompts, greedy)]
    with LLM(target=target, draft=draft, mode="sd", k=3, **common) as llm:
        ref_sampled = [o.token_ids for o in llm.generate(prompts, sampled)]
    tp = {"target_tp": 2}
    with LLM(target=target, mode="ar", use_ray=True, extra=tp, **common) as llm:
        assert [o.token_ids for o in llm.generate(prompts, greedy)] == ref
        h = llm._handles[0]
        infos = [f.result() for f in h.call_all("info")]
        assert [i["tp_rank"] for i in infos] == [0, 1] and infos[0]["pid"] != infos[1]["pid"]
        assert h.call_all("ping")[1].result() is True
    with LLM(target=target, draft=draft, mode="sd", k=3, use_ray=True, extra=tp, **common) as llm:
        assert [o.token_ids for o in llm.generate(prompts, greedy)] == ref
        assert [o.token_ids for o in llm.generate(prompts, sampled)] == ref_sampled
        infos = [f.result() for f in llm._handles[0].call_all("info")]
        assert [i["tp_disagreements"] for i in infos] == [0, 0]  # the ranks agreed without help
    assert os.getpid()  # the driver survived; actors are gone with the LLMs


@pytest.mark.ray
def test_ray_tp_degree_that_does_not_divide_the_heads_says_why(ray_local):
    """A rank's constructor error reaches the user as its own text first, not buried in Ray's traceback."""
    from ssd import LLM
    from ssd.handles import WorkerDied

    with pytest.raises(WorkerDied, match=r"failed to start: ValueError: tensor parallelism: num_attention_heads"):
        LLM(target=random_model(heads=4, kv_heads=2), mode="ar", dtype="float32", max_len=64, use_ray=True,
            extra={"target_tp": 3})


def test_creation_error_text():
    from ssd.launch.actors import creation_error

    class ActorDied(Exception):
        actor_init_failed = True
        error_msg = ("The actor died because of an error raised in its creation task, \x1b[36mray::A.__init__()"
                     "\x1b[39m (pid=1)\n  File \"x.py\", line 5, in __init__\nValueError: bad tp\nsecond line")

    assert creation_error(ActorDied()) == "ValueError: bad tp\nsecond line"
    ActorDied.error_msg = ("ray::A.__init__() (pid=1)\n  File \"hf.py\", line 3, in load\nKeyError: 'heads'\n\n"
                           "The above exception was the direct cause of the following exception:\n\n"
                           "  File \"hf.py\", line 5, in load\nValueError: config.json: missing field 'heads'")
    assert creation_error(ActorDied()) == "ValueError: config.json: missing field 'heads'"  # not its cause
    ActorDied.actor_init_failed = False  # a death after start-up: no constructor error to report
    assert creation_error(ActorDied()) is None
    assert creation_error(RuntimeError("x")) is None
