"""`planner fit`: where a device's memory goes for one engine release and its settings.

:func:`fit` resolves the request once (:func:`.inputs.resolve`: the release's rule, the
device row, the checked flags, the KV layer types), then the engine's layer
(:mod:`.vllm`, :mod:`.sglang`) resolves the release's defaults (its utilization, batch
limits and capture sizes for the device), counts each item (weights, non-torch,
activation peak, graph memory, KV) and sizes the KV cache by the release's rule, then
prices capture-size sets in KV tokens. A configuration that does not start is
``fits = False`` with one line naming the overflowing item and the fixes that work.
"""

from __future__ import annotations

import msgspec

from capture_plan.schemas.errors import InputError
from capture_plan.schemas.fit import FitItem, FitResult

from .flags import engine_flags
from .inputs import PlanGraphs, resolve
from .model import FitModel
from .sglang import fit_sglang
from .vllm import fit_vllm

__all__ = ["fit"]

#: each engine's layer
_ENGINES = {"vllm": fit_vllm, "sglang": fit_sglang}


def fit(
    model: FitModel,
    device_name: str,
    engine: str,
    tp: int,
    flags: dict,
    measured_graph: FitItem | None = None,
    *,
    plan: PlanGraphs | None = None,
) -> FitResult:
    """``flags``: the engine's own flags by name (None or absent: the release's default);
    ``measured_graph``: a graph figure measured on the device (a calibration, or the
    engine's own logged ``Estimated CUDA graph memory``) in place of fit's estimate of the
    graphs captured; ``plan``: a plan whose sizes and phases replace the engine default's
    (:func:`.measured.plan_graphs`). Where it does not fit, only the fixes that fit when
    applied are kept (of the ``--tp`` ones, the smallest)."""
    inp = resolve(model, device_name, engine, tp, flags, plan=plan, measured_graph=measured_graph)
    res = _ENGINES[inp.engine](inp)
    if res.fits:
        return res
    kept: list[str] = []
    for fix in res.fixes:
        if fix.startswith("--tp ") and any(k.startswith("--tp ") for k in kept):
            continue
        if _works(fix, model, device_name, engine, tp, inp.flags, measured_graph, plan):
            kept.append(fix)
    return msgspec.structs.replace(res, fixes=kept)


_TYPES = {"int": int, "float": float}


def _works(fix, model, device_name, engine, tp, flags, measured_graph, plan) -> bool:
    """Whether the configuration with ``fix`` (``--flag value`` pairs) applied fits."""
    words = fix.split()
    changed = dict(flags)
    for name, value in zip(words[::2], words[1::2]):
        name = name.removeprefix("--")
        if name == "tp":
            tp = int(value)
        else:
            changed[name] = _TYPES.get(engine_flags()[name].type, str)(value)
    try:
        inp = resolve(model, device_name, engine, tp, changed, plan=plan, measured_graph=measured_graph)
    except InputError:
        return False
    return _ENGINES[inp.engine](inp).fits
