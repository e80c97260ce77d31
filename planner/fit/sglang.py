"""SGLang's layer of fit: 0.5.23's defaults per device and tp (memory_hook), its decode and
prefill graph sizes, and its static-fraction KV sizing, over the engine-neutral
:mod:`.result`. The arithmetic of each step is :mod:`.sizing`'s.
"""

from __future__ import annotations

import math

import msgspec

from capture_plan.schemas.fit import FitItem, FitResult, SizeCost

from . import estimate, result, sizing
from .draft import speculative
from .graph_count import sglang_graphs
from .graph_pool import Captures, Graph
from .inputs import FitInputs
from .refusal import Refusal
from .result import Kv, Verdict, known
from .swa import DISABLE_FLAG, RATIO_FLAG, sglang_pool
from .tables import GiB, sampler_rule

__all__ = ["fit_sglang"]


def fit_sglang(inp: FitInputs) -> FitResult:
    m, d = inp.model, inp.draft
    pool = sglang_pool(inp)  # one pool over every layer, or the hybrid sliding-window split
    if d is not None and d.layers:  # DefaultPoolConfigurator: the target's cell grows by the draft's share
        if pool.ratio is not None:
            raise Refusal(
                "a speculative draft's KV in SGLang's hybrid sliding-window pool is not modelled",
                where="--speculative-algorithm",
                hint="price the one pool SGLang keeps over every layer",
                changes={DISABLE_FLAG: True},
            )
        pool = msgspec.structs.replace(pool, full_bytes=pool.full_bytes + d.kv_per_token)
    if pool.kv_layers is not None:  # the split's layer types (Llama 4: its chunked-attention layers)
        inp = msgspec.structs.replace(inp, kv_layers=pool.kv_layers)
    gpu_mem = inp.device.smi_total_mib
    chunk0, bs0 = sizing.sglang_defaults(gpu_mem, inp.tp)
    chunk = inp.flag("chunked-prefill-size", chunk0)
    max_bs = inp.flag("cuda-graph-max-bs", bs0)
    if "cuda-graph-max-bs" not in inp.flags and "max-running-requests" in inp.flags:
        max_bs = min(max_bs, inp.flags["max-running-requests"])
    page = inp.flag("page-size", 1)
    ctx_len = inp.context.value  # given, else the release's default (planner/fit/context.py)
    no_prefill = bool(inp.flag("disable-prefill-cuda-graph", False))
    prefill = [] if no_prefill else sizing.sglang_prefill_sizes(chunk)
    frac = inp.flag("mem-fraction-static", None)
    if frac is None:  # without prefill graphs reserve_for_graph_mb has no prefill term, MLA's neither
        frac = sizing.sglang_mem_fraction(gpu_mem, inp.tp, chunk, max_bs, len(prefill), m.mla and not no_prefill)
        if not 0 < frac < 1:
            raise Refusal(
                f"memory_hook's default is {frac!r:.30}, outside (0, 1), for this device and settings",
                where="--mem-fraction-static",
                hint="a fraction in (0, 1)",
                changes={"mem-fraction-static": 0.85},
            )
    decode = sizing.sglang_decode_sizes(max_bs, d is not None)
    plan = inp.request.plan
    settings = {
        "mem-fraction-static": frac,
        "context-length": ctx_len,
        "chunked-prefill-size": chunk,
        "cuda-graph-max-bs": max_bs,
        "page-size": page,
        "kv-cache-dtype": inp.flag("kv-cache-dtype", "auto"),
        "disable-prefill-cuda-graph": no_prefill,
        "cuda-graph-bs": ",".join(map(str, decode if plan is None else plan.sizes)),
    }
    if pool.ratio is not None:
        settings[RATIO_FLAG] = pool.ratio
    if d is not None:
        settings["speculative-algorithm"] = d.method
        settings.update(d.settings)
    if inp.flags.get(DISABLE_FLAG):
        settings[DISABLE_FLAG] = True
    ctx = estimate.context()
    pre = inp.device.torch_total - known(ctx)
    weights = result.weights(inp)
    dw = d.weights if d is not None else None
    loaded = known(weights) + (known(dw) if dw is not None else 0)  # both load before the pool (init_model_worker)
    nt = estimate.non_torch(inp.tp, inp.device.sm, inp.rule.first_stream == "profile")
    # SGLang runs no profiling forward (its pool is sized from mem_fraction_static): the figure
    # only checks the slack holds one prefill chunk, counted as fit counted it before the
    # releases' samplers were read, vLLM 0.19.0's (fit_rules.toml [sampler.vllm-0-19]); its MoE
    # layers allocate their caches per call (estimate.activation_per_token)
    act = estimate.activation_peak(m, inp.tp, chunk, max_bs, sampler_rule("vllm", "0.19.0"), engine="sglang")

    def graph_of(ss: list[int]) -> FitItem:
        g = result.graph_memory(
            inp,
            sglang_graphs(len(ss), len(prefill), m.layers),
            sglang_captures(prefill, ss),
        )
        return _with_logits_buffer(g, max(ss), m.vocab)

    default_graph = graph_of(decode)
    if d is not None:
        default_graph = result.draft_graphs(inp)
    measured = inp.graph_measured  # None under speculative decoding, unless of a plan with its phases
    if plan is not None:
        if d is not None:
            planned = default_graph
        else:
            planned = result.graph_memory(inp, None, Captures([]), plan=True)
        graph = measured or _with_logits_buffer(planned, max(plan.sizes), m.vocab)
    else:
        graph = measured or default_graph
    budget = FitItem(
        "engine budget",
        int(pre * frac),
        inp.device.torch_total_error,
        "rule",
        f"free at start x mem-fraction-static {frac} (kv_cache_configurator._profile_available_bytes)",
    )
    items = [result.device_total(inp), ctx, budget, weights, *([dw] if dw else []), nt, act, graph]
    kv_bytes = sizing.sglang_kv_bytes(pre, weights=loaded, non_torch=known(nt), fraction=frac)
    tokens, swa_tokens = pool.tokens(kv_bytes, page)
    # the error bar: the items the pool is taken from (free at start: the context's) and those it subtracts
    err = sum(i.error_bytes or 0 for i in (ctx, budget, weights, nt, *([dw] if dw else [])))
    # the step the pool's bytes follow, found by what it names (the rule's steps are the
    # release's reading in order, and a step added above it must not change the citation)
    step = next(s for s in inp.rule.steps if "_profile_available_bytes: rest" in s)
    items.append(FitItem("KV cache", max(kv_bytes, 0), err, "rule", step))
    slack = int(pre * (1 - frac))
    notes = inp.context_notes() + [
        "SGLang sizes its pool from a static fraction: capture sizes cost no tokens, they must fit in the slack"
    ]
    if pool.note:
        notes.append(pool.note + (f" ({swa_tokens:,} sliding-window tokens)" if pool.ratio is not None else ""))
    costs = [SizeCost("engine default", decode, default_graph.bytes, tokens, 0)]
    costs += result.plan_cost(inp, lambda _graph: tokens, tokens)
    # the pool is sized before capture: a list's graphs change no tokens
    for name, ss in inp.request.lists.items():
        costs.append(SizeCost(name, sorted(ss), graph_of(sorted(ss)).bytes if ss else 0, tokens, 0))
    costs.append(SizeCost("none", [], 0, tokens, 0))
    verdict = result.FITS
    # the fraction (given, or the release's default, which a large chunked-prefill-size or
    # cuda-graph-max-bs lowers) that holds one request, where it is one (fit checks it fits)
    need = loaded + known(nt) + math.ceil(-(-ctx_len // page) * page * pool.cell)
    budget_fix = result.budget_fix("mem-fraction-static", need, pre) if need < pre else ""
    if kv_bytes <= 0:
        verdict = Verdict(
            False,
            f"weights {loaded / GiB:.2f} GiB leave no KV cache under mem-fraction-static {frac}",
            result.fixes(inp, pre, 0, ctx_len, len_flag="context-length", fp8="", budget=budget_fix),
        )
    elif not pool.holds_window(kv_bytes, page):  # raised while the pool is sized, before any capture
        verdict = Verdict(
            False,
            f"the sliding-window pool holds {swa_tokens:,} tokens, no more than its {pool.window:,}-token window "
            f"and a page: SGLang admits no request (pool_configurator.validate_swa_pool_size raises)",
            pool.window_fixes(kv_bytes, page),
        )
    # the pool is sized from the free memory after the weights and the non-torch memory, so what the
    # capture and the forward passes may take is the slack alone (non-torch already left it)
    elif graph.bytes is not None and graph.bytes + known(act) > slack:
        verdict = Verdict(
            False,
            f"graph memory {graph.bytes / GiB:.2f} GiB + activations {known(act) / GiB:.2f} GiB exceed the "
            f"{slack / GiB:.2f} GiB mem-fraction-static {frac} leaves",
            _slack_fixes(pre, graph.bytes + known(act), max_bs),
        )
    elif tokens < ctx_len:
        verdict = Verdict(
            False,
            f"KV cache holds {tokens} tokens, fewer than one request of context-length {ctx_len}",
            result.fixes(
                inp, pre, tokens, ctx_len, len_flag="context-length", fp8="--kv-cache-dtype fp8_e4m3", budget=budget_fix
            ),
        )
    kv = Kv(max(kv_bytes, 0), tokens // page, page, tokens, tokens / ctx_len, ctx_len)
    spec = None
    if d is not None:  # the same settings without the draft's weights and its share of the cell
        alone = msgspec.structs.replace(pool, full_bytes=pool.full_bytes - d.kv_per_token)
        bytes0 = sizing.sglang_kv_bytes(pre, weights=known(weights), non_torch=known(nt), fraction=frac)
        tokens0 = alone.tokens(bytes0, page)[0]
        spec = speculative(d, tokens0, tokens0 / ctx_len)
        notes.append(result.draft_note(d.method, graph.bytes is None))
    return result.result(
        inp, settings=settings, items=items, kv=kv, costs=costs, verdict=verdict, notes=notes, speculative=spec
    )


def _slack_fixes(pre: int, need: int, max_bs: int) -> list[str]:
    """Fixes where the graphs and the activations (``need`` bytes) overflow the slack a
    fraction of the free memory ``pre`` leaves: the largest --mem-fraction-static (rounded down
    to 0.01) whose slack holds them, where one above 0 does, then --cuda-graph-max-bs halved
    and halved again down to 1 (fit keeps the first that fits: the most batch sizes)."""
    fixes = []
    frac = (pre - need) * 100 // pre / 100
    if frac > 0:
        fixes.append(f"--mem-fraction-static {frac}")
    bs = max_bs // 2
    while bs >= 1:
        fixes.append(f"--cuda-graph-max-bs {bs}")
        bs //= 2
    return fixes


def sglang_captures(prefill: list[int], decode: list[int]) -> Captures:
    """What 0.5.23 captures into its one global graph pool, in its order
    (model_runner_components/cuda_graph_setup.py capture_cuda_graphs: "prefill before decode"):
    the breakable prefill graphs at ``prefill`` tokens, largest first
    (prefill_cuda_graph_runner.py capture: reversed(capture_num_tokens)), each the transformer
    body in segments with attention run between them and no LM head ("the eager tail"); then
    the decode graphs at ``decode`` requests, largest first, each with its model-dtype logits."""
    graphs = [Graph(t, pieces=True) for t in sorted(prefill, reverse=True)]
    return Captures(graphs + [Graph(b, logits=True) for b in sorted(decode, reverse=True)])


def _with_logits_buffer(graph: FitItem, rows: int, vocab: int) -> FitItem:
    """``graph`` with the decode graphs' shared logits buffer, which the capture's measured
    drop holds (model_executor/model_runner_components/cuda_graph_setup.py capture_decode_graph
    reads the free memory before the decode runner is made): graph_shared_output.py
    ``GraphSharedOutput.get_logits_buffer``, ``torch.zeros((max_rows, vocab_size), float)``, made
    by the decode runner's init, ``max_rows`` the largest decode size (model_runner.py
    max_decode_logits_rows: one token a request without speculative decoding); the whole
    vocabulary on every rank (the logits are gathered)."""
    if graph.bytes is None or graph.bytes == 0:
        return graph
    b = rows * vocab * 4
    src = f"{graph.source}; + the shared float32 logits buffer, {rows} x {vocab} (graph_shared_output.py)"
    return FitItem(graph.name, graph.bytes + b, graph.error_bytes, graph.status, src)
