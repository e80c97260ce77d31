"""Looking into graph pools: reserved bytes, raw byte views, allocation history.

Built on ``torch.cuda.memory_snapshot`` (segments carry ``segment_pool_id``) and
``torch.cuda.memory._record_memory_history`` (ordered alloc/free events). Both
are private-ish torch APIs; everything touching them lives here.
"""

from __future__ import annotations

import contextlib
from bisect import bisect_right
from dataclasses import dataclass, field

import torch

__all__ = [
    "pool_segments",
    "pool_reserved",
    "pool_usage",
    "one_pool_reserved",
    "in_pools",
    "weak_view",
    "raw_bytes",
    "scratch_pool",
    "Scratch",
    "pool_key",
    "AllocationRecorder",
    "Window",
]


def pool_key(pool) -> tuple[int, int]:
    """A pool's id as a plain tuple, however it is spelled (handle, snapshot list, MemPool id)."""
    # graph_pool_handle() and snapshots spell ids differently; every spelling is two ints
    return tuple(int(x) for x in pool)  # pyright: ignore[reportReturnType]


def pool_segments(pools) -> list[tuple[int, int]]:
    """(address, bytes) of every segment of the given pools, sorted by address."""
    want = {pool_key(p) for p in pools}
    segs = [
        (s["address"], s["total_size"])
        for s in torch.cuda.memory_snapshot()
        if s.get("segment_pool_id") is not None and pool_key(s["segment_pool_id"]) in want
    ]
    return sorted(segs)


def pool_reserved(pools) -> int:
    return sum(size for _, size in pool_segments(pools))


def pool_usage(pools) -> tuple[int, int]:
    """(reserved, allocated) bytes of the given pools, from one snapshot."""
    want = {pool_key(p) for p in pools}
    reserved = allocated = 0
    for s in torch.cuda.memory_snapshot():
        if s.get("segment_pool_id") is not None and pool_key(s["segment_pool_id"]) in want:
            reserved += s["total_size"]
            allocated += s.get("allocated_size", 0)
    return reserved, allocated


class Scratch:
    """What a :func:`scratch_pool` block reserved at its peak (0 where not measured)."""

    reserved: int = 0


@contextlib.contextmanager
def scratch_pool(device):
    """Route this thread's allocations into a private pool that is returned on exit.

    What the block frees goes back to the driver when it ends (``MemPool``'s
    destructor empties that pool alone: ``emptyCache(mempool_id)``), instead of
    staying cached in the ordinary allocator on the stream that used it, where
    only that stream could ever reuse it. Only the calling thread's
    allocations are routed (``use_mem_pool`` filters by thread), so an engine
    serving on another thread meanwhile, and the blocks the engine itself
    holds cached, are untouched. A tensor made inside and kept alive outlives
    the pool, which is destroyed on exit anyway: its whole segment then stays
    cached until the next ``torch.cuda.empty_cache()`` (``Scratch.reserved``
    counts it as returned): the executor's own blocks are all freed inside.

    Returning the segments frees device memory (``cudaFree``), which waits for
    the device (the engine's serving work too, from the capture thread), and
    the allocator refuses to empty a pool while any stream of the device is
    capturing: not for use while another thread of the process captures (the
    executor's own captures run between its warm-ups, never during one).
    Without ``torch.cuda.MemPool`` (torch before 2.6) it does nothing: the
    block's freed memory stays cached as before.

    Yields a :class:`Scratch` whose ``reserved`` is set on exit: the pool's
    segments, i.e. the block's peak reserved memory (segments are returned only
    when the pool is destroyed), which a capture budget must allow for on top
    of the pools captured so far.
    """
    box = Scratch()
    if not hasattr(torch.cuda, "MemPool") or not hasattr(torch.cuda, "use_mem_pool"):
        yield box
        return
    pool = torch.cuda.MemPool()
    try:
        with torch.cuda.use_mem_pool(pool, device=device):
            yield box
        pid = getattr(pool, "id", None)
        if pid is not None:
            box.reserved = one_pool_reserved(pid)
    finally:
        del pool  # the destructor releases the pool and returns its free segments


def one_pool_reserved(pool) -> int:
    """Reserved bytes of one pool, from the whole allocator's snapshot filtered by
    the pool's id.

    Never ``torch.cuda.memory_snapshot(mempool_id=)``, the per-pool snapshot this
    used to take (cheaper in a process with many blocks): on an H200 (torch 2.11)
    one long GPU test process segfaulted in a later ``memory_stats`` or
    ``memory_snapshot`` after per-pool snapshots of the warm-ups' scratch
    ``MemPool``; with the scratch pool measured from the whole snapshot the same
    tests ran clean, and with every pool measured so (this), all 46 GPU tests of
    the loop, background, executor, engines, plugins, vLLM and timing files ran
    in one process. (Graph pool handles and MemPools both have ids ``(0, n)``, so
    the two cannot be told apart by id.) What a whole snapshot costs per capture
    in a server-sized process is not measured."""
    return pool_reserved([pool])


def in_pools(ptr: int, pools) -> bool:
    """Whether device address ``ptr`` lies in a segment of the given pools."""
    return any(a <= ptr < a + s for a, s in pool_segments(pools))


def _concrete(device: torch.device) -> torch.device:
    """A CUDA device with its index (the current one when it has none); another device as it is."""
    if device.type != "cuda":
        return device  # host memory: CPU tests of what writes through these views
    return torch.device("cuda", device.index if device.index is not None else torch.cuda.current_device())


def raw_bytes(addr: int, nbytes: int, device: torch.device) -> torch.Tensor:
    """A non-owning uint8 tensor over [addr, addr + nbytes) of ``device``'s memory."""
    dev = _concrete(device)
    storage = torch._C._construct_storage_from_data_pointer(addr, dev, nbytes)
    return torch.empty(0, dtype=torch.uint8, device=dev).set_(storage, 0, (nbytes,), (1,))


def weak_view(t: torch.Tensor) -> torch.Tensor:
    """A tensor over ``t``'s memory that does not keep it allocated.

    Valid only while the memory is not reused: for a graph output, until the
    next replay of any graph in the same pool. Reading it after ``t``'s memory
    was freed and reused reads whatever is there now (no error): keep the
    graph that writes it, and read before the pool's next replay.
    """
    st = t.untyped_storage()
    dev = _concrete(t.device)
    storage = torch._C._construct_storage_from_data_pointer(st.data_ptr(), dev, st.nbytes())
    return torch.empty(0, dtype=t.dtype, device=dev).set_(storage, t.storage_offset(), t.size(), t.stride())


@dataclass
class Window:
    """Allocation events of one capture: own blocks and blocks alive before it."""

    own: list[tuple[int, int]] = field(default_factory=list)
    alive_before: list[tuple[int, int]] = field(default_factory=list)
    #: (op, addr, size) in order, within the capture
    events: list[tuple[str, int, int]] = field(default_factory=list)
    #: blocks allocated in the window and still alive at its end
    alive_after: list[tuple[int, int]] = field(default_factory=list)


class AllocationRecorder:
    """Records the caching allocator's history and cuts it into capture windows.

    ``begin()`` before and ``end()`` after each capture; ``stop()`` at the end.
    A window keeps the allocations that land in a graph pool's segment (one
    whose ``segment_pool_id`` is not ``(0, 0)``, as the graphs' pools still hold
    them when ``stop`` reads them). Not every allocation inside a window is a
    pool allocation: measured on an H200 (torch 2.11), the first capture after
    all graphs were released allocates the generator's graph-safe RNG state,
    two 8-byte blocks, in the ordinary allocator; they are not the pool's.

    A window's bounds are marker allocations (odd sizes, outside any capture,
    kept alive until ``stop``) found in the one history read at the end:
    reading the history at every mark would make recording quadratic in the
    number of captures.
    """

    #: marker sizes: odd byte counts from here up, two apart (a model's tensors are whole
    #: elements of 2 or 4 bytes, and a marker is matched by address and size while it is alive)
    _MARK = 12345

    def __init__(self, max_entries: int = 2_000_000):
        self._marks: list[tuple[int, int]] = []  # (begin marker index, end marker index)
        self._markers: list[torch.Tensor] = []
        self._open: int | None = None
        torch.cuda.memory._record_memory_history(enabled="all", context=None, stacks="python", max_entries=max_entries)

    def _traces(self) -> tuple[list, list[tuple[int, int]]]:
        """The history, and the graph pools' segments as (start, end), sorted."""
        snap = torch.cuda.memory._snapshot()
        traces = snap.get("device_traces", [])
        dev = torch.cuda.current_device()
        segs = sorted(
            (s["address"], s["address"] + s["total_size"])
            for s in snap.get("segments", [])
            if s.get("device", dev) == dev
            # torch's snapshot TypedDict does not declare segment_pool_id; the snapshots have it
            and s.get("segment_pool_id") is not None
            and pool_key(s["segment_pool_id"]) != (0, 0)  # pyright: ignore[reportGeneralTypeIssues]
        )
        return (traces[dev] if dev < len(traces) else []), segs

    def _mark(self) -> int:
        self._markers.append(torch.empty(self._MARK + 2 * len(self._markers), dtype=torch.uint8, device="cuda"))
        return len(self._markers) - 1

    def begin(self) -> None:
        self._open = self._mark()

    def end(self) -> None:
        assert self._open is not None
        self._marks.append((self._open, self._mark()))
        self._open = None

    def _positions(self, traces) -> list[int]:
        """Index in ``traces`` of each marker's alloc event, in order."""
        want = [(t.data_ptr(), t.numel()) for t in self._markers]
        pos, i = [], 0
        for j, e in enumerate(traces):
            if i < len(want) and e["action"] == "alloc" and (e["addr"], e["size"]) == want[i]:
                pos.append(j)
                i += 1
        if i < len(want):
            raise RuntimeError(
                f"allocation history lost {len(want) - i} capture marker(s): raise AllocationRecorder(max_entries=...)"
            )
        return pos

    def close(self) -> None:
        """Stop recording and drop the markers, reading nothing (after a failed capture)."""
        torch.cuda.memory._record_memory_history(enabled=None)
        self._markers.clear()

    def stop(self) -> list[Window]:
        """Stop recording; one :class:`Window` per begin/end pair, in order."""
        traces, segs = self._traces()
        try:
            at = self._positions(traces)
        finally:
            self.close()
        live: dict[int, int] = {}
        starts = [a for a, _ in segs]

        def in_pool(addr: int) -> bool:
            i = bisect_right(starts, addr) - 1
            return i >= 0 and addr < segs[i][1]

        def apply(events, win: Window | None) -> None:
            for e in events:
                action, addr, size = e["action"], e["addr"], e["size"]
                if win is not None and action == "alloc" and in_pool(addr):
                    live[addr] = size
                    win.own.append((addr, size))
                    win.events.append(("alloc", addr, size))
                elif action == "free_requested" and addr in live:
                    del live[addr]
                    if win is not None:
                        win.events.append(("free", addr, size))

        windows, pos = [], 0
        for b_mark, e_mark in self._marks:
            start, end = at[b_mark] + 1, at[e_mark]
            apply(traces[pos:start], None)
            win = Window(alive_before=sorted(live.items()))
            apply(traces[start:end], win)
            win.alive_after = sorted((a, live[a]) for a in {a for a, _ in win.own} if a in live)
            windows.append(win)
            pos = end
        return windows
