"""vLLM's layer of fit: the release's defaults and capture sizes, its graphs per cudagraph
mode, and its KV sizing (before capture, deducting or only logging the graph estimate; or
after capture, 0.34.0's extensible KV cache), over the engine-neutral :mod:`.result`.
The arithmetic of each step is :mod:`.sizing`'s, each function naming the release's code.
"""

from __future__ import annotations

import math

from capture_plan.planner.inputs.releases import release
from capture_plan.schemas.fit import FitItem, FitResult, SizeCost

from . import estimate, graph_pool, result, sizing
from .buffers import engine_buffers, made_by_profile
from .draft import speculative
from .graph_count import FULL_DECODE, PIECEWISE, GraphCount, full_graph_sizes, vllm_graphs
from .graph_pool import Captures, DraftCaptures, DraftGraph, Graph
from .inputs import FitInputs
from .refusal import Refusal
from .reserve import reserve_growth_item
from .result import Kv, Verdict, known
from .tables import GiB, MiB, buffer_rule, estimates, sampler_rule

__all__ = ["fit_vllm"]


def split_kv_accum(inp: FitInputs) -> tuple[int, str] | None:
    """The FA3 split-KV accumulators vLLM's FULL graphs allocate in the pool at each
    attention call, per token of the graph (planner/data/fit_estimates.toml
    [graph.vllm_split_kv]): float32 out_accum [splits, heads / tp, tokens, head_dim_v] and
    softmax_lse_accum [splits, heads / tp, tokens]; None where FA3 is not vLLM's backend (an
    MLA model, a device of another compute capability)."""
    m = inp.model
    e = estimates()["graph"]["vllm_split_kv"]
    if m.mla or inp.device.sm not in e["capabilities"]:
        return None
    return 4 * e["splits"] * (m.heads // inp.tp) * (m.v_head_dim + 1), e["source"]


def vllm_captures(inp: FitInputs, mode: str, sizes: list[int], seqs: int) -> Captures:
    """What vLLM's ``mode`` captures into its pool, in its order (cudagraph_utils.py
    CudaGraphManager.capture: PIECEWISE first, then FULL, each largest first), the split-KV
    accumulators at each attention call of its FULL graphs (attention runs eagerly between
    PIECEWISE pieces)."""
    accum = split_kv_accum(inp)
    per_token = accum[0] if accum else 0
    full = sorted(full_graph_sizes(mode, sizes, seqs), reverse=True)
    piecewise = sorted(sizes, reverse=True) if vllm_graphs(mode, sizes, seqs, 0).whole > len(full) else []
    graphs = [Graph(t, pieces=True) for t in piecewise] + [Graph(t, t * per_token) for t in full]
    return Captures(graphs, accum[1] if accum and full else "")


def draft_captures(inp: FitInputs, mode: str, sizes: list[int], seqs: int) -> DraftCaptures | None:
    """An EAGLE head's graphs, captured after the target's (gpu/model_runner.py capture_model:
    the model's manager, then ``speculator.capture()``: the draft prefill manager, then the
    draft decode manager, each on a capture stream of its own, PIECEWISE before FULL, each
    largest first). The prefill manager (the model's ``mode``): PIECEWISE graphs of the draft's
    forward at every size where ``mode`` has them (its sampling eager), and FULL graphs of
    num_speculative_tokens + 1 tokens a request, forward and sampling; the decode manager (FULL
    where ``mode``'s decode graphs are): the fused multi-step decode (speculator.py
    ``_fused_multi_step_decode``, FlashAttention's supports_draft_decode_metadata_update:
    num_speculative_tokens - 1 steps in one graph), at the release's sizes
    (:func:`.sizing.vllm_draft_graphs`, the release's ``draft_decode_sizes``) and with its
    argmax (``draft_argmax_block``); FA3's split-KV accumulators at each attention call of a
    FULL graph as in the target's. None: no EAGLE head (no draft, n-gram, a whole draft model
    or an EAGLE3 head, whose graphs are not modelled), or mode FULL (whose token-keyed FULL
    draft graphs are not modelled)."""
    d = inp.draft
    if d is None or d.counted != "eagle" or d.model is None or not sizes or mode not in (*FULL_DECODE, "PIECEWISE"):
        return None
    facts = release("vllm", inp.version).facts
    assert facts is not None, "a vLLM release's facts"
    accum = split_kv_accum(inp)
    per_token = accum[0] if accum else 0
    q = d.tokens + 1
    prefill, decode = sizing.vllm_draft_graphs(sizes, seqs, d.tokens, facts.draft_decode_sizes, facts.decode_keys)
    if mode not in FULL_DECODE:  # PIECEWISE: no FULL graphs, no draft decode graphs
        prefill, decode = [], []
    pieces = sorted(sizes, reverse=True) if mode in PIECEWISE else []
    managers = (
        tuple(DraftGraph(t, 1, 1, pieces=True) for t in pieces)
        + tuple(DraftGraph(n, q, 1, n * q * per_token) for n in prefill),
        tuple(DraftGraph(n, 1, d.tokens - 1, n * per_token) for n in decode),
    )
    return DraftCaptures(d.model, tuple(m for m in managers if m), facts.draft_argmax_block)


def draft_profile(inp: FitInputs, batched: int, seqs: int) -> tuple[int, str] | None:
    """The peak of an EAGLE head's dummy propose in vLLM's profiling run and what it is
    (:func:`.estimate.eagle_profile_peak`: its prefill over the profile's ``batched`` tokens,
    min(``seqs``, ``batched``) sampled rows); None without an EAGLE head (another draft's
    propose is not counted)."""
    d = inp.draft
    if d is None or d.counted != "eagle" or d.model is None:
        return None
    facts = release("vllm", inp.version).facts
    assert facts is not None, "a vLLM release's facts"
    reqs = min(seqs, batched)
    peak = estimate.eagle_profile_peak(d.model, inp.model, inp.tp, batched, reqs, facts.draft_argmax_block)
    return peak, f"its EAGLE head's prefill over {batched} tokens, {reqs} sampled rows, after the target's forward"


def capture_outputs(inp: FitInputs, sizes: list[int]) -> tuple[int, str] | None:
    """The model graph manager's persistent hidden states where the release makes them inside
    the window it measures its capture by (the rule's ``capture_outputs``): ``max(sizes)``
    rows of the hidden size in the model dtype, allocated on the capture stream, which has no
    cached block free, so the allocator maps a segment for them (its 2 MiB or 20 MiB one, or
    the request rounded to 2 MiB: planner/memory/allocator.py segment_size) that stays."""
    if not inp.rule.capture_outputs or not sizes:
        return None
    from capture_plan.planner.memory.allocator import round_size, segment_size

    m = inp.model
    n = max(sizes) * m.hidden * m.dtype_bytes
    seg = segment_size(round_size(n))
    return seg, (
        f"the graph manager's persistent hidden states, {max(sizes)} x {m.hidden} ({n / MiB:.1f} MiB) in a "
        f"{seg / MiB:.0f} MiB segment made inside the capture's window (cudagraph_utils.py persistent_like)"
    )


def accum_growth(inp: FitInputs, sizes: list[int]) -> tuple[int, str] | None:
    """What FA3's split-KV accumulators add to a pool of FULL graphs at ``sizes`` (whose
    simulation holds none: a plan's): the simulated pool with them less the one without, since
    the layer's later temporaries reuse the accumulators' freed block."""
    accum = split_kv_accum(inp)
    if accum is None or not sizes:
        return None
    order = sorted(sizes, reverse=True)
    m, sm = inp.model, inp.device.sm
    with_ = graph_pool.pool_bytes(m, inp.tp, sm, Captures([Graph(t, t * accum[0]) for t in order]))[0]
    without = graph_pool.pool_bytes(m, inp.tp, sm, Captures([Graph(t) for t in order]))[0]
    return with_ - without, f"{accum[1]}: {(with_ - without) / MiB:.0f} MiB more pool in the simulation"


def _both(a: tuple[int, str] | None, b: tuple[int, str] | None) -> tuple[int, str] | None:
    """Two (bytes, what) additions as one."""
    if a is None or b is None:
        return a or b
    return a[0] + b[0], f"{a[1]} + {b[1]}"


def fit_vllm(inp: FitInputs) -> FitResult:
    m, rule, dev, d = inp.model, inp.rule, inp.device, inp.draft
    total = dev.torch_total
    after = rule.kind == "vllm-after-capture"
    util = inp.flag("gpu-memory-utilization", rule.default_utilization)
    defaults = sizing.vllm_batch_defaults(total, inp.device_name, rule.batch_tier_160)
    mml = inp.context.value  # given, else the release's default (planner/fit/context.py)
    seqs, batched = sizing.vllm_batch_limits(
        defaults, inp.flag("max-num-seqs", None), inp.flag("max-num-batched-tokens", None), mml
    )
    if batched < seqs:  # vllm/config/scheduler.py SchedulerConfig refuses it at start-up
        raise Refusal(
            f"max_num_batched_tokens ({batched}) must be greater than or equal to max_num_seqs ({seqs}), "
            "as vLLM's SchedulerConfig refuses it",
            where="--max-num-batched-tokens",
            hint="as many sequences as batched tokens at most",
            changes={"max-num-seqs": batched},
        )
    block = inp.flag("block-size", 64 if m.mla else 16)
    mode = inp.flag("cudagraph-mode", "FULL_AND_PIECEWISE")
    eager = inp.flag("enforce-eager", False)
    given = inp.flags.get("cudagraph-capture-sizes")
    top = inp.flags.get("max-cudagraph-capture-size")
    sizes = (
        sizing.vllm_given_sizes(given, batched)
        if given
        else sizing.vllm_default_sizes(seqs, batched, top, rule.capture_appends, 1 + (d.tokens if d else 0))
    )
    if eager or mode == "NONE":
        if inp.request.plan is not None:
            raise Refusal(
                "a plan's graphs are not captured without CUDA graphs",
                where="--plan",
                hint="capture them (or leave out --plan)",
                changes={"enforce-eager": None, "cudagraph-mode": None},
            )
        sizes = []
    captured = inp.request.plan.sizes if inp.request.plan is not None else sizes
    settings = {
        "gpu-memory-utilization": util,
        "max-model-len": mml,
        "max-num-seqs": seqs,
        "max-num-batched-tokens": batched,
        "kv-cache-dtype": inp.flag("kv-cache-dtype", "auto"),
        "block-size": block,
        "enforce-eager": eager,
        "cudagraph-mode": mode,
        "cudagraph-capture-sizes": ",".join(map(str, captured)) or "none",
    }
    if d is not None:
        settings["speculative-config"] = inp.flags["speculative-config"]
    requested = sizing.vllm_requested(total, util)
    nt = estimate.non_torch(inp.tp, inp.device.sm, inp.rule.first_stream == "profile")
    # the releases read for their persistent buffers count what stays allocated after the
    # profile (total_consumed) apart from its transient peak (fit_rules.toml [buffers] sources:
    # memory_profiling's transient_peak_headroom): the fused-MoE workspace, which the workspace
    # manager keeps, is persistent there; the others log and deduct the torch peak's increase,
    # which holds it (its own item only where the release splits them)
    split = buffer_rule("vllm", inp.version) is not None
    row = sampler_rule("vllm", inp.version)
    kept = made_by_profile(inp, settings)  # the sampler's scratch, made after the forward's peak
    act_alone = estimate.activation_peak(m, inp.tp, batched, seqs, row, workspace_held=split, kept=kept)
    proposed = draft_profile(inp, batched, seqs)
    act = (
        estimate.activation_peak(m, inp.tp, batched, seqs, row, workspace_held=split, kept=kept, draft=proposed)
        if proposed
        else act_alone
    )
    moe = estimate.moe_workspace_item(m, inp.tp, batched) if split else None
    moes = [moe] if moe is not None else []
    held = sum(known(i) for i in moes)
    # 0.34.0 keeps the larger of the transient peak and torch's reserve growth over its sizing
    # step, which follows the profiling run (what that kept: the MoE workspace, the scratch)
    made = (held, kept)
    reserves = [reserve_growth_item(m, inp.tp, batched, seqs, row.rule, known(act), made)] if after else []
    grown = sum(known(i) for i in reserves)
    ctx = estimate.context()
    bufs = engine_buffers(inp, settings)  # the runner's persistent buffers (fit_rules.toml [buffers])
    persistent = (bufs.bytes or 0) + held  # what the profile keeps besides the weights and non-torch
    weights = result.weights(inp)
    dw = d.weights if d is not None else None
    loaded = known(weights) + (known(dw) if dw is not None else 0)  # the draft loads beside the target
    init_free = total - known(ctx)

    def graph_of(ss: list[int], drafts: bool = True) -> FitItem:
        """The engine's graphs at ``ss``; ``drafts`` False: the target's alone."""
        drafted = draft_captures(inp, mode, ss, seqs) if drafts else None
        if drafts and d is not None and d.counted != "none" and ss and drafted is None:  # ngram: the target's alone
            return result.draft_graphs(inp)
        count = vllm_graphs(mode, ss, seqs, m.layers)
        captures = vllm_captures(inp, mode, ss, seqs)._replace(draft=drafted)
        return result.graph_memory(inp, count, captures, transient=capture_outputs(inp, ss))

    def kv_of(
        graph: int, weights_bytes: int = loaded, buffers_bytes: int = persistent, activation: int | None = None
    ) -> int:
        # the items the profile measured: both sizings take the same ones, by name
        peak = known(act) if activation is None else activation
        profiled = dict(weights=weights_bytes, non_torch=known(nt), activation=peak, buffers=buffers_bytes)
        if after:
            return sizing.vllm_after_capture(rule, requested, init_free, graph=graph, reserve_growth=grown, **profiled)
        deducted = graph if rule.graph_estimate == "deducted" else 0
        return sizing.vllm_before_capture(requested, graph=deducted, **profiled)

    in_flight = batched * rule.in_flight_batches  # async scheduling (on by default): two batches in flight

    draft_kv = d.kv_per_token if d is not None else 0

    def count(avail: int, draft: int = draft_kv) -> tuple[int, float, int]:
        return sizing.vllm_blocks(m, inp.per_layer, block, avail, mml, in_flight, rule.kv_tokens, draft)

    measured = inp.graph_measured  # None under speculative decoding, unless of a plan with its phases
    plan = inp.request.plan
    # an EAGLE head's graphs beside a figure of the target's alone (a plan's, a size list's):
    # the engine's speculator captures them at the sizes the figure is of; a plan with
    # speculative phases holds them itself, a figure of no graphs none of them; without such a
    # figure, graph_of prices them with the engine default's graphs
    req = inp.request
    target_alone = inp.measured_without_drafts
    holds = (plan is not None and plan.speculative) or req.figure_speculative
    at = list(req.figure_sizes) if req.figure_sizes is not None else captured
    figure = plan is not None or target_alone is not None
    drafted = draft_captures(inp, mode, at, seqs) if figure and not holds and at else None
    drafts = (
        result.graph_memory(inp, GraphCount(0, 0, "the target's graphs apart"), Captures([], draft=drafted))
        if drafted
        else None
    )
    # a plan's graphs are captured whole (FULL): with FA3 as the plan's backend, vLLM's split-KV
    # accumulators are in their pool, which the plan's simulation does not hold (the planner's
    # fa3 backend simulates no split temporaries: backends.toml attention_temp_factor 0)
    plan_transient = None
    if plan is not None:
        growth = accum_growth(inp, plan.sizes) if plan.backend == "fa3" else None
        plan_transient = _both(growth, capture_outputs(inp, plan.sizes))
        alone = target_alone or result.graph_memory(inp, None, Captures([]), plan=True, transient=plan_transient)
        graph = measured or alone
        if measured is not None:  # a calibration of every graph the engine captures
            alone = measured
        elif d is not None and d.counted != "none":
            graph = result.with_drafts(alone, drafts) if drafts else result.draft_graphs(inp)
    elif measured is not None and sizes:
        alone = graph = measured
    elif target_alone is not None and sizes:  # a build's figure, or a size list's (planner sizes)
        alone = target_alone
        if req.figure_sizes == ():  # no graphs at all: the draft's none either
            graph = target_alone
        else:
            graph = result.with_drafts(target_alone, drafts) if drafts else result.draft_graphs(inp)
    else:
        graph = graph_of(sizes)
        alone = graph_of(sizes, drafts=False) if d is not None else graph
    budget = FitItem(
        "engine budget",
        requested,
        dev.torch_total_error,
        "rule",
        f"ceil(total x gpu-memory-utilization {util}) (vllm/v1/worker/utils.py: request_memory)",
    )
    items = [result.device_total(inp), budget, weights, *([dw] if dw else []), nt, bufs, *moes, act]
    items += [*reserves, graph]
    if after:
        items.insert(1, ctx)
    notes = inp.context_notes()
    if not after and rule.graph_estimate == "logged":
        notes.append(
            f"vllm {inp.version} profiles and logs its graph estimate but does not take it from the KV budget "
            "(VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS off by default): graphs are captured into what "
            "gpu-memory-utilization leaves"
        )
    elif graph.bytes is None:
        notes.append("graph memory unknown: KV figures exclude it (an upper bound)")
    kv_bytes = kv_of(graph.bytes or 0)
    deducted_graph = (graph.bytes or 0) if rule.graph_estimate == "deducted" else 0
    # the error bar: the items this rule takes the KV cache from (and those it subtracts)
    if after:
        by_budget = sizing.vllm_after_capture_by_budget(rule, requested, init_free, known(act))
        taken = [budget] if by_budget else [items[0], ctx]
        taken += [weights, nt, bufs, *moes, graph, act, *reserves]
    else:
        taken = [budget, weights, nt, bufs, *moes, act] + ([graph] if rule.graph_estimate == "deducted" else [])
    err = sum(i.error_bytes or 0 for i in taken + ([dw] if dw else []))
    items.append(FitItem("KV cache", max(kv_bytes, 0), err, "rule", "; ".join(rule.steps[-3:-1])))
    blocks, conc, kv_tokens = count(kv_bytes)

    def tokens_of(graph_bytes: int) -> int:
        return count(kv_of(graph_bytes))[2]

    none_tokens = tokens_of(0)

    def cost_of(name: str, ss: list[int]) -> SizeCost:
        gi = graph_of(ss)
        t = None if gi.bytes is None else tokens_of(gi.bytes)
        return SizeCost(name, ss, gi.bytes, t, None if t is None else none_tokens - t)

    costs = [cost_of("engine default", sizes), *result.plan_cost(inp, tokens_of, none_tokens, plan_transient, drafts)]
    costs += [cost_of(name, sorted(ss)) for name, ss in inp.request.lists.items()]
    costs += [cost_of("fewer", [s for s in sizes if s <= FEWER_MAX]), cost_of("none", [])]
    verdict = result.FITS
    if kv_bytes <= 0 or conc < 1:
        need = math.ceil(mml / block) * block * (inp.per_layer * m.layers + draft_kv)
        budget_fix = ""
        if "gpu-memory-utilization" in inp.flags:  # the user's budget starves the cache: the one that fits
            # both rules take weights, non-torch, what the profile keeps, the peak and the
            # deducted graphs from the budget
            taken = loaded + known(nt) + persistent + max(known(act), grown)
            taken += (graph.bytes or 0) if after else deducted_graph
            one = sizing.vllm_request_bytes(m, inp.per_layer, block, mml, in_flight, draft_kv)
            budget_fix = result.budget_fix("gpu-memory-utilization", taken + one, total)
        biggest = max((i for i in (weights, nt, bufs, *moes, act, graph) if i.bytes), key=lambda i: i.bytes or 0)
        verdict = Verdict(
            False,
            f"KV cache {max(kv_bytes, 0) / GiB:.2f} GiB holds {kv_tokens} tokens, fewer than one request of "
            f"max-model-len {mml} ({need / GiB:.2f} GiB); "
            f"the largest item is {biggest.name} ({known(biggest) / GiB:.2f} GiB)",
            result.fixes(
                inp,
                total,
                kv_tokens,
                mml,
                len_flag="max-model-len",
                fp8="--kv-cache-dtype fp8",
                budget=budget_fix,
                graphs=_fewer_graphs(inp, sizes),
            ),
        )
    kv = Kv(max(kv_bytes, 0), blocks, block, kv_tokens, conc, mml)
    spec = None
    if d is not None:  # the same settings without the draft: its weights, KV, buffers, graphs and propose
        without = (engine_buffers(inp, settings, draft=False).bytes or 0) + held
        target_graphs = alone.bytes if alone.bytes is not None else (graph.bytes or 0)
        _, conc0, tokens0 = count(kv_of(target_graphs, known(weights), without, known(act_alone)), 0)
        spec = speculative(d, tokens0, conc0)
        notes.append(result.draft_note(d.method, graph.bytes is None))
    return result.result(
        inp, settings=settings, items=items, kv=kv, costs=costs, verdict=verdict, notes=notes, speculative=spec
    )


#: the largest capture size of the "fewer" set (size_costs): vLLM's sizes up to it
FEWER_MAX = 64


def _fewer_graphs(inp: FitInputs, sizes: list[int]) -> tuple[str, ...]:
    """The capture fixes (fewer sizes: --max-cudagraph-capture-size 64, the "fewer" set; none:
    --enforce-eager) where fit prices the engine default's graphs from its sizes: not with a
    plan or a measured graph (a build's: its plan's sizes are the build's to change, and its
    capture flags are refused) nor where the user chose the sizes."""
    req = inp.request
    chosen = ("cudagraph-capture-sizes", "max-cudagraph-capture-size", "enforce-eager")
    if req.plan is not None or req.measured_graph is not None or not sizes or any(f in inp.flags for f in chosen):
        return ()
    fewer = (f"--max-cudagraph-capture-size {FEWER_MAX}",) if max(sizes) > FEWER_MAX else ()
    return (*fewer, "--enforce-eager")
