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
  report every canary byte that changed: an out-of-bounds write.

Verification destroys the contents of every pool: outputs are garbage until
their graphs replay again. It needs graphs captured with ``record=True`` for
the footprint check. It does not prove the absence of bugs on inputs it did
not draw.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import torch

from .graphs import Captured, GraphSet
from .errors import VerificationFailed
from .pool import pool_segments, raw_bytes

__all__ = ["verify", "Fault", "VerifyResult"]

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
            return f"output {i}: {bad} element(s) differ from eager, max |diff| {float(diff.nan_to_num(1e30).max()):.3g}"
    return None


def _sizes_for(gs: GraphSet, cap: Captured, rng: random.Random) -> int:
    """A random n that pads to this graph's size."""
    sizes = gs._tables[cap.phase].sizes
    lower = max([s for s in sizes if s < cap.bs], default=0) + 1
    return rng.randint(lower, cap.bs)


def _replay_vs_eager(gs: GraphSet, cap: Captured, n: int, gen: torch.Generator, before=None) -> tuple[str | None, tuple]:
    gs.target.prepare(cap.phase, n, cap.bs, gen)
    if before is not None:
        before()
    out = tuple(t.clone() for t in gs.replay(cap.phase, n))
    gs.note_replay(cap)
    ref = tuple(t.clone() for t in gs.eager(cap.phase, n))
    return _compare(out, ref), ref


def verify(gs: GraphSet, *, checks: tuple[str, ...] = ("interleave", "scribble", "footprint"),
           seed: int = 0, rounds: int = 1) -> VerifyResult:
    """Run the checks; returns every fault found (``raise_for_faults`` to fail)."""
    rng = random.Random(seed)
    gen = torch.Generator(device="cuda")
    gen.manual_seed(seed)
    res = VerifyResult(checks=checks)
    caps = list(gs.graphs.values())
    if "interleave" in checks:
        _interleave(gs, caps, rng, gen, res, rounds)
    if "scribble" in checks:
        for cap in caps:
            segs = pool_segments([gs.pools[cap.pool]])
            def scribble(segs=segs):
                for addr, size in segs:
                    raw_bytes(addr, size, torch.device("cuda")).fill_(SCRIBBLE)
            bad, _ = _replay_vs_eager(gs, cap, _sizes_for(gs, cap, rng), gen, scribble)
            res.replays += 1
            if bad:
                res.faults.append(Fault("scribble", f"{cap.phase}/{cap.bs}",
                                        f"reads pool memory it did not write: {bad}"))
    if "footprint" in checks:
        _footprint(gs, caps, rng, gen, res)
    torch.cuda.synchronize()
    return res


def _interleave(gs, caps, rng, gen, res, rounds) -> None:
    kept: dict[tuple[str, int], tuple] = {}
    orders = []
    for _ in range(rounds):
        order = caps[:]
        rng.shuffle(order)
        orders.append(order)
    orders.append(caps[::-1])
    for order in orders:
        for cap in order:
            bad, ref = _replay_vs_eager(gs, cap, _sizes_for(gs, cap, rng), gen)
            res.replays += 1
            if bad:
                res.faults.append(Fault("interleave", f"{cap.phase}/{cap.bs}", bad))
            if cap.held == "keep":
                kept[(cap.phase, cap.bs)] = (cap, ref)
            for (p, b), (other, oref) in list(kept.items()):
                if other is cap:
                    continue
                # A kept output is guaranteed to survive replays of graphs in
                # other pools and of graphs captured after it (they could not
                # take its blocks); a graph captured before it may use those
                # blocks as scratch, so its reference is void from here on.
                if other.pool == cap.pool and other.order > cap.order:
                    del kept[(p, b)]
                    continue
                n = oref[0].shape[0] // other.rows_per_request
                now = tuple(t[: n * other.rows_per_request] for t in other.outputs)
                why = _compare(now, oref)
                if why:
                    t = other.outputs[0]
                    res.faults.append(Fault("interleave", f"{p}/{b}",
                                            f"kept output changed after replaying {cap.phase}/{cap.bs}: {why}",
                                            t.data_ptr(), t.untyped_storage().nbytes()))
                    del kept[(p, b)]


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


def _footprint(gs, caps, rng, gen, res) -> None:
    if any(c.window is None for c in caps):
        raise VerificationFailed("the footprint check needs the allocation history",
                                 where="verify", fix="capture with capture(plan, target, record=True)")
    dev = torch.device("cuda")
    for cap in caps:
        segs = pool_segments(gs.pools.values())
        guard = _outside(segs, cap.window.own + cap.window.alive_before)
        n = _sizes_for(gs, cap, rng)
        gs.target.prepare(cap.phase, n, cap.bs, gen)
        for addr, size in segs:
            raw_bytes(addr, size, dev).fill_(CANARY)
        gs.replay(cap.phase, n)
        gs.note_replay(cap)
        res.replays += 1
        torch.cuda.synchronize()
        for addr, size in guard:
            changed = (raw_bytes(addr, size, dev) != CANARY).nonzero()
            if changed.numel():
                lo, hi = int(changed[0]), int(changed[-1]) + 1
                res.faults.append(Fault("footprint", f"{cap.phase}/{cap.bs}",
                                        f"out-of-bounds write: {int(changed.numel())} canary byte(s) changed "
                                        "outside the graph's own blocks", addr + lo, hi - lo))
