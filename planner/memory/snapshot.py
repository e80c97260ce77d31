"""PyTorch memory snapshots (``torch.cuda.memory._dump_snapshot``) as traces.

A snapshot is a pickle of ``torch.cuda.memory._snapshot()``: ``segments``
(each with ``address``, ``total_size``, ``segment_pool_id``, ``device``) and
``device_traces`` (per device, the allocator's history: ``action``, ``addr``,
``size``, ...), which is what engines' memory-profiling options dump and what
PyTorch's memory_viz reads. This module turns one into a :class:`Trace`
without torch:

* **Reading.** Pickles run code when loaded. :func:`load_snapshot` uses an
  unpickler whose ``find_class`` refuses every global, so only the opcodes of
  plain data (dicts, lists, tuples, str, bytes, int, float, bool, None) can
  build anything; a pickle naming any class or function is refused when that
  opcode is read, before it is called (tests/test_traces.py proves a
  payload never ran). ``persistent_load`` is refused too.
* **Pool allocations.** The graph pools are the segments whose
  ``segment_pool_id`` is not ``(0, 0)``; an allocation belongs to one when
  its address lies in such a segment created by the history's last
  ``segment_alloc`` at that address (graph pools never free segments while
  their graphs live). Allocations are the ``alloc`` entries, frees the
  ``free_requested`` ones; sizes are the requested bytes. Pool segments
  older than the history are ignored unless something is allocated in them
  (then the history missed the captures' start, which is refused).
* **Capture windows.** A window is a run of pool allocations that no
  allocation outside the graph pools interrupts: engines warm up eagerly
  before each capture (outside the pool), which separates their captures.
  Within a window, a block freed in it is ``temp``; of the blocks still alive
  at its end, the last ``n`` are ``output`` (``n``: the fewest any window of
  the phase leaves alive) and any earlier ones ``library`` (a library's
  one-off workspace in the first capture).
* **Labels.** Windows are matched to the spec's captures phase by phase, in
  the spec's phase order (each phase's captures consecutive, as engines
  capture them), and within a phase by size: the window whose temporaries
  request the most bytes is the largest batch size.

What it does not do: expandable segments (``segment_map``), snapshots whose
history was cut by ``max_entries`` before the first capture, captures with
no eager allocation between them (record those with ``capture_plan.executor.profile``),
or outputs freed right after their capture (they would read as temporaries).
"""

from __future__ import annotations

import io
import pickle
from bisect import bisect_right
from typing import Any

from capture_plan.schemas.errors import InputError
from capture_plan.schemas.spec import Phase
from capture_plan.schemas.trace import CaptureTrace, Event, Trace

__all__ = ["load_snapshot", "is_pickle", "trace_from_snapshot", "PlainUnpickler"]


class PlainUnpickler(pickle.Unpickler):
    """An unpickler that builds plain data only; any global is refused."""

    def __init__(self, data: bytes, source: str):
        super().__init__(io.BytesIO(data))
        self._source = source

    def find_class(self, module: str, name: str):  # noqa: D401 - pickle's hook
        raise InputError(
            f"pickle refers to {module}.{name}: only plain data (dicts, lists, tuples, strings, "
            "numbers) is accepted, and nothing in the file was executed",
            where=self._source,
            fix="pass the pickle written by torch.cuda.memory._dump_snapshot, or a JSON trace",
        )

    def persistent_load(self, pid):
        raise InputError(
            "pickle uses persistent ids: only plain data is accepted",
            where=self._source,
            fix="pass the pickle torch.cuda.memory._dump_snapshot wrote, unedited, or a JSON trace",
        )


def is_pickle(data: bytes) -> bool:
    """Whether ``data`` starts like a pickle of protocol 2 or later."""
    return data[:1] == b"\x80"


def load_snapshot(data: bytes, source: str) -> dict:
    try:
        obj = PlainUnpickler(data, source).load()
    except InputError:
        raise
    except Exception as err:  # truncated or corrupt: pickle raises many types
        raise InputError(
            f"not a readable pickle: {type(err).__name__}: {err}",
            where=source,
            fix="dump it again with torch.cuda.memory._dump_snapshot",
        ) from None
    if (
        not isinstance(obj, dict)
        or not isinstance(obj.get("segments"), list)
        or not isinstance(obj.get("device_traces"), list)
    ):
        raise InputError(
            "not a memory snapshot: expected a dict with `segments` and `device_traces`",
            where=source,
            fix="dump it with torch.cuda.memory._dump_snapshot",
        )
    return obj


def _int(d: Any, key: str, where: str) -> int:
    v = d.get(key) if isinstance(d, dict) else None
    if not isinstance(v, int) or isinstance(v, bool):
        raise InputError(
            f"missing or non-integer `{key}`",
            where=where,
            fix="pass the pickle torch.cuda.memory._dump_snapshot wrote, unedited, or a JSON trace",
        )
    return v


def _pool_id(pid: Any, where: str) -> tuple | None:
    if pid is None:
        return None
    if not isinstance(pid, (list, tuple)) or not all(isinstance(x, int) for x in pid):
        raise InputError(
            f"segment_pool_id must be a pair of integers, got {pid!r}",
            where=where,
            fix="pass the pickle torch.cuda.memory._dump_snapshot wrote, unedited, or a JSON trace",
        )
    return tuple(pid)


def _pool_segments(snap: dict, source: str) -> tuple[int, dict[int, int]]:
    """(device, {address: size}) of the graph pools' segments."""
    segs: dict[int, dict[int, int]] = {}
    for i, s in enumerate(snap["segments"]):
        where = f"{source}: segments[{i}]"
        if not isinstance(s, dict):
            raise InputError(
                "a segment must be a dict",
                where=where,
                fix="pass the pickle torch.cuda.memory._dump_snapshot wrote, unedited, or a JSON trace",
            )
        pid = _pool_id(s.get("segment_pool_id"), where + ".segment_pool_id")
        if pid is None or pid == (0, 0):
            continue
        dev = s.get("device", 0)
        if not isinstance(dev, int) or dev < 0:
            raise InputError(
                f"device must be a non-negative integer, got {dev!r}",
                where=where + ".device",
                fix="pass the pickle torch.cuda.memory._dump_snapshot wrote, unedited, or a JSON trace",
            )
        segs.setdefault(dev, {})[_int(s, "address", where)] = _int(s, "total_size", where)
    if not segs:
        raise InputError(
            "the snapshot has no graph-pool segments",
            where=source,
            fix="dump the snapshot after capturing, while the graphs are still alive",
        )
    if len(segs) > 1:
        raise InputError(
            f"graph pools on several devices {sorted(segs)}; one device per trace",
            where=source,
            fix="record the snapshot of one device (in the process that captures on it)",
        )
    ((dev, pool),) = segs.items()
    return dev, pool


def _windows(snap: dict, source: str) -> list[list[tuple[str, int, int]]]:
    dev, pool = _pool_segments(snap, source)
    traces = snap["device_traces"]
    if dev >= len(traces) or not traces[dev]:
        raise InputError(
            f"no allocation history for device {dev}",
            where=source,
            fix="call torch.cuda.memory._record_memory_history() before capturing",
        )
    entries = traces[dev]
    if not isinstance(entries, list) or not all(isinstance(e, dict) for e in entries):
        raise InputError(
            "the history must be a list of dicts",
            where=f"{source}: device_traces[{dev}]",
            fix="pass the pickle torch.cuda.memory._dump_snapshot wrote, unedited, or a JSON trace",
        )
    last_seg = {}
    for i, e in enumerate(entries):
        if e.get("action") == "segment_alloc":
            addr = _int(e, "addr", f"{source}: device_traces[{dev}][{i}]")
            if addr in pool:
                last_seg[addr] = i
    # Pool segments older than the history (another, earlier set of graphs)
    # are left out; an allocation landing in one means the history missed
    # the start of these captures.
    stale = sorted((a, a + pool[a]) for a in set(pool) - set(last_seg))
    stale_starts = [a for a, _ in stale]
    starts: list[int] = []  # live pool segments, sorted
    ends: dict[int, int] = {}
    live: set[int] = set()  # live pool blocks
    windows: list[list[tuple[str, int, int]]] = []
    cur: list[tuple[str, int, int]] | None = None
    for i, e in enumerate(entries):
        where = f"{source}: device_traces[{dev}][{i}]"
        action = e.get("action")
        if action == "segment_alloc" and last_seg.get(e["addr"]) == i:
            a = e["addr"]
            starts.insert(bisect_right(starts, a), a)
            ends[a] = a + pool[a]
        elif action == "alloc":
            addr, size = _int(e, "addr", where), _int(e, "size", where)
            j = bisect_right(starts, addr) - 1
            if j >= 0 and addr < ends[starts[j]]:
                if cur is None:
                    cur = []
                    windows.append(cur)
                cur.append(("alloc", addr, size))
                live.add(addr)
            else:
                k = bisect_right(stale_starts, addr) - 1
                if k >= 0 and addr < stale[k][1]:
                    raise InputError(
                        f"an allocation at {addr:#x} lies in a graph pool's segment created before the "
                        "recorded history starts",
                        where=where,
                        fix="start _record_memory_history before the first capture (and keep max_entries large enough)",
                    )
                if cur is not None:
                    cur = None  # an eager allocation: the capture is over
        elif action == "free_requested":
            addr = _int(e, "addr", where)
            if addr in live:
                live.discard(addr)
                if cur is not None:
                    cur.append(("free", addr, 0))
    return windows


def _capture(phase: str, bs: int, win: list[tuple[str, int, int]], n_out: int) -> CaptureTrace:
    ids: dict[int, int] = {}
    events: list[Event] = []
    alloc_at: dict[int, int] = {}  # live id -> event index
    next_id = 0
    for op, addr, size in win:
        if op == "alloc":
            ids[addr] = n = next_id
            next_id += 1
            alloc_at[n] = len(events)
            events.append(Event(op="alloc", id=n, size=size))
        else:
            n = ids.pop(addr)
            alloc_at.pop(n)
            events.append(Event(op="free", id=n))
    alive = sorted(alloc_at.values())
    for k, i in enumerate(alive):
        e = events[i]
        kind = "output" if k >= len(alive) - n_out else "library"
        events[i] = Event(op="alloc", id=e.id, size=e.size, kind=kind)
    return CaptureTrace(phase=phase, bs=bs, events=events)


def _alive(win) -> int:
    live: set[int] = set()
    for op, addr, _ in win:
        (live.add if op == "alloc" else live.discard)(addr)
    return len(live)


def _temp_bytes(win) -> int:
    sizes: dict[int, int] = {}
    total = 0
    for op, addr, size in win:
        if op == "alloc":
            sizes[addr] = size
        else:
            total += sizes.pop(addr)
    return total


def trace_from_snapshot(data: bytes, phases: list[Phase], source: str, *, device: str = "") -> Trace:
    """The :class:`Trace` of the captures in a pickled snapshot, labelled with
    the spec's phases and sizes (see the module docstring)."""
    windows = _windows(load_snapshot(data, source), source)
    want = sum(len(p.sizes) for p in phases)
    if len(windows) != want:
        raise InputError(
            f"found {len(windows)} capture windows in the snapshot, the spec plans {want} captures "
            f"({', '.join(f'{p.name}: {len(p.sizes)}' for p in phases)})",
            where=source,
            fix="dump the snapshot of a run that captured exactly the spec's sizes, each after an "
            "eager warm-up, or record the trace with capture_plan.executor.profile",
        )
    caps: list[CaptureTrace] = []
    pos = 0
    for p in phases:
        block = windows[pos : pos + len(p.sizes)]
        pos += len(p.sizes)
        scale = [_temp_bytes(w) for w in block]
        if len(set(scale)) != len(scale):
            raise InputError(
                f"phase {p.name!r}: two capture windows request the same temporary bytes; "
                "cannot tell their batch sizes apart",
                where=source,
                fix="record the trace with capture_plan.executor.profile",
            )
        n_out = min(_alive(w) for w in block)
        ranked = sorted(range(len(block)), key=lambda i: scale[i])
        for bs, i in zip(sorted(p.sizes), ranked):
            caps.append(_capture(p.name, bs, block[i], n_out))
    caps.sort(key=lambda c: (c.phase, c.bs))
    return Trace(device=device, captures=caps)
