"""Run a capture sequence through the allocator simulator.

Models what ``torch.cuda.graph`` does to the pool around each capture: the
previous capture's cuBLAS workspace is freed when the next capture begins;
blocks a capture frees are reusable by the rest of it and by later captures;
at the end, outputs held through views and all leftover temporaries are freed,
kept outputs stay. Warm-ups run eagerly outside the pool and change nothing
here. A hoisted workspace is not in the pool at all.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

from schemas.plan import Strategy

from .allocator import PoolSim
from .workload import Workload

__all__ = ["SimResult", "simulate", "pool_id"]


def pool_id(phase: str, strategy: Strategy) -> str:
    return "shared" if strategy.pool == "shared" else f"phase:{phase}"


@dataclass(frozen=True)
class SimResult:
    #: peak reserved bytes of all pools together (reserved never falls)
    pool_bytes: int
    pools: dict[str, int]
    #: (reserved, allocated) of all pools together after each capture
    after_capture: list[tuple[int, int]]


def simulate(captures: Iterable[tuple[str, int]], strategies: dict[str, Strategy], workload: Workload,
             expandable: bool = False) -> SimResult:
    pools: dict[str, PoolSim] = {}
    library: list[tuple[PoolSim, object]] = []
    timeline: list[tuple[int, int]] = []
    for phase, bs in captures:
        st = strategies[phase]
        pid = pool_id(phase, st)
        pool = pools.get(pid)
        if pool is None:
            pool = pools[pid] = PoolSim(expandable=expandable)
        for p, b in library:
            p.free(b)
        library = []
        live: dict[int, tuple[object, str]] = {}
        hoisted = st.workspace == "hoisted"
        for e in workload.events(phase, bs):
            if e.op == "alloc":
                if hoisted and e.kind == "workspace":
                    continue
                live[e.id] = (pool.alloc(e.size), e.kind)
            else:
                entry = live.pop(e.id, None)
                if entry is not None:
                    pool.free(entry[0])
        for block, kind in live.values():
            if kind == "library":
                library.append((pool, block))
            elif kind != "output" or st.outputs == "view":
                pool.free(block)
        timeline.append((sum(p.reserved for p in pools.values()), sum(p.allocated for p in pools.values())))
    return SimResult(pool_bytes=timeline[-1][0] if timeline else 0,
                     pools={k: p.peak_reserved for k, p in sorted(pools.items())},
                     after_capture=timeline)
