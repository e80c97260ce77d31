"""``planner fit --traffic FILE``: the capture-size lists a traffic chooses, priced in KV tokens.

The traffic is read by ``planner sizes``' own reader (:mod:`.traffic`: the same CSV, JSON and
Prometheus forms, the same refusals), as one phase, :data:`PHASE`, of one token a request
(vLLM's sizes count tokens; SGLang's decode sizes count requests of one token each). For
every count ``k`` of sizes, :func:`.size_front.best_lists` gives the list whose expected
padding over the traffic is least, its largest size the engine's largest (every step then
runs a graph). fit has no step-time model, so a step of ``n`` run as the graph of ``s``
costs ``s`` tokens (:data:`COST`): the padding of a list is the padded tokens a step runs,
in % of the traffic's own tokens.

Shown (:func:`shown_counts`), at most three lists of the front: the fewest sizes that pad no
more than the engine default, the fewest within :data:`GAIN_POINTS` point of padding of the
best list of the default's count (where the front stops improving much), and that best list
(the default's graph count, padded least). fit prices each as it prices the engine
default's list (planner/fit: ``FitRequest.lists``; its graph estimate, then KV tokens
through the release's rule): a list equal to the default costs the same tokens.

Refused with one located line: what the traffic reader refuses (a missing file, a bad CSV
line, no steps), traffic above the engine's largest capture size (fix: the engine's flag that
raises it, checked by fit), traffic under ``--enforce-eager`` (no graphs) or speculative
decoding (its graphs are not priced). A does-not-fit's fixes whose largest size the traffic
passes are dropped (the command with them would be refused).

This sits in the sizes layer, above fit: fit prices lists, this chooses them.
"""

from __future__ import annotations

from pathlib import Path

import msgspec

from capture_plan.schemas.errors import InputError
from capture_plan.schemas.fit import FitResult, FitTraffic

from ..fit.fit import FitRequest, fit
from ..fit.flags import changes_of
from ..fit.refusal import Refusal
from ..inputs.build_options import SizeChoiceOptions
from .size_front import best_lists, candidates, expected
from .traffic import read_traffic

__all__ = ["PHASE", "COST", "GAIN_POINTS", "SHOWN", "shown_counts", "fit_traffic"]

#: the one phase fit reads a traffic as (a ``phase`` column names it)
PHASE = "decode"
#: the step cost the front is chosen by, in words
COST = (
    "padded tokens, % of the traffic's own: a step of n run as size s costs s (an estimate: fit has no step-time model)"
)
#: the front's lists within this many points of padding of the best at the engine default's count
#: have stopped improving much (:func:`shown_counts`)
GAIN_POINTS = 1.0
SHOWN = (
    "the fewest sizes that pad no more than the engine default, the fewest within "
    f"{GAIN_POINTS:g} point of the best at the default's count, and the default's count"
)


def _cost(_n: int, s: int) -> float:
    return float(s)


def _padding(traffic: dict[int, float], sizes: list[int]) -> float | None:
    """Expected padding of ``traffic`` run with ``sizes`` (:data:`COST`), in % of its own tokens;
    None where a step is above the largest size (it runs without a graph)."""
    if not sizes or max(traffic) > max(sizes):
        return None
    own = expected(traffic, sorted(traffic), _cost)
    return max(0.0, 100.0 * (expected(traffic, sorted(sizes), _cost) - own) / own)


def shown_counts(pads: dict[int, float], default_pad: float, default_count: int) -> list[int]:
    """The counts of sizes shown (:data:`SHOWN`): ``pads``, the front's padding per count (1
    to at most ``default_count``), ``default_pad`` the engine default's."""
    top = min(default_count, max(pads))
    counts = range(1, top + 1)
    as_default = next((k for k in counts if pads[k] <= default_pad), top)
    knee = next(k for k in counts if pads[k] - pads[top] < GAIN_POINTS)
    return sorted({as_default, knee, top})


def _largest(req: FitRequest, changes: dict[str, object]) -> int:
    """The engine's largest capture size under ``changes`` (0: none, or refused)."""
    try:
        return max(fit(req.changed(changes)).size_costs[0].sizes, default=0)
    except InputError:
        return 0


def _largest_fix(req: FitRequest, engine: str, need: int) -> dict[str, object]:
    """The changes under which the engine's largest capture size reaches ``need``: SGLang's
    --cuda-graph-max-bs; vLLM's --max-cudagraph-capture-size, the smallest whose list reaches
    ``need`` (its grid steps by 16 above 256), the given sizes left out and
    max-num-batched-tokens raised to ``need`` where it caps the list."""
    if engine == "sglang":
        return {"cuda-graph-max-bs": need}
    base: dict[str, object] = {"cudagraph-capture-sizes": None} if "cudagraph-capture-sizes" in req.flags else {}
    for more in ({}, {"max-num-batched-tokens": need}):
        for top in range(need, need + 16):
            changes = {**base, **more, "max-cudagraph-capture-size": top}
            if _largest(req, changes) >= need:
                return changes
    return {**base, "max-num-batched-tokens": need, "max-cudagraph-capture-size": need}


def fit_traffic(req: FitRequest, path: str) -> FitResult:
    """fit's answer to ``req`` with the traffic ``path``'s front rows after the engine default's
    and the plan's, every size cost's padding, and the traffic as read."""
    res = fit(req)
    default = res.size_costs[0].sizes  # the engine default's row
    where = f"--traffic {path}"
    if not default:
        raise Refusal(
            "no graphs are captured without CUDA graphs: the traffic has no sizes to choose",
            where=where,
            hint="capture them (or leave out --traffic)",
            changes={"enforce-eager": None, "cudagraph-mode": None},
        )
    if res.speculative is not None:
        raise InputError(
            "capture sizes under speculative decoding are not chosen for a traffic (their graphs are not priced, "
            "and their sizes round to the verify width)",
            where=where,
            fix="leave out --traffic, or leave out speculative decoding to price the sizes of the target alone",
        )
    top = max(default)
    try:
        tr = read_traffic(SizeChoiceOptions(traffic=Path(path)), {PHASE: 1}, {PHASE: top})
    except InputError as err:
        if err.retry is None or "max_size" not in err.retry:
            raise
        need = int(str(err.retry["max_size"]))
        flag = "cuda-graph-max-bs" if res.engine == "sglang" else "max-cudagraph-capture-size"
        raise Refusal(
            f"the traffic reaches size {need}, above {res.engine}'s largest capture size {top} "
            "(a step above it runs without a graph; a traffic file is never truncated)",
            where=path,
            hint=f"give traffic of this configuration, or raise the largest capture size with --{flag}",
            changes=_largest_fix(req, res.engine, need),
        ) from None
    traffic = tr.phases[PHASE]
    cands, how = candidates(traffic, top)
    best = best_lists(traffic, cands, _cost, len(default))
    own = sum(w * n for n, w in traffic.items()) / sum(traffic.values())
    pads = {k: max(0.0, 100.0 * (b.seconds - own) / own) for k, b in best.items()}
    default_pad = _padding(traffic, default)
    assert default_pad is not None, "read_traffic refuses a traffic above the default's largest size"
    shown = shown_counts(pads, default_pad, len(default))
    priced = fit(msgspec.structs.replace(req, lists={f"traffic front {k}": list(best[k].sizes) for k in shown}))
    rows = []
    for c in priced.size_costs:
        pad = _padding(traffic, c.sizes)
        rows.append(msgspec.structs.replace(c, padding_pct=None if pad is None else round(pad, 2)))
    summary = FitTraffic(
        source=tr.source,
        sha256=tr.digest,
        form=tr.form,
        steps=sum(traffic.values()),
        largest=top,
        candidates=how,
        cost=COST,
        shown=SHOWN,
        notes=list(tr.notes),
    )
    # a fix whose largest size the traffic passes: the command with it and the traffic is refused
    fixes = [f for f in priced.fixes if _largest(req, changes_of(f)) >= max(traffic)]
    return msgspec.structs.replace(priced, size_costs=rows, traffic=summary, fixes=fixes)
