"""CUDA graphs of the runner's chain forwards (workers/cuda_graphs.py).

`chain_forward` (what a graph captures: positions, cache writes and the mask derived on the device)
is checked against the runner's eager forward on any device. The capture/replay tests need CUDA.
"""

import pytest
import torch
from tiny_models import GREEDY, PROMPTS, random_model

from ssd import LLM
from ssd.workers.cuda_graphs import MIN_BUCKET, CudaGraphs, length_bucket
from ssd.workers.model_runner import ModelRunner

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def test_length_bucket():
    assert length_bucket(1, 2048) == MIN_BUCKET
    assert length_bucket(MIN_BUCKET + 1, 2048) == 2 * MIN_BUCKET
    assert length_bucket(1000, 2048) == 1024
    assert length_bucket(1500, 1536) == 1536  # capped at the cache length


def host_graphed(runner: ModelRunner) -> ModelRunner:
    """Put a CPU runner on the graph path: host-built inputs, static shapes, a scratch slot, the shared
    logits buffer, with capture=False (the same forward, run eagerly). Takes one of its slots."""
    runner.graphs = CudaGraphs(runner.model, runner.kv, scratch_slot=runner.allocate(), capture=False)
    return runner


@pytest.fixture
def host_graphs(monkeypatch):
    """Every runner built in the test takes the graph path on the CPU (see host_graphed)."""
    init = ModelRunner.__init__

    def graphed_init(self, model, max_slots, max_len, device="cpu", cuda_graphs=True):
        init(self, model, max_slots + 1, max_len, device, cuda_graphs=False)
        host_graphed(self)

    monkeypatch.setattr(ModelRunner, "__init__", graphed_init)


def test_graph_inputs_match_eager_for_chains_ragged_rows_and_trees():
    """Chains, ragged rows and tree steps in reversed slots: the logits of every real token and the cache
    entries equal the eager forward's, and padding never writes into a sequence's slot."""
    model = random_model(vocab=64, layers=2, hidden=64, heads=4, kv_heads=2, seed=3)
    eager = ModelRunner(model, max_slots=2, max_len=600)
    graphed = host_graphed(ModelRunner(model, max_slots=3, max_len=600))
    slot_pairs = []
    for r in (eager, graphed):
        slots = [r.allocate(), r.allocate()]
        for s, prompt in zip(slots, ([1, 2, 3, 4, 5, 6, 7], [9, 8])):
            r.forward([s], [prompt])
        slot_pairs.append(slots[::-1])  # reversed
    steps = [
        ([[5, 6, 7], [10, 11, 12]], None),  # chains of equal length
        ([[5], [10, 11, 12, 13]], None),  # ragged rows: row 0 padded
        ([[1, 2, 3], [4, 5]], [[-1, -1, 0], [-1, 0]]),  # tree step: siblings and a child
        ([[6, 7], [8]], [[2, 1], [1]]),  # the tree grows under earlier nodes
    ]
    for tokens, parents in steps:
        outs = []
        for r, slots in zip((eager, graphed), slot_pairs):
            outs.append(r.forward(slots, tokens, parents=parents))
        for b, row in enumerate(tokens):  # padding rows' logits are not defined
            torch.testing.assert_close(outs[1][b, : len(row)], outs[0][b, : len(row)], rtol=1e-5, atol=1e-5)
        for se, sg in zip(*slot_pairs):
            assert eager.length(se) == graphed.length(sg)
            n = eager.length(se)
            torch.testing.assert_close(graphed.kv.k[:, sg, :, :n], eager.kv.k[:, se, :, :n], rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(graphed.kv.v[:, sg, :, :n], eager.kv.v[:, se, :, :n], rtol=1e-5, atol=1e-5)
    for r, slots in zip((eager, graphed), slot_pairs):
        for s in slots:
            r.truncate(s, r.length(s))  # close the tree regions
    last = [r.forward(slots, [[3], [4, 5]], last_only=True) for r, slots in zip((eager, graphed), slot_pairs)]
    torch.testing.assert_close(last[1], last[0], rtol=1e-5, atol=1e-5)  # [B, V] at each row's last token


@pytest.mark.parametrize("ahead", [True, False])
def test_capture_ahead_takes_every_longer_bucket_and_writes_only_the_scratch_slot(ahead):
    """A shape's first forward at bucket 256 also builds its graphs for 512, 1024 and the cache length (1100) on
    padding; the forwards that later cross into 512 replay one of those with their real inputs and equal the
    eager forward, logits and cache alike."""
    model = random_model(vocab=64, layers=2, hidden=64, heads=4, kv_heads=2, seed=4)
    eager = ModelRunner(model, max_slots=1, max_len=1100)
    graphed = ModelRunner(model, max_slots=2, max_len=1100)
    graphed.graphs = CudaGraphs(model, graphed.kv, scratch_slot=graphed.allocate(), capture=False,
                                capture_ahead=ahead)
    se, sg = eager.allocate(), graphed.allocate()
    for r, s in ((eager, se), (graphed, sg)):
        r.forward([s], [[i % 60 + 1 for i in range(250)]], last_only=True)  # a prompt: eager on both
    for step in range(10):  # 250 -> 260 cached tokens: crosses from the 256 into the 512 bucket
        tok = [[(step * 11) % 60 + 1]]
        torch.testing.assert_close(graphed.forward([sg], tok), eager.forward([se], tok), rtol=1e-5, atol=1e-5)
        if step == 0:
            want = {(1, 1, 256), (1, 1, 512), (1, 1, 1024), (1, 1, 1100)} if ahead else {(1, 1, 256)}
            assert set(graphed.graphs.graphs) == want
    assert (1, 1, 512) in graphed.graphs.graphs
    n = eager.length(se)
    assert graphed.length(sg) == n == 260
    torch.testing.assert_close(graphed.kv.k[:, sg, :, :n], eager.kv.k[:, se, :, :n], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(graphed.kv.v[:, sg, :, :n], eager.kv.v[:, se, :, :n], rtol=1e-5, atol=1e-5)
    assert not graphed.kv.k[:, sg, :, n:].any()  # nothing past the sequence: padding went to the scratch slot


@pytest.mark.parametrize("linear_kernel", ["auto", "torch"])  # torch: no row plan, masked SDPA as on CUDA
@pytest.mark.parametrize("mode", ["ar", "sd", "ssd", "auto"])
def test_greedy_on_the_graph_path_equals_ar(models, ar_outputs, host_graphs, mode, linear_kernel):
    """Every forward of target and draft (SSD's tree steps included) through the graph inputs."""
    with LLM(target=models[0], draft=None if mode == "ar" else models[1], mode=mode, k=3, fanout=8, dtype="float32",
             max_batch=3, max_len=128, linear_kernel=linear_kernel) as llm:
        assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == ar_outputs


def test_graphs_off_on_cpu_and_config_plumbing():
    model = random_model(vocab=64, layers=1, hidden=32, heads=4, kv_heads=2)
    assert ModelRunner(model, max_slots=1, max_len=64, device="cpu").graphs is None  # CPU: never
    with LLM(target=model, dtype="float32", max_batch=1, max_len=64, cuda_graphs=False) as llm:
        assert llm.config.cuda_graphs is False


@needs_cuda
@pytest.mark.parametrize("n", [1, 5])
def test_graph_replay_matches_eager_on_cuda(n):
    model = random_model(vocab=128, layers=2, hidden=64, heads=4, kv_heads=2, seed=5).cuda()
    runners = [ModelRunner(model, max_slots=3, max_len=2048, device="cuda", cuda_graphs=g) for g in (False, True)]
    assert runners[0].graphs is None and runners[1].graphs is not None
    prompts = ([1, 2, 3], [i % 128 for i in range(200)], [7])  # token ids < vocab
    ids = []  # each runner's slots (the graphed one keeps a scratch slot of its own)
    for r in runners:
        ids.append([r.allocate() for _ in prompts])
        for s, prompt in zip(ids[-1], prompts):
            r.forward([s], [prompt], last_only=True)
    for step in range(300):  # the 2nd sequence crosses the 256-token bucket; 1..3 rows, varying order
        rows = [[2, 0, 1], [1], [0, 2]][step % 3]
        lens = [n, max(1, n - 2), n][: len(rows)]  # ragged rows too
        tokens = [[(step * 7 + b + i) % 128 for i in range(m)] for b, m in enumerate(lens)]
        want, got = (r.forward([sl[i] for i in rows], tokens) for r, sl in zip(runners, ids))
        for b, m in enumerate(lens):
            torch.testing.assert_close(got[b, :m], want[b, :m], rtol=1e-4, atol=1e-4)
        if step % 2:  # rollback, as after rejected drafts
            for r, sl in zip(runners, ids):
                for i in rows:
                    r.truncate(sl[i], r.length(sl[i]) - 1)
    assert [runners[0].length(s) for s in ids[0]] == [runners[1].length(s) for s in ids[1]]
    assert {key[2] for key in runners[1].graphs.graphs} >= {256, 512}  # both length buckets were captured


@needs_cuda
@pytest.mark.parametrize("mode", ["ar", "sd", "ssd", "auto"])
def test_greedy_with_cuda_graphs_equals_eager(mode):
    target = random_model(vocab=256, layers=3, hidden=128, heads=4, kv_heads=2, seed=1, scale=2.0)
    draft = random_model(vocab=256, layers=1, hidden=64, heads=4, kv_heads=2, seed=2, scale=2.0)
    outs = []
    for graphs in (False, True):
        with LLM(target=target, draft=None if mode == "ar" else draft, mode=mode, k=3, fanout=8, device="cuda",
                 dtype="float32", max_batch=4, max_len=256, use_ray=False, cuda_graphs=graphs) as llm:
            outs.append([o.token_ids for o in llm.generate(PROMPTS, GREEDY)])
    assert outs[0] == outs[1]


class _Worker:
    def __init__(self, device: str) -> None:
        self.device = device
        self.overlapped = False

    def work(self, shared: list, x: int = 0) -> int:
        import time

        shared[0] += 1
        self.overlapped |= shared[0] > 1
        time.sleep(0.05)
        shared[0] -= 1
        return x + 1


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_in_process_cuda_workers_take_turns(device):
    """Two in-process CUDA workers never run at once (a graph capture must not see the other's work);
    CPU workers overlap. A call waiting on the other worker's future does not deadlock."""
    from ssd.handles import LocalHandle

    shared = [0]
    a, b = LocalHandle(_Worker(device), "a"), LocalHandle(_Worker(device), "b")
    for _ in range(3):
        fa = a.call("work", shared)
        fb = b.call("work", shared, fa)  # b's argument is a's result
        assert fb.result(timeout=10) == 2
        a.call("work", shared).result(), b.call("work", shared).result()
        futs = [a.call("work", shared), b.call("work", shared)]
        [f.result(timeout=10) for f in futs]
    overlapped = a.worker.overlapped or b.worker.overlapped
    assert overlapped == (device == "cpu")
    a.shutdown(), b.shutdown()
