"""``verify(graphs)``: catch graphs that corrupt each other before production does.

Three checks, each fault naming the graph, the address range and the bytes:

* **interleave** -- replay every graph in a shuffled and in a reversed order,
  each with fresh random inputs, and compare with the target run eagerly;
  kept outputs are re-checked after every replay that must not touch them
  (graphs in other pools, and graphs captured after them);
* **scribble** -- fill every pool segment with 0xFF before a replay, then
  compare: a graph that reads pool memory it did not write first differs;
* **footprint** -- from the allocation history recorded during capture, fill
  all pool memory outside the graph's own blocks and outside blocks alive when
  it was captured (cuBLAS workspaces live there) with a canary, replay, and
  report every canary byte that changed: an out-of-bounds write, with the
  graphs whose blocks it lands in.

For graphs that share an executable (a phase planned with ``reuse = "exec-update"``,
``capture_plan.executor.exec_update``) the interleaved orders switch the shared
executable between them at every replay, and one more check runs:

* **reuse** -- for every graph of a group of two or more, another member is replayed
  first (the executable is switched away), then the graph through the shared executable,
  then through an executable of its own, then eagerly, on the same inputs: the three must
  be equal.

Around every replay it also runs two guards:

* **read-only** -- tensors the target declares read-only (a
  ``read_only()`` method returning ``{name: tensor}``: weights, the engine's
  lookup tables) are checksummed before and after each replay; a graph that
  changes one is a fault naming it and the tensor;
* **device fault** -- each replay is synchronized; a replay that raises a
  CUDA error (an illegal address kills the process's CUDA context) stops
  verification with :class:`VerificationFailed` naming the graph, saying the
  context is lost and giving the ``compute-sanitizer`` command that
  reproduces it. Nothing on this device works in this process afterwards.

Verification destroys the contents of every pool: outputs are garbage until
their graphs replay again. It needs the allocation history for the footprint
check: graphs captured with ``capture(..., record=True)`` or
``capture_loop(..., record=True)``, or graphs an engine captured itself
inside ``record_graphs()`` (``capture_plan.executor.engine.adopt`` makes a GraphSet of
those, with the engine's eager function as the reference). It does not prove
the absence of bugs on inputs it did not draw.
"""

from __future__ import annotations

import contextlib
import functools
import random
import shlex
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch

from .errors import VerificationFailed
from .exec_update import SharedGraph
from .graphs import Captured, GraphSet, slice_outputs
from .pool import pool_segments, raw_bytes

T = TypeVar("T")

__all__ = ["verify", "Fault", "VerifyResult", "sanitizer_command", "is_device_fault"]

SCRIBBLE = 0xFF
CANARY = 0xA5


@dataclass(frozen=True)
class Fault:
    check: str
    graph: str
    detail: str
    addr: int = 0
    nbytes: int = 0

    def __str__(self) -> str:
        where = f" at [{self.addr:#x}, {self.addr + self.nbytes:#x}) ({self.nbytes} B)" if self.nbytes else ""
        return f"{self.check}: graph {self.graph}{where}: {self.detail}"


@dataclass
class VerifyResult:
    faults: list[Fault] = field(default_factory=list)
    replays: int = 0
    checks: tuple[str, ...] = ()

    @property
    def ok(self) -> bool:
        return not self.faults

    def raise_for_faults(self) -> None:
        if self.faults:
            more = f" (+{len(self.faults) - 1} more)" if len(self.faults) > 1 else ""
            raise VerificationFailed(str(self.faults[0]) + more, where="verify")

    def summary(self, limit: int = 5) -> str:
        head = f"verify: {self.replays} replays, checks {', '.join(self.checks)}: "
        if self.ok:
            return head + "no faults"
        more = f" ... (+{len(self.faults) - limit} more)" if len(self.faults) > limit else ""
        return head + f"{len(self.faults)} fault(s): " + " | ".join(map(str, self.faults[:limit])) + more


def _compare(a: tuple[torch.Tensor, ...], b: tuple[torch.Tensor, ...]) -> str | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x.shape != y.shape:
            return f"output {i} shape {tuple(x.shape)} != eager {tuple(y.shape)}"
        if not torch.equal(x, y):
            diff = (x.float() - y.float()).abs()
            bad = int((x != y).sum())
            return (
                f"output {i}: {bad} element(s) differ from eager, max |diff| {float(diff.nan_to_num(1e30).max()):.3g}"
            )
    return None


def _sizes_for(gs: GraphSet, cap: Captured, rng: random.Random) -> int:
    """A random n that pads to this graph's size."""
    sizes = gs.table(cap.phase).sizes
    lower = max([s for s in sizes if s < cap.bs], default=0) + 1
    return rng.randint(lower, cap.bs)


def _fill(segs, byte: int, device: torch.device) -> None:
    """Write ``byte`` over every ``(address, bytes)`` range of ``segs`` (pool memory)."""
    for addr, size in segs:
        raw_bytes(addr, size, device).fill_(byte)


def sanitizer_command() -> str:
    """The command line that re-runs this process under compute-sanitizer's memcheck."""
    # orig_argv is the interpreter's own command line (with a -c program, the program itself)
    argv = [sys.executable, *getattr(sys, "orig_argv", [sys.executable, *sys.argv])[1:]]
    return "compute-sanitizer --tool memcheck --print-limit 20 " + shlex.join(argv)


class _Guard:
    """Checksums of the target's read-only tensors; ``check`` after a replay."""

    def __init__(self, target) -> None:
        declared = getattr(target, "read_only", None)
        read_only: Any = declared() if callable(declared) else {}  # the target's mapping of name -> tensor
        self.tensors: dict[str, torch.Tensor] = dict(read_only)
        self.sums = {name: self._sum(t) for name, t in self.tensors.items()}

    @staticmethod
    def _sum(t: torch.Tensor) -> int:
        # One pass over the raw bytes as wrapping 64-bit words: any write that
        # changes a value changes the sum, except a write that exactly
        # compensates (e.g. swapping two words), which this does not catch.
        raw = t.detach().reshape(-1).view(torch.uint8)
        if raw.storage_offset() % 8:
            # 64-bit words need an aligned start: sum an aligned copy (rare: a view into a
            # buffer). Summing the bytes instead missed changes whose bytes cancel out
            # (a bf16 0x3f80 -> 0x407f keeps the byte sum).
            raw = raw.clone()
        body = raw[: raw.numel() // 8 * 8].view(torch.int64)
        tail = raw[body.numel() * 8 :]
        return int(body.sum()) + int(tail.sum(dtype=torch.int64))

    def check(self, who: str, res: VerifyResult) -> None:
        for name, t in self.tensors.items():
            now = self._sum(t)
            if now != self.sums[name]:
                res.faults.append(
                    Fault(
                        "read-only",
                        who,
                        f"wrote into read-only tensor {name!r} ({tuple(t.shape)}, {t.dtype})",
                        t.data_ptr(),
                        t.numel() * t.element_size(),
                    )
                )
                self.sums[name] = now  # later faults are attributed to their own graph


def _device_fault(what: str, cap: Captured, n: int, err: BaseException) -> VerificationFailed:
    return VerificationFailed(
        f"{what} {cap.phase}/{cap.bs} faulted (n={n}): {str(err).splitlines()[0]}; "
        "this process's CUDA context is lost (no further GPU work is possible in it)",
        where=f"verify, {what} {cap.phase}/{cap.bs}",
        fix=f"locate the faulting kernel with: {sanitizer_command()}",
    )


def is_device_fault(err: BaseException) -> bool:
    """Whether ``err`` is a CUDA error reported by the device (after which the
    context may be lost), not a Python-level error of the target or of torch."""
    accel = getattr(torch, "AcceleratorError", None)
    if accel is not None and isinstance(err, accel):
        return True
    return (
        isinstance(err, RuntimeError)
        and not isinstance(err, torch.OutOfMemoryError)
        and str(err).startswith("CUDA error")
    )


def _synchronized(what: str, cap: Captured, n: int, work: Callable[[], T]) -> T:
    """Run ``work`` and wait for the device; a device fault names ``what`` and the graph."""
    try:
        out = work()
        torch.cuda.synchronize()
        return out
    except Exception as err:
        if is_device_fault(err):
            raise _device_fault(what, cap, n, err) from err
        raise


def _replay(gs: GraphSet, cap: Captured, n: int, guard: _Guard | None, res: VerifyResult) -> tuple:
    """Replay, synchronize, check the read-only guard; a CUDA fault is fatal."""
    out = _synchronized("graph", cap, n, lambda: gs.replay(cap.phase, n))
    gs.note_replay(cap)
    res.replays += 1
    if guard is not None:
        guard.check(f"{cap.phase}/{cap.bs}", res)
    return out


def _replay_vs_eager(
    gs: GraphSet, cap: Captured, n: int, gen: torch.Generator, guard, res, before=None
) -> tuple[str | None, tuple]:
    _synchronized("prepare for graph", cap, n, lambda: gs.target.prepare(cap.phase, n, cap.bs, gen))
    if before is not None:
        _synchronized("pool fill before graph", cap, n, before)
    out = tuple(t.clone() for t in _replay(gs, cap, n, guard, res))
    # the eager run is the target's code too
    ref = _synchronized("eager run of graph", cap, n, lambda: tuple(t.clone() for t in gs.eager(cap.phase, n)))
    if guard is not None:
        guard.check(f"{cap.phase}/{cap.bs} (eager run)", res)
    return _compare(out, ref), ref


def verify(
    gs: GraphSet,
    *,
    checks: tuple[str, ...] = ("interleave", "scribble", "footprint"),
    seed: int = 0,
    rounds: int = 1,
    read_only: bool = True,
) -> VerifyResult:
    """Run the checks; returns every fault found (``raise_for_faults`` to fail).

    ``read_only=True`` checksums the target's declared read-only tensors
    around every replay (cost: one read of them per replay). Raises
    :class:`VerificationFailed` at once if a replay faults on the device.
    Runs with ``gs.device`` as the current CUDA device (its waits and fills
    concern that device, whichever one the caller had current).
    """
    on_device = torch.cuda.device(gs.device) if gs.device.type == "cuda" else contextlib.nullcontext()
    with on_device:
        return _verify(gs, checks, seed, rounds, read_only)


def _verify(gs: GraphSet, checks: tuple[str, ...], seed: int, rounds: int, read_only: bool) -> VerifyResult:
    rng = random.Random(seed)
    gen = torch.Generator(device=gs.device)
    gen.manual_seed(seed)
    guard = _Guard(gs.target) if read_only else None
    caps = list(gs.graphs.values())
    shared = [c for c in caps if isinstance(c.graph, SharedGraph) and c.graph.owner.members(c.graph) > 1]
    if shared and "interleave" in checks and "reuse" not in checks:  # shared executables: checked with interleave
        checks = checks + ("reuse",)
    res = VerifyResult(checks=checks + (("read-only",) if guard is not None and guard.tensors else ()))
    if "interleave" in checks:
        _interleave(gs, caps, rng, gen, res, rounds, guard)
    if "reuse" in checks:
        _reuse(gs, shared, rng, gen, res, guard)
    if "scribble" in checks:
        for cap in caps:
            scribble = functools.partial(_fill, pool_segments([gs.pools[cap.pool]]), SCRIBBLE, gs.device)
            bad, _ = _replay_vs_eager(gs, cap, _sizes_for(gs, cap, rng), gen, guard, res, scribble)
            if bad:
                res.faults.append(
                    Fault("scribble", f"{cap.phase}/{cap.bs}", f"reads pool memory it did not write: {bad}")
                )
    if "footprint" in checks:
        _footprint(gs, caps, rng, gen, res, guard)
    torch.cuda.synchronize()
    return res


def _interleave(gs, caps, rng, gen, res, rounds, guard) -> None:
    kept: dict[tuple[str, int], tuple] = {}
    orders = []
    for _ in range(rounds):
        order = caps[:]
        rng.shuffle(order)
        orders.append(order)
    orders.append(caps[::-1])
    for order in orders:
        for cap in order:
            n = _sizes_for(gs, cap, rng)
            bad, ref = _replay_vs_eager(gs, cap, n, gen, guard, res)
            if bad:
                res.faults.append(Fault("interleave", f"{cap.phase}/{cap.bs}", bad))
            if cap.held == "keep" and cap.outputs and not bad:
                # only a replay that matched eager is a reference for later
                # checks: a wrong one would blame every graph replayed after it
                kept[(cap.phase, cap.bs)] = (cap, ref, n)
            elif cap.held == "keep":
                kept.pop((cap.phase, cap.bs), None)
            for (p, b), (other, oref, on) in list(kept.items()):
                if other is cap:
                    continue
                # A kept output is guaranteed to survive replays of graphs in
                # other pools and of graphs captured after it (they could not
                # take its blocks); a graph captured before it may use those
                # blocks as scratch, so its reference is void from here on.
                if other.pool == cap.pool and other.order > cap.order:
                    del kept[(p, b)]
                    continue
                why = _compare(slice_outputs(other.outputs, other.output_rows, on), oref)
                if why:
                    t = other.outputs[0]
                    res.faults.append(
                        Fault(
                            "interleave",
                            f"{p}/{b}",
                            f"kept output changed after replaying {cap.phase}/{cap.bs}: {why}",
                            t.data_ptr(),
                            t.untyped_storage().nbytes(),
                        )
                    )
                    del kept[(p, b)]


def _reuse(gs: GraphSet, shared: list[Captured], rng, gen, res: VerifyResult, guard) -> None:
    """Each shared graph: switched away from, replayed through the shared executable, through
    its own, and eagerly, on one draw of inputs; all three equal."""
    for cap in shared:
        g = cap.graph
        assert isinstance(g, SharedGraph)
        other = next(c for c in shared if c is not cap and getattr(c.graph, "exec", None) is g.exec)
        why = _shared_vs_own(gs, cap, g, other, _sizes_for(gs, cap, rng), gen, guard, res)
        if why:
            res.faults.append(Fault("reuse", f"{cap.phase}/{cap.bs}", why))


def _shared_vs_own(gs: GraphSet, cap: Captured, g: SharedGraph, other: Captured, n: int, gen, guard, res):
    """What differs between ``cap`` replayed through the shared executable (switched from
    ``other``), through its own, and eagerly; None when nothing does."""
    _synchronized("prepare for graph", cap, n, functools.partial(gs.target.prepare, cap.phase, n, cap.bs, gen))
    _replay(gs, other, other.bs, guard, res)  # the shared executable now holds the other graph
    via_shared = tuple(t.clone() for t in _replay(gs, cap, n, guard, res))
    _synchronized("own executable of graph", cap, n, functools.partial(g.owner.launch_own, g))
    res.replays += 1
    gs.note_replay(cap)
    own = tuple(t.clone() for t in cap.sliced[n])
    ref = _synchronized("eager run of graph", cap, n, lambda: tuple(t.clone() for t in gs.eager(cap.phase, n)))
    why = _compare(via_shared, own)
    if why:
        return (
            f"replayed through the executable shared with {other.phase}/{other.bs}: "
            f"differs from its own executable's replay: {why}"
        )
    why = _compare(via_shared, ref)
    return f"shared and own executables agree but differ from eager: {why}" if why else None


def _outside(segs, keep) -> list[tuple[int, int]]:
    """Parts of the segments not covered by the ``keep`` intervals."""
    keep = sorted(keep)
    out = []
    for addr, size in segs:
        cur, end = addr, addr + size
        for a, s in keep:
            if a + s <= cur or a >= end:
                continue
            if a > cur:
                out.append((cur, a - cur))
            cur = max(cur, a + s)
        if cur < end:
            out.append((cur, end - cur))
    return out


def _owners(caps, lo: int, hi: int, exclude) -> list[str]:
    """Graphs whose own blocks overlap [lo, hi): whose memory a stray write lands in."""
    return [
        f"{c.phase}/{c.bs}" for c in caps if c is not exclude and any(a < hi and lo < a + s for a, s in c.window.own)
    ]


def _footprint(gs, caps, rng, gen, res, guard) -> None:
    if any(c.window is None for c in caps):
        raise VerificationFailed(
            "the footprint check needs the allocation history",
            where="verify",
            fix="capture with capture(plan, target, record=True) or "
            "capture_loop(plan, record=True), or adopt(..., recorded=) the engine's graphs "
            "captured inside record_graphs()",
        )
    for cap in caps:
        segs = pool_segments(gs.pools.values())
        outside = _outside(segs, cap.window.own + cap.window.alive_before)
        n = _sizes_for(gs, cap, rng)
        _synchronized("prepare for graph", cap, n, functools.partial(gs.target.prepare, cap.phase, n, cap.bs, gen))
        _synchronized("pool fill before graph", cap, n, functools.partial(_fill, segs, CANARY, gs.device))
        _replay(gs, cap, n, guard, res)
        for addr, size in outside:
            changed = (raw_bytes(addr, size, gs.device) != CANARY).nonzero()
            if changed.numel():
                lo, hi = addr + int(changed[0]), addr + int(changed[-1]) + 1
                owners = _owners(caps, lo, hi, cap)
                into = (
                    f"; lands in blocks of {', '.join(owners[:4])}" + (" ..." if len(owners) > 4 else "")
                    if owners
                    else ""
                )
                res.faults.append(
                    Fault(
                        "footprint",
                        f"{cap.phase}/{cap.bs}",
                        f"out-of-bounds write: {int(changed.numel())} canary byte(s) changed "
                        f"outside the graph's own blocks{into}",
                        lo,
                        hi - lo,
                    )
                )
