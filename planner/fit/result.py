"""Engine-neutral pieces of fit's answer: the items every release has (device total,
weights), graph memory for a set of sizes, the does-not-fit fixes and the result's
assembly. The engines' layers (:mod:`.vllm`, :mod:`.sglang`) resolve their settings and
size the KV cache by their release's rule over these.
"""

from __future__ import annotations

import msgspec

from capture_plan.schemas.fit import FIT_SCHEMA_VERSION, FitItem, FitResult, SizeCost, Speculative

from . import estimate
from .graph_count import GraphCount, whole_graphs
from .graph_pool import Captures
from .inputs import FitInputs
from .model import replicated_bytes, weight_bytes
from .rope import rotary_cache

__all__ = [
    "Kv",
    "Verdict",
    "FITS",
    "NO_FIX",
    "known",
    "device_total",
    "weights",
    "graph_memory",
    "fixes",
    "fix_text",
    "budget_fix",
    "result",
    "draft_graphs",
    "draft_note",
    "with_drafts",
]

#: what a does-not-fit says when none of the single changes :func:`fixes` proposes fits once
#: applied (weights that no --tp the heads allow brings under the device)
NO_FIX = (
    "none of fit's single changes fits (a shorter max length, fp8 KV, --tp up to 64 where it divides the "
    "heads): give a larger --device (planner/data/fit_devices.toml lists them) or a smaller model"
)


class Kv(msgspec.Struct, frozen=True):
    """The KV cache as the release sizes and counts it."""

    bytes: int
    #: vLLM's blocks or SGLang's pages, ``block_tokens`` tokens each
    blocks: int
    block_tokens: int
    tokens: int
    #: requests at ``max_model_len`` the cache holds at once
    concurrency: float
    max_model_len: int


class Verdict(msgspec.Struct, frozen=True):
    fits: bool
    #: one line: the item that overflows (empty when it fits)
    overflow: str = ""
    fixes: list[str] = []


FITS = Verdict(True)


def known(item: FitItem) -> int:
    """An item's bytes where it is never unknown (weights, non-torch, activations)."""
    assert item.bytes is not None, item.name
    return item.bytes


def device_total(inp: FitInputs) -> FitItem:
    dev = inp.device
    return FitItem(
        "device total",
        dev.torch_total,
        dev.torch_total_error,
        "given" if dev.torch_total_gib else "estimated",
        dev.torch_source or f"nvidia-smi's {dev.smi_total_mib} MiB less the H100's difference ({dev.smi_source})",
    )


def weights(inp: FitInputs) -> FitItem:
    """The target's weight bytes on one rank, with the engine's rotary cos/sin cache beside
    them (:func:`.rope.rotary_cache`: its rows and element by rope type, as the release keeps it)."""
    m = inp.model
    rot = rotary_cache(m, inp.engine, inp.version)
    b = weight_bytes(m, inp.tp, rot.bytes)
    rope = f"; the engine's rotary cos/sin cache ({rot.bytes} bytes) beside it: {rot.how}" if rot.bytes else ""
    if not m.exact_weight_bytes:  # counted from the dimensions: within 0.5% of the loaded figure
        return FitItem("weights", b, int(0.005 * b) + rot.error, "estimated", f"counted from {m.source}{rope}")
    if inp.tp == 1:
        exact = "estimated" if rot.error else "exact"
        return FitItem("weights", b, rot.error, exact, f"the checkpoint's safetensors index{rope}")
    # the index gives the total only: which parameters each rank holds whole is counted
    rep = replicated_bytes(m)
    src = f"the checkpoint's safetensors index over tp {inp.tp}, the norms and router ({rep} bytes) whole on each rank"
    return FitItem("weights", b, rep + rot.error, "estimated", src + rope)


def graph_memory(
    inp: FitInputs,
    graphs: GraphCount | None,
    captures: Captures,
    *,
    plan: bool = False,
    transient: tuple[int, str] | None = None,
) -> FitItem:
    """Graph memory of ``graphs``, captured as ``captures`` says (:func:`.estimate.graph_memory`;
    not read where ``plan``);
    ``plan``: they are the plan's (``graphs`` None: its graphs, each captured whole), whose
    predicted pool is the figure's pool; ``transient``: the engine's kernels' pool bytes at
    the peak besides the activations (:func:`.estimate.graph_memory`; with ``plan``, only
    where the plan's backend is the one whose kernels allocate them: ``PlanGraphs.backend``)."""
    p = inp.request.plan if plan else None
    pool = None if p is None else (p.pool_bytes, f"plan {p.name}'s predicted pool ({p.source})")
    if graphs is None:
        if p is None:
            raise ValueError("graphs None is a plan's")
        graphs = whole_graphs(p.graphs, "plan graphs captured whole")
    return estimate.graph_memory(inp.model, inp.tp, inp.device.sm, graphs, captures, pool, transient)


def with_drafts(target: FitItem, drafts: FitItem) -> FitItem:
    """A figure of the target's graphs alone (a plan's, predicted or measured; a size list's)
    with the draft's graphs estimated beside it (the engine's speculator captures them after
    the plan's: planner/fit/vllm.py draft_captures)."""
    if target.bytes is None or drafts.bytes is None:
        return target if target.bytes is None else drafts
    return FitItem(
        "graph memory",
        target.bytes + drafts.bytes,
        (target.error_bytes or 0) + (drafts.error_bytes or 0),
        "estimated",
        f"{target.source}; + the draft's graphs: {drafts.source}",
    )


def plan_cost(
    inp: FitInputs,
    tokens_of,
    none_tokens: int,
    transient: tuple[int, str] | None = None,
    drafts: FitItem | None = None,
) -> list[SizeCost]:
    """The plan's sizes priced (``tokens_of(graph bytes)``: the KV tokens they leave), where a
    plan is given: its measured figure where a calibration gives one; ``transient`` as
    :func:`graph_memory`'s; ``drafts``: the draft's graphs where fit models them, beside a
    plan's figure that holds none of them (else such a figure leaves the graph memory unknown)."""
    p = inp.request.plan
    if p is None:
        return []
    planned = inp.measured_without_drafts or graph_memory(inp, None, Captures([]), plan=True, transient=transient)
    gi = inp.graph_measured or (
        (with_drafts(planned, drafts) if drafts is not None else draft_graphs(inp))
        if inp.speculative_graphs
        else planned
    )
    t = None if gi.bytes is None else tokens_of(gi.bytes)
    return [SizeCost("plan", p.sizes, gi.bytes, t, None if t is None else none_tokens - t)]


def fixes(
    inp: FitInputs,
    total: int,
    tokens: int,
    max_model_len: int,
    *,
    len_flag: str,
    fp8: str,
    budget: str = "",
    graphs: tuple[str, ...] = (),
) -> list[str]:
    """Candidate fixes, each checked by :func:`.fit.fit` before it is shown (one that does
    not fit is dropped): ``budget``, the engine's budget flag at the value that fits, where
    the engine's layer offers it (vLLM: where the user set the flag; SGLang: its default
    fraction too, which a large chunked-prefill-size or cuda-graph-max-bs lowers); where the
    weights alone leave no room, the smallest --tp whose
    shard leaves a quarter of ``total``; else a ``len_flag`` the cache holds (``tokens``),
    ``fp8`` KV where halving a 2-byte element doubles the tokens past one request, and
    ``graphs`` (fewer capture sizes, none); then more GPUs (every doubling of --tp up to 64:
    the first that fits is kept)."""
    tp, w = inp.tp, known(weights(inp))  # the rank's shard as the weights item counts it (the release's rope cache)
    out = [budget] if budget else []
    n = tp
    while w * tp / n > 0.75 * total and n < 64:
        n *= 2
    if n == tp:
        if tokens >= 16:
            out.append(f"--{len_flag} {tokens // 16 * 16}")
        if fp8 and inp.kv_dtype_bytes == 2 and tokens * 2 >= max_model_len:
            out.append(fp8)
        out += graphs
        n = tp * 2
    while n <= 64:
        out.append(f"--tp {n}")
        n *= 2
    return out


def fix_text(kept: list[str]) -> str:
    """The fixes that fit (each a set of flags), joined for one error line; :data:`NO_FIX` when none does."""
    return " or ".join(kept) or NO_FIX


def budget_fix(flag: str, need: int, of: int) -> str:
    """``--flag F``: the smallest fraction F (rounded up to 0.01) with F x ``of`` >= ``need``
    (the items the rule takes from the budget, and one request's KV)."""
    return f"--{flag} {-(-need * 100 // of) / 100}"


def result(
    inp: FitInputs,
    *,
    settings: dict,
    items: list[FitItem],
    kv: Kv,
    costs: list[SizeCost],
    verdict: Verdict,
    notes: list[str],
    speculative: Speculative | None = None,
) -> FitResult:
    return FitResult(
        schema_version=FIT_SCHEMA_VERSION,
        engine=inp.engine,
        version=inp.version,
        rule=inp.rule_name,
        wheel_sha256=inp.wheel_sha256,
        device=inp.device_name,
        model=inp.model.name,
        tp=inp.tp,
        settings=settings,
        items=items,
        kv_layers=inp.kv_layers,
        kv_bytes=kv.bytes,
        kv_blocks=kv.blocks,
        block_tokens=kv.block_tokens,
        kv_tokens=kv.tokens,
        max_concurrency=round(kv.concurrency, 2),
        max_model_len=kv.max_model_len,
        size_costs=costs,
        fits=verdict.fits,
        overflow=verdict.overflow,
        fixes=verdict.fixes,
        notes=notes,
        speculative=speculative,
    )


def draft_graphs(inp: FitInputs) -> FitItem:
    """Graph memory under ``inp``'s speculative decoding where its draft's graphs are not
    modelled (fit prices vLLM's EAGLE heads' alone: planner/fit/vllm.py draft_captures) or a
    plan's figure stands for the target's: unknown, never zero (no capture report measures a
    draft's graphs or the target's verify widths); where the request gives a measured figure
    of a plan without speculative phases, it says it holds none of them."""
    d, measured = inp.draft, inp.measured_without_drafts
    assert d is not None, "speculative decoding's graph memory"
    whose = "and the draft's own graphs are" if d.counted != "none" else "are"
    why = (
        f"speculative decoding ({d.method}): the target's graphs at its verify widths {whose} in no committed "
        "capture report, so no measured figure is near"
    )
    if measured is not None:
        # the figure given (a plan's: predicted, or measured by its calibration), not the draft's
        why += f"; the graph figure given ({measured.source}) is of a plan with no speculative phase"
    return FitItem("graph memory", None, None, "unknown", why)


def draft_note(method: str, graph_unknown: bool) -> str:
    """The line a result under speculative decoding carries."""
    tail = "; graph memory unknown (the draft's graphs are neither modelled nor measured here): KV figures exclude it"
    tail = tail if graph_unknown else ""
    return (
        f"speculative decoding ({method}): the draft's weights load beside the target's and its KV layers share "
        f"the cache (speculative.kv_tokens_without: the tokens without it){tail}"
    )
