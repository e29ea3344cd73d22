"""Shared worker plumbing: model loading, thread control, per-sequence state."""

from __future__ import annotations

import contextlib
import copy
import os
from collections.abc import Iterator

import torch

from ssd.workers.messages import SamplingSpec
from ssd.workers.model_runner import ModelRunner
from ssd.workers.models.decoder import DecoderModel
from ssd.workers.models.hugepages import move_to_huge_pages
from ssd.workers.seq_state import SeqState, make_generator

DTYPES = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float32": torch.float32, "fp32": torch.float32}


def parse_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise ValueError(f"unsupported dtype {dtype!r}; use one of {sorted(DTYPES)}")
    return DTYPES[dtype]


def set_threads(num_threads: int | None, cpu_cores: list[int] | None) -> None:
    """Give the calling thread its own cores: pin it (Linux) and size torch's intra-op pool to match (each
    only where it differs: in one process a worker calls this before every call, see own_threads)."""
    if cpu_cores:
        if os.sched_getaffinity(0) != set(cpu_cores):
            os.sched_setaffinity(0, set(cpu_cores))
        if num_threads is None:
            num_threads = len(cpu_cores)
    if num_threads and torch.get_num_threads() != num_threads:
        torch.set_num_threads(num_threads)


class CoreLoan:
    """Cores a worker may compute on while their owner (the draft, on its own cores) sits idle.

    `borrowed()` widens the calling thread's affinity to own + spare cores and torch's pool (which
    the CPU kernels also use) by one thread per spare core, then puts both back. The pool's extra
    threads are created inside a loan and inherit the wide affinity; outside it they sleep. The
    kernels split work by output rows, never within a sum, so borrowed threads give the same bits.
    """

    def __init__(self, own: list[int], spare: list[int]) -> None:
        if not own or not spare or set(own) & set(spare):
            raise ValueError(f"a core loan needs own and spare cores, disjoint; got own={own}, spare={spare}")
        self.own, self.spare = sorted(own), sorted(spare)

    @property
    def threads(self) -> int:
        return len(self.own) + len(self.spare)

    @contextlib.contextmanager
    def borrowed(self) -> Iterator[None]:
        threads = torch.get_num_threads()
        os.sched_setaffinity(0, set(self.own) | set(self.spare))
        torch.set_num_threads(self.threads)
        try:
            yield
        finally:
            torch.set_num_threads(threads)
            os.sched_setaffinity(0, set(self.own))


def build_model(
    model: str | DecoderModel, dtype: torch.dtype, device: str, quantization: str | None = None,
    linear_kernel: str = "auto",
) -> tuple[DecoderModel, object | None]:
    """A DecoderModel from an alias / path (loaded) or an already-built module (tests). Returns (model, tokenizer).

    quantization ("int8" / "int4" / "w4a8" / "w8a8"): quantised linear layers (workers/models/quant.py).
    An already-built module whose nn.Linear layers get quantised or converted is copied first: the caller's
    module (e.g. one passed as both target and draft, each in its own format) keeps them. One with none left (a
    model already quantised or converted, as the real-model tests pass: a copy of those would double their
    memory) is used as it is. linear_kernel: see `workers.models.dense.apply_linear_kernel`.
    """
    from ssd.workers.models.dense import apply_linear_kernel

    if isinstance(model, DecoderModel):
        if (quantization is not None or linear_kernel != "torch") and any(
                isinstance(m, torch.nn.Linear) for m in model.modules()):
            model = copy.deepcopy(model)
        model = model.to(device=device, dtype=dtype).eval()
        if quantization is not None:
            from ssd.workers.models.quant import quantize_model

            quantize_model(model, quantization)
        return apply_linear_kernel(model, linear_kernel), None
    from ssd.workers.loader import load_model

    loaded = load_model(model, dtype=dtype, device=device, quantization=quantization)
    return apply_linear_kernel(loaded.model, linear_kernel), loaded.tokenizer


class ModelWorker:
    """A model runner plus per-sequence state; TargetWorker and DraftWorker build on it."""

    salt = 0

    def __init__(
        self,
        model: str | DecoderModel,
        *,
        dtype: str | torch.dtype = "bfloat16",
        device: str = "cpu",
        max_slots: int = 8,
        max_len: int = 2048,
        num_threads: int | None = None,
        cpu_cores: list[int] | None = None,
        quantization: str | None = None,
        linear_kernel: str = "auto",
        cuda_graphs: bool = True,
        spare_cores: list[int] | None = None,
    ) -> None:
        set_threads(num_threads, cpu_cores)
        self._threads = (num_threads, list(cpu_cores) if cpu_cores else None)  # own_threads repeats it per call
        # spare_cores: another worker's cores this one may borrow while that worker is idle (CPU only).
        self.loan = CoreLoan(cpu_cores or [], spare_cores) if spare_cores else None
        if self.loan is not None and device != "cpu":
            raise ValueError("spare_cores (borrowing another worker's cores) is for CPU workers")
        self.device = device
        self.linear_kernel = linear_kernel
        # The timing probe's slot and context length: start-up's timing calls share one prefill of the context
        # (the 1.5B's on one core takes ~0.7 s a call); the first sequence's slot, or release_probe, frees it.
        self._probe: tuple[int, int] | None = None
        self.model, self.tokenizer = self.load_model(model, parse_dtype(dtype), device, quantization)
        if device == "cpu":
            move_to_huge_pages(self.model)  # same bits; fewer TLB misses while a step streams the weights
        self.config = self.model.config
        self.runner = ModelRunner(self.model, max_slots=max_slots, max_len=max_len, device=device,
                                  cuda_graphs=cuda_graphs)
        self.seqs: dict[int, SeqState] = {}

    def load_model(
        self, model: str | DecoderModel, dtype: torch.dtype, device: str, quantization: str | None
    ) -> tuple[DecoderModel, object | None]:
        """(model, tokenizer) this worker runs; a subclass may transform the model (tensor-parallel sharding)."""
        return build_model(model, dtype, device, quantization, self.linear_kernel)

    def info(self) -> dict:
        cfg = self.config
        return {
            "vocab_size": cfg.vocab_size,
            "eos_token_ids": list(cfg.eos_token_ids),
            "max_len": self.runner.max_len,
            "max_position_embeddings": cfg.max_position_embeddings,
            "arch": cfg.arch,
            "num_threads": torch.get_num_threads(),
            "borrow_threads": 0 if self.loan is None else self.loan.threads,
            "cuda_graphs": self.runner.graphs is not None,
            "linear_kernel": getattr(self.model, "linear_kernel", None) or getattr(self.model, "quantization", None)
            or "torch",
        }

    def ping(self) -> bool:
        return True

    def own_threads(self) -> None:
        """Pin the calling thread to this worker's cores and size torch's pool for it, as the constructor did
        for the thread that built the worker. In one process (LocalHandle) the worker's calls run on a thread of
        their own, which otherwise kept the affinity of its creator: after building target then draft, both
        workers computed on the draft's cores (session 41: SSD at placement a ran target and draft on one core).
        torch's thread count is per process, so it is set again for each call of a worker whose count differs."""
        set_threads(*self._threads)

    def add(self, seq_id: int, prompt_ids: list[int], spec: SamplingSpec) -> None:
        """Prefill all but the last prompt token; the last one is the first pending token."""
        if seq_id in self.seqs:
            raise ValueError(f"sequence {seq_id} already added")
        slot = self.prefilled_slot(prompt_ids)
        self.seqs[seq_id] = SeqState(
            slot=slot, pending=prompt_ids[-1], committed=len(prompt_ids) - 1, spec=spec,
            gen=make_generator(spec.seed, self.salt),
        )

    def extend(self, seq_id: int, prompt_ids: list[int], borrow: bool = False) -> None:
        """Prefill more prompt tokens (a prompt added in pieces: `add` took the first): the same cache and
        state as if they had come with `add`."""
        st = self.seqs.get(seq_id)
        if st is None:
            raise KeyError(f"sequence {seq_id} not added")
        if not prompt_ids:
            raise ValueError("extend needs at least one prompt token")
        if self.runner.kv.lengths[st.slot] != st.committed:
            raise ValueError(f"sequence {seq_id} has speculative tokens in its cache: extend only a prompt")
        with self._cores(borrow):
            self.runner.forward([st.slot], [[st.pending, *prompt_ids[:-1]]], last_only=True)
        st.pending, st.committed = prompt_ids[-1], st.committed + len(prompt_ids)

    def prefilled_slot(self, prompt_ids: list[int]) -> int:
        """A new cache slot holding all but the last prompt token (freed again if the prefill fails)."""
        if not prompt_ids:
            raise ValueError("empty prompt")
        self.release_probe()
        slot = self.runner.allocate()
        try:
            if len(prompt_ids) > 1:
                self.runner.forward([slot], [prompt_ids[:-1]], last_only=True)
        except Exception:
            self.runner.free(slot)
            raise
        return slot

    def remove(self, seq_id: int) -> None:
        st = self.seqs.pop(seq_id, None)
        if st is not None:
            self.runner.free(st.slot)

    def time_forwards(
        self, ns: list[int], context: int = 128, tree: bool = False, reps: int = 3, borrow: bool = False
    ) -> dict[int, float]:
        """Median seconds of one forward scoring n tokens after a context (a chain, or n siblings), for
        each n in `ns`; `borrow`: on borrowed cores too (see `loan`).

        Used to auto-configure K, the fan-out budget and the policy's prices from this device's real
        latencies. The context is prefilled once for all n (a 128-token prefill of the 1.5B on one core
        takes longer than all its timed forwards), and the repetitions go round the n's, so a drift of
        the machine's speed moves every n alike instead of bending the measured curve.
        """
        with self._cores(borrow):
            return self._time_forwards(ns, context, tree, reps)

    def _cores(self, borrow: bool) -> contextlib.AbstractContextManager:
        if not borrow:
            return contextlib.nullcontext()
        if self.loan is None:
            raise ValueError("this worker has no cores to borrow (spare_cores not given)")
        return self.loan.borrowed()

    def _time_forwards(self, ns: list[int], context: int, tree: bool, reps: int) -> dict[int, float]:
        import time

        if not ns or min(ns) < 1:
            raise ValueError(f"time_forwards needs token counts >= 1, got {ns}")
        with self._probe_slot(context, max(ns)) as (slot, context):
            times: dict[int, list[float]] = {n: [] for n in ns}
            for _ in range(reps + 1):  # the first round warms up and is dropped
                for n in ns:
                    self.runner.truncate(slot, context)
                    toks = self._probe_tokens(n)
                    t0 = time.perf_counter()
                    self.runner.forward([slot], toks, parents=[[-1] * n] if tree else None)
                    self._wait_device()
                    times[n].append(time.perf_counter() - t0)
            return {n: sorted(t[1:])[len(t[1:]) // 2] for n, t in times.items()}

    def keep_busy(self, seconds: float, n: int = 4, context: int = 128) -> int:
        """Run n-token forwards after a context for about `seconds`, as SSD's speculation keeps this worker
        busy while the target verifies; returns how many ran. Start-up uses it to time the target's
        verification beside a working draft (on CPU the two share the memory path)."""
        import time

        with self._probe_slot(context, n) as (slot, context):
            toks = self._probe_tokens(n)
            done, end = 0, time.perf_counter() + seconds
            while done == 0 or time.perf_counter() < end:
                self.runner.truncate(slot, context)
                self.runner.forward([slot], toks)
                self._wait_device()  # the clock must see the work, not a growing CUDA queue
                done += 1
            return done

    @contextlib.contextmanager
    def _probe_slot(self, context: int, longest: int) -> Iterator[tuple[int, int]]:
        """A slot prefilled with a synthetic context (shortened to leave room for `longest` more tokens), kept
        for the next timing call: (slot, context length). Freed by release_probe, or if the body fails."""
        context = max(1, min(context, self.runner.max_len - longest - 1))
        if self._probe is None or self._probe[1] != context:
            self.release_probe()
            slot = self.runner.allocate()
            self._probe = (slot, context)
            try:
                self.runner.forward([slot], [[i % self.config.vocab_size for i in range(context)]], last_only=True)
            except BaseException:
                self.release_probe()
                raise
        try:
            yield self._probe
        except BaseException:
            self.release_probe()
            raise
        self.runner.truncate(self._probe[0], context)

    def release_probe(self) -> None:
        """Free the timing probe's slot (start-up calls it once its measurements are done)."""
        if self._probe is not None:
            self.runner.free(self._probe[0])
            self._probe = None

    def _probe_tokens(self, n: int) -> list[list[int]]:
        return [[(7 * i) % self.config.vocab_size for i in range(n)]]

    def _wait_device(self) -> None:
        if self.runner.device.type == "cuda":
            torch.cuda.synchronize(self.runner.device)

    def num_free_slots(self) -> int:
        return self.runner.kv.num_free
