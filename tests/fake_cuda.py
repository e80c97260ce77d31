"""A fake of the torch.cuda calls the executor makes, for CPU tests.

Graphs re-run the calls recorded while capturing on replay; streams, events
and pools are tokens. What it checks is the executor's protocol (which calls,
in which order, on which thread), not CUDA itself: the GPU tests do that.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
import weakref
from pathlib import Path

import torch


class FakeStream:
    def __init__(self, sid=1, device=None):
        self.cuda_stream = sid
        self.waited = []
        #: the streams it was made to wait on (``wait_stream``), in order
        self.waited_streams = []

    def __eq__(self, other):
        return isinstance(other, FakeStream) and other.cuda_stream == self.cuda_stream

    __hash__ = object.__hash__

    def wait_event(self, ev):
        self.waited.append(ev)

    def wait_stream(self, other):
        self.waited_streams.append(other)

    def synchronize(self):
        pass


class FakeEvent:
    def __init__(self):
        self.records = 0

    def record(self, stream=None):
        self.records += 1


class Fake:
    """State of the fake CUDA: which graph records, each thread's current stream."""

    def __init__(self):
        self.local = threading.local()
        self.default = FakeStream(0)
        #: ids of new streams (id(object()) repeats: a freed object's address is reused at once)
        self.stream_ids = itertools.count(1000)
        self.recording = None
        self.pools = 0
        self.modes = []
        #: segments memory_snapshot() reports besides those of pool_tensor()
        self.segments: list[dict] = []
        self._pooled: list[tuple[weakref.ref, tuple[int, int]]] = []
        #: scratch pools (torch.cuda.MemPool) made, and how many were destroyed
        self.mempools = 0
        self.mempools_freed = 0
        #: tensors made by alloc(): what torch.cuda.memory_allocated counts
        self._allocated: list[weakref.ref] = []

    def pool_tensor(self, *shape) -> torch.Tensor:
        """A tensor in the pool of the graph being recorded: a segment of its
        own for as long as the tensor lives, as memory_snapshot reports it."""
        t = torch.zeros(*shape)
        self._pooled.append((weakref.ref(t), self.recording.pool()))
        return t

    def alloc(self, *shape) -> torch.Tensor:
        """A tensor in the ordinary allocator (a warm-up's buffer): counted by
        ``torch.cuda.memory_allocated`` for as long as it lives."""
        t = torch.zeros(*shape)
        self._allocated.append(weakref.ref(t))
        return t

    def allocated(self) -> int:
        live = [r() for r in self._allocated]
        return sum(t.untyped_storage().nbytes() for t in live if t is not None)

    def snapshot(self) -> list[dict]:
        live = [(r(), pool) for r, pool in self._pooled]
        return self.segments + [
            {"address": t.data_ptr(), "total_size": t.untyped_storage().nbytes(), "segment_pool_id": pool}
            for t, pool in live
            if t is not None
        ]


class FakeMemPool:
    def __init__(self, fake):
        self.fake = fake
        fake.mempools += 1
        #: its id, as torch.cuda.MemPool.id (a graph can record into it): apart from graph_pool_handle's
        self.id = (1, fake.mempools)

    def __del__(self):
        self.fake.mempools_freed += 1


def _run_capture_hooks(which: str, graph) -> None:
    """Run torch's global capture hooks (``register_graph_capture_{start,end}_hook``,
    torch 2.14 on) as torch.cuda.CUDAGraph.capture_begin/capture_end do, errors swallowed
    as theirs are (torch/cuda/graphs.py ``_run_global_hooks``); nothing on a torch without
    them unless :func:`emulate_capture_hooks` put them in."""
    registry = getattr(torch.cuda.graphs, f"_global_capture_{which}_hooks", None)
    for fn in list(registry.values()) if registry else ():
        try:
            fn(graph)
        except Exception:  # noqa: S110  # as torch's fan-out: a hook cannot break a capture
            pass


def emulate_capture_hooks(monkeypatch) -> None:
    """Give a torch without them (before 2.14) the global capture-hook registrations of
    torch 2.14's torch/cuda/graphs.py (an OrderedDict per kind, a removable handle each),
    so the executor's hook path is tested under any torch; a torch that has them keeps its own."""
    from collections import OrderedDict

    from torch.utils.hooks import RemovableHandle

    graphs = torch.cuda.graphs
    if callable(getattr(graphs, "register_graph_capture_start_hook", None)):
        return
    for which in ("start", "end"):
        registry: OrderedDict = OrderedDict()

        def register(fn, registry=registry):
            handle = RemovableHandle(registry)
            registry[handle.id] = fn
            return handle

        monkeypatch.setattr(graphs, f"_global_capture_{which}_hooks", registry, raising=False)
        monkeypatch.setattr(graphs, f"register_graph_capture_{which}_hook", register, raising=False)


class FakeGraph:
    def __init__(self, fake, keep_graph=False):
        self.fake, self.calls, self.keep_graph = fake, [], keep_graph
        self.instantiated = 0

    def raw_cuda_graph(self):
        # no driver graph behind a fake one: as torch says of a graph without keep_graph
        raise RuntimeError(
            "You cannot access the raw cudaGraph_t instance unless CUDAGraph was initialized with keep_graph=True"
        )

    def instantiate(self):
        self.instantiated += 1

    def capture_begin(self, pool=None, capture_error_mode="global", **kw):
        self.fake.modes.append(capture_error_mode)
        #: the stream it records on (the thread's current stream)
        self.stream = getattr(self.fake.local, "stream", self.fake.default)
        self._pool = pool
        self.fake.recording = self
        _run_capture_hooks("start", self)

    def capture_end(self):
        # torch 2.14 runs the end hooks with the capture still live, before instantiating
        _run_capture_hooks("end", self)
        self.fake.recording = None

    def pool(self):
        """The pool it records into, as ``torch.cuda.CUDAGraph.pool()``."""
        return self._pool

    def replay(self):
        for fn in self.calls:
            fn()

    def reset(self):
        self.calls = []


def install(monkeypatch) -> Fake:
    """Fake torch.cuda through ``monkeypatch`` (undone with it); the ``fake`` fixture of tests/conftest.py."""
    f = Fake()
    cuda = torch.cuda

    def current_stream(device=None):
        return getattr(f.local, "stream", f.default)

    @contextlib.contextmanager
    def stream(s):
        old = current_stream()
        f.local.stream = s
        try:
            yield
        finally:
            f.local.stream = old

    def pool_handle():
        f.pools += 1
        return (0, f.pools)

    @contextlib.contextmanager
    def use_mem_pool(pool, device=None):
        old = getattr(f.local, "mempool", None)
        f.local.mempool = pool
        try:
            yield
        finally:
            f.local.mempool = old

    class CUDAGraph(FakeGraph):  # a class, as torch's: code may wrap its methods
        def __init__(self, keep_graph=False):
            super().__init__(f, keep_graph)

    capture_side = FakeStream(999)

    class graph:  # torch.cuda.graph's protocol: its stream (a side stream by default), begin and end
        def __init__(self, cuda_graph, pool=None, stream=None, capture_error_mode="global"):
            self.cuda_graph, self.pool, self.mode = cuda_graph, () if pool is None else (pool,), capture_error_mode
            self.ctx = torch.cuda.stream(stream if stream is not None else capture_side)

        def __enter__(self):
            self.ctx.__enter__()
            self.cuda_graph.capture_begin(*self.pool, capture_error_mode=self.mode)

        def __exit__(self, *exc):
            self.cuda_graph.capture_end()
            self.ctx.__exit__(*exc)
            return False

    from capture_plan.executor import streams

    monkeypatch.setattr(streams, "_streams", {})  # the fake's streams are this test's alone
    empty_like = torch.empty_like

    def tracked_empty_like(*a, **kw):  # an engine's persistent buffer: counted by memory_allocated
        t = empty_like(*a, **kw)
        f._allocated.append(weakref.ref(t))
        return t

    monkeypatch.setattr(torch, "empty_like", tracked_empty_like)
    for name, value in {
        "Stream": lambda device=None: FakeStream(next(f.stream_ids)),
        "Event": FakeEvent,
        "current_stream": current_stream,
        "default_stream": lambda device=None: f.default,
        "stream": stream,
        "set_device": lambda d: None,
        "synchronize": lambda d=None: None,
        "empty_cache": lambda: None,
        "memory_snapshot": lambda mempool_id=None: f.snapshot(),
        "memory_reserved": lambda d=None: sum(s["total_size"] for s in f.snapshot()),
        "graph_pool_handle": pool_handle,
        "CUDAGraph": CUDAGraph,
        "graph": graph,
        "is_current_stream_capturing": lambda: f.recording is not None,
        "current_device": lambda: 0,
        "mem_get_info": lambda device=None: (0, 0),
        "memory_allocated": lambda d=None: f.allocated(),
        # the allocator's statistics as the fake counts them (no peak beyond the current bytes)
        "memory_stats": lambda d=None: {
            "allocated_bytes.all.current": f.allocated(),
            "allocated_bytes.all.peak": f.allocated(),
        },
        "reset_peak_memory_stats": lambda d=None: None,
        "MemPool": lambda: FakeMemPool(f),
        "use_mem_pool": use_mem_pool,
    }.items():
        monkeypatch.setattr(cuda, name, value, raising=False)
    return f


class Target:
    """out = x[:bs] * 2 + 1 into a static per-size buffer; a graph replay re-runs it."""

    def __init__(self, fake, max_bs=16, fail_at=None, gate_at=None):
        self.fake = fake
        self.x = torch.zeros(max_bs, 4)
        self.out = {}
        self.fail_at, self.gate_at = fail_at, gate_at
        self.gate, self.reached = threading.Event(), threading.Event()
        #: ("run" | "refresh", phase, bs, recording a graph?, workspace given?) of every call, in order
        self.calls: list[tuple[str, str, int, bool, bool]] = []
        #: per run: whether this thread's allocations went to a scratch pool (torch.cuda.use_mem_pool)
        self.scratch: list[bool] = []

    def run(self, phase, bs, ws):
        g = self.fake.recording
        self.calls.append(("run", phase, bs, g is not None, ws is not None))
        self.scratch.append(getattr(self.fake.local, "mempool", None) is not None)
        if g is not None and bs == self.gate_at:
            self.reached.set()
            assert self.gate.wait(30)
        if g is not None and bs == self.fail_at:
            raise ValueError("boom")
        out = self.out.setdefault(bs, torch.zeros(bs, 4))

        def compute():
            out.copy_(self.x[:bs] * 2 + 1)

        compute()
        if g is not None:
            g.calls.append(compute)
        return out

    def prepare(self, phase, n, bs, gen):
        self.x.normal_()

    def refresh(self, phase, n, bs, ws):
        self.calls.append(("refresh", phase, bs, self.fake.recording is not None, True))


def decode_plan(tmp_path: Path, sizes):
    """A torch-backend plan of one decode phase at ``sizes``, outputs kept
    (the fake has no device memory to take non-owning views of)."""
    from capture_plan.planner import BuildOptions, build_plan

    spec = tmp_path / "spec.toml"
    spec.write_text(f'[[phases]]\nname = "decode"\nkind = "decode"\nsizes = {list(sizes)}\n')
    return build_plan(BuildOptions(backend="torch", spec=spec, strategies=("outputs=keep",)))
