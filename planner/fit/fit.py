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
from capture_plan.schemas.fit import FitResult

from .flags import changes_of
from .inputs import FitRequest, resolve
from .sglang import fit_sglang
from .vllm import fit_vllm

__all__ = ["fit", "FitRequest"]

#: each engine's layer
_ENGINES = {"vllm": fit_vllm, "sglang": fit_sglang}


def fit(req: FitRequest) -> FitResult:
    """``req``'s answer: its flags are the engine's own by name (None or absent: the
    release's default); its measured graph, a graph figure measured on the device (a
    calibration, or the engine's own logged ``Estimated CUDA graph memory``) in place of
    fit's estimate of the graphs captured; its plan, one whose sizes and phases replace the
    engine default's (:func:`.measured.plan_graphs`). Where it does not fit, only the fixes
    that fit when applied are kept, and of several candidates for one flag (``--tp`` doublings,
    SGLang's ``--cuda-graph-max-bs`` halvings) the first that fits: the engine's layer lists
    them in the order an operator would take them (the fewest GPUs, the most batch sizes)."""
    inp = resolve(req)
    res = _ENGINES[inp.engine](inp)
    if res.fits:
        return res
    checked = msgspec.structs.replace(req, flags=inp.flags)
    kept: list[str] = []
    flags: set[str] = set()  # the flag each kept fix sets first: one value each
    for fix in res.fixes:
        flag = fix.split(" ", 1)[0]
        if flag not in flags and _works(checked.changed(changes_of(fix))):
            kept.append(fix)
            flags.add(flag)
    return msgspec.structs.replace(res, fixes=kept)


def _works(req: FitRequest) -> bool:
    """Whether ``req`` (a fix applied) fits. A fix the engine's layer refuses (SGLang's default
    memory fraction out of (0, 1) at a larger --tp, say) does not work: its refusal is the
    fix's, not the user's settings', so it must not escape as the answer."""
    try:
        inp = resolve(req)
        return _ENGINES[inp.engine](inp).fits
    except InputError:
        return False
