"""The best list of ``k`` capture sizes for a traffic, for every ``k``: a dynamic program.

A step of ``n`` requests runs as the graph of the smallest captured size
``s >= n`` and costs ``cost(n, s)`` (planner/sizes/step_time.py). The expected cost
of a list is ``sum_n w(n) * cost(n, pad(n))`` over the traffic's steps
``w(n)``: separable by interval, since the sizes ``n`` in ``(c_i, c_j]``
between two consecutive sizes of the list all run as ``c_j``. So over sorted
candidates ``c_0 < ... < c_{m-1}`` (the largest, the engine's largest size,
always in the list: no step above it runs eagerly)::

    best[k][j] = min over i < j of best[k-1][i] + cost of (c_i, c_j] run as c_j

is the cheapest list of ``k`` sizes whose largest is ``c_j``, exactly, in
``O(k m^2)`` (about 2 million steps for 64 sizes over 256 candidates). Ties
go to the smaller earlier size, so the lists are the same on every machine.

Candidates are the traffic's own sizes and the largest size: with a step
cost that does not fall as the graph grows, a size between two traffic sizes
is never better than the traffic size below it. Above
:data:`EVERY_SIZE_UP_TO` candidates, a traffic spread over thousands of
sizes (a histogram's wide buckets) keeps every size up to that many and a
grid of multiples above (:func:`candidates` says which), so the program
stays within seconds; the lists are then the best on that grid.

What this does not do: weigh memory or capture time (planner/sizes/sizes.py prices
each list on the front), or split the traffic between phases.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable
from dataclasses import dataclass

__all__ = ["Best", "best_lists", "candidates", "expected", "padded", "size_runs", "EVERY_SIZE_UP_TO"]

#: candidates up to this many are every traffic size; more are thinned above it (:func:`candidates`)
EVERY_SIZE_UP_TO = 256


@dataclass(frozen=True)
class Best:
    """The cheapest list of ``len(sizes)`` sizes, and its expected cost per step."""

    sizes: tuple[int, ...]
    #: expected seconds per step
    seconds: float


def candidates(traffic: dict[int, float], top: int) -> tuple[list[int], str]:
    """The sizes a list is chosen from, and how (one line): every traffic size and
    ``top``; above :data:`EVERY_SIZE_UP_TO` of them, every size up to that count and
    the multiples of a power of two above it, so that at most twice as many remain."""
    sizes = sorted({s for s, w in traffic.items() if w > 0 and s <= top} | {top})
    if len(sizes) <= EVERY_SIZE_UP_TO:
        return sizes, f"the traffic's {len(sizes) - (top not in traffic)} sizes and the largest, {top}"
    low = sizes[EVERY_SIZE_UP_TO - 1]
    stride = 2
    while len([s for s in sizes if s > low and s % stride == 0]) > EVERY_SIZE_UP_TO:
        stride *= 2
    kept = [s for s in sizes if s <= low or s % stride == 0]
    if kept[-1] != top:
        kept.append(top)
    return kept, f"the traffic's sizes up to {low}, then multiples of {stride} to the largest, {top}"


def padded(sizes: tuple[int, ...] | list[int], n: int) -> int:
    """The size a step of ``n`` runs as: the smallest of ``sizes`` (sorted) >= ``n``."""
    return sizes[bisect.bisect_left(sizes, n)]


def expected(traffic: dict[int, float], sizes: tuple[int, ...] | list[int], cost: Callable[[int, int], float]) -> float:
    """Expected seconds per step of ``traffic`` run with the sorted ``sizes``."""
    total = sum(traffic.values())
    return sum(w * cost(n, padded(sizes, n)) for n, w in sorted(traffic.items())) / total


def best_lists(
    traffic: dict[int, float], cands: list[int], cost: Callable[[int, int], float], kmax: int
) -> dict[int, Best]:
    """For each ``k`` from 1 to ``kmax`` (at most the candidates' count): the list of ``k``
    of the sorted ``cands`` whose expected cost over ``traffic`` is least, its last size
    ``cands[-1]`` (which must be at least every traffic size)."""
    m = len(cands)
    kmax = min(kmax, m)
    total = sum(traffic.values())
    # group[i]: the traffic sizes in (cands[i-1], cands[i]], each with its weight
    group: list[list[tuple[int, float]]] = [[] for _ in range(m)]
    for n, w in sorted(traffic.items()):
        group[bisect.bisect_left(cands, n)].append((n, w))
    # run[j][i]: cost of the traffic up to cands[i] run as cands[j] (i <= j); run[j][-1] = 0
    run: list[list[float]] = []
    for j, c in enumerate(cands):
        acc, row = 0.0, []
        for i in range(j + 1):
            for n, w in group[i]:
                acc += w * cost(n, c)
            row.append(acc)
        run.append(row)
    inf = float("inf")
    prev = [run[j][j] for j in range(m)]  # one size, cands[j], runs everything up to it
    back: list[list[int]] = [[-1] * m]
    out = {1: Best(sizes=(cands[-1],), seconds=prev[-1] / total)}
    for k in range(2, kmax + 1):
        cur, arg = [inf] * m, [-1] * m
        for j in range(k - 1, m):
            row = run[j]
            best, at = inf, -1
            for i in range(k - 2, j):
                v = prev[i] - row[i]
                if v < best:
                    best, at = v, i
            cur[j], arg[j] = best + row[j], at
        back.append(arg)
        prev = cur
        sizes, j = [], m - 1
        for kk in range(k, 0, -1):
            sizes.append(cands[j])
            j = back[kk - 1][j]
        out[k] = Best(sizes=tuple(reversed(sizes)), seconds=prev[-1] / total)
    return out


def size_runs(sizes: tuple[int, ...] | list[int]) -> str:
    """Sizes as runs: ``1-9,12,16-64/8,256`` (``a-b/k``: every k-th from a to b)."""
    out, i, s = [], 0, sorted(sizes)
    while i < len(s):
        j = i
        if i + 2 < len(s) and s[i + 1] - s[i] == s[i + 2] - s[i + 1]:
            step = s[i + 1] - s[i]
            while j + 1 < len(s) and s[j + 1] - s[j] == step:
                j += 1
            out.append(f"{s[i]}-{s[j]}" + (f"/{step}" if step > 1 else ""))
        else:
            out.append(str(s[i]))
        i = j + 1
    return ",".join(out)
