"""`planner fit`: where a device's memory goes for one engine release and its settings.

:func:`fit` resolves the release's defaults (its utilization, batch limits and capture
sizes for the device), counts each item (weights, non-torch, activation peak, graph
memory, KV) and sizes the KV cache by the release's rule (:mod:`.sizing`), then prices
capture-size sets in KV tokens. A configuration that does not start is ``fits = False``
with one line naming the overflowing item and the fixes that work.
"""

from __future__ import annotations

import math

from capture_plan.schemas.errors import InputError
from capture_plan.schemas.fit import FIT_SCHEMA_VERSION, FitItem, FitResult, KvLayerType, SizeCost

from . import estimate, sizing
from .model import KV_DTYPES, FitModel, kv_bytes_per_token
from .tables import GiB, device, rule_for, wheels

__all__ = ["fit", "VLLM_FLAGS", "SGLANG_FLAGS"]

#: the engines' own flags fit reads (None: the release's default)
VLLM_FLAGS = (
    "gpu-memory-utilization",
    "max-model-len",
    "max-num-seqs",
    "max-num-batched-tokens",
    "kv-cache-dtype",
    "block-size",
    "enforce-eager",
    "cudagraph-capture-sizes",
    "max-cudagraph-capture-size",
    "cudagraph-mode",
)
SGLANG_FLAGS = (
    "mem-fraction-static",
    "context-length",
    "max-running-requests",
    "chunked-prefill-size",
    "cuda-graph-max-bs",
    "page-size",
    "kv-cache-dtype",
)
_MODES = ("FULL_AND_PIECEWISE", "PIECEWISE", "FULL", "FULL_DECODE_ONLY", "NONE")


def _known(item: FitItem) -> int:
    """An item's bytes where it is never unknown (weights, non-torch, activations)."""
    assert item.bytes is not None, item.name
    return item.bytes


def kind_bytes(kinds: list[KvLayerType]) -> int:
    return kinds[0].dtype_bytes if kinds else 0


def _refuse(flag: str, msg: str, fix: str) -> InputError:
    return InputError(msg, where=f"--{flag}", fix=fix)


def fit(
    model: FitModel, device_name: str, engine: str, tp: int, flags: dict, measured_graph: FitItem | None = None
) -> FitResult:
    """``measured_graph``: a vLLM graph figure measured on the device (a calibration, or the
    engine's own logged ``Estimated CUDA graph memory``) in place of fit's estimate of the
    engine's default sizes; status ``given``, its source named."""
    eng, version, rule_name, rule = rule_for(engine)
    dev_name, dev = device(device_name)
    if tp < 1 or tp > 64:
        raise _refuse("tp", f"--tp must be 1 to 64, got {tp}", "give the GPUs one model instance spans, e.g. --tp 2")
    allowed = VLLM_FLAGS if eng == "vllm" else SGLANG_FLAGS
    for k, v in flags.items():
        if v is not None and k not in allowed:
            raise _refuse(k, f"{eng} has no flag --{k}", f"{eng}'s flags fit reads: --{', --'.join(allowed)}")
    kv_flag = flags.get("kv-cache-dtype") or "auto"
    if kv_flag not in KV_DTYPES:
        raise _refuse("kv-cache-dtype", f"unknown KV cache dtype {kv_flag!r}", f"use one of {', '.join(KV_DTYPES)}")
    kv_dtype = KV_DTYPES[kv_flag] or model.dtype_bytes
    per_layer = kv_bytes_per_token(model, tp, kv_dtype)
    total = dev.torch_total
    items = [
        FitItem(
            "device total",
            total,
            dev.torch_total_error,
            "given" if dev.torch_total_gib else "estimated",
            dev.torch_source or f"nvidia-smi's {dev.smi_total_mib} MiB less the H100's difference ({dev.smi_source})",
        )
    ]
    from .model import weight_bytes

    wsrc = "the checkpoint's safetensors index" if model.exact_weight_bytes else f"counted from {model.source}"
    weights = FitItem(
        "weights",
        weight_bytes(model, tp),
        0 if model.exact_weight_bytes else int(0.005 * weight_bytes(model, tp)),
        "exact",
        wsrc,
    )
    kinds = []
    if model.full_layers:
        kinds.append(
            KvLayerType("MLA latent" if model.mla else "full attention", model.full_layers, per_layer, kv_dtype)
        )
    if model.sliding_layers:
        kinds.append(KvLayerType("sliding window", model.sliding_layers, per_layer, kv_dtype))
    wheel = wheels()[f"{eng}=={version}"].sha256
    args = (model, dev_name, dev, eng, version, rule_name, rule, tp, flags, per_layer, kinds, items, weights, wheel)
    return _vllm(*args, measured_graph) if eng == "vllm" else _sglang(*args)


def _int_flag(flags: dict, name: str, default: int, lo: int = 1, hi: int = 1 << 24) -> int:
    v = flags.get(name)
    if v is None:
        return default
    if not isinstance(v, int) or isinstance(v, bool) or not lo <= v <= hi:
        raise _refuse(
            name,
            f"--{name} must be an integer from {lo} to {hi}, got {v!r:.30}",
            f"give --{name} a value in that range",
        )
    return v


def _vllm(
    model, dev_name, dev, eng, version, rule_name, rule, tp, flags, per_layer, kinds, items, weights, wheel, measured
):
    total = dev.torch_total
    after = rule.kind == "vllm-after-capture"
    util = flags.get("gpu-memory-utilization")
    if util is None:
        util = rule.default_utilization
    if not isinstance(util, (int, float)) or not 0 < util <= 1:
        raise _refuse(
            "gpu-memory-utilization", f"must be in (0, 1], got {util!r:.30}", "e.g. --gpu-memory-utilization 0.9"
        )
    seqs0, tokens0 = sizing.vllm_batch_defaults(total, dev_name, rule.batch_tier_160)
    mml = _int_flag(flags, "max-model-len", model.max_positions or 0)
    if mml < 1:
        raise _refuse("max-model-len", "the config gives no max_position_embeddings", "give --max-model-len")
    seqs = _int_flag(flags, "max-num-seqs", seqs0)
    batched = _int_flag(flags, "max-num-batched-tokens", tokens0)
    block = _int_flag(flags, "block-size", 64 if model.mla else 16)
    mode = str(flags.get("cudagraph-mode") or "FULL_AND_PIECEWISE").upper()
    if mode not in _MODES:
        raise _refuse("cudagraph-mode", f"unknown mode {mode!r}", f"use one of {', '.join(_MODES)}")
    eager = bool(flags.get("enforce-eager"))
    given = flags.get("cudagraph-capture-sizes")
    top = flags.get("max-cudagraph-capture-size")
    sizes = (
        sorted(set(given))
        if given
        else sizing.vllm_default_sizes(
            seqs,
            batched,
            _int_flag(flags, "max-cudagraph-capture-size", 512) if top else None,
            rule.capture_appends,
        )
    )
    if eager or mode == "NONE":
        sizes = []
    settings = {
        "gpu-memory-utilization": util,
        "max-model-len": mml,
        "max-num-seqs": seqs,
        "max-num-batched-tokens": batched,
        "kv-cache-dtype": flags.get("kv-cache-dtype") or "auto",
        "block-size": block,
        "enforce-eager": eager,
        "cudagraph-mode": mode,
        "cudagraph-capture-sizes": ",".join(map(str, sizes)) or "none",
    }
    requested = sizing.vllm_requested(total, util)
    nt = estimate.non_torch(tp)
    act = estimate.activation_peak(model, tp, batched, seqs)
    ctx = estimate.context()
    init_free = total - _known(ctx)

    def graphs_of(ss: list[int]) -> int:
        full = (
            [s for s in ss if s <= seqs]
            if mode in ("FULL_AND_PIECEWISE", "FULL_DECODE_ONLY")
            else ss
            if mode == "FULL"
            else []
        )
        pieces = ss if mode in ("FULL_AND_PIECEWISE", "PIECEWISE") else []
        return len(full) + len(pieces)

    def graph_item(ss: list[int]) -> FitItem:
        return estimate.graph_memory(model, tp, dev.sm, graphs_of(ss), max(ss, default=0))

    def kv(graph: int) -> int:
        if after:
            return sizing.vllm_after_capture(
                rule, requested, init_free, _known(weights), _known(nt), _known(act), graph
            )
        deducted = graph if rule.graph_estimate == "deducted" else 0
        return sizing.vllm_before_capture(requested, _known(weights), _known(nt), _known(act), deducted)

    in_flight = batched * rule.in_flight_batches  # async scheduling (on by default): two batches in flight
    graph = measured if measured is not None and sizes else graph_item(sizes)
    budget = FitItem(
        "engine budget",
        requested,
        dev.torch_total_error,
        "rule",
        f"ceil(total x gpu-memory-utilization {util}) (vllm/v1/worker/utils.py: request_memory)",
    )
    items += [budget, weights, nt, act, graph]
    if after:
        items.insert(1, ctx)
    notes = []
    gbytes = graph.bytes
    if not after and rule.graph_estimate == "logged":
        notes.append(
            f"vllm {version} profiles and logs its graph estimate but does not take it from the KV budget "
            "(VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS off by default): graphs are captured into what "
            "gpu-memory-utilization leaves"
        )
    elif gbytes is None:
        notes.append("graph memory unknown: KV figures exclude it (an upper bound)")
    gbytes = gbytes or 0
    kv_bytes = kv(gbytes)
    err = sum(i.error_bytes or 0 for i in items[2:])
    items.append(FitItem("KV cache", max(kv_bytes, 0), err, "rule", "; ".join(rule.steps[-3:-1])))

    def tokens(avail: int) -> tuple[int, float, int]:
        return sizing.vllm_blocks(model, per_layer, block, avail, mml, in_flight, rule.kv_tokens)

    blocks, conc, kv_tokens = tokens(kv_bytes)
    costs = []
    none_tokens = tokens(kv(0))[2]
    sets = [("engine default", sizes), ("fewer", [s for s in sizes if s <= 64]), ("none", [])]
    for name, ss in sets:
        gi = graph_item(ss)
        t = None if gi.bytes is None else tokens(kv(gi.bytes))[2]
        costs.append(SizeCost(name, ss, gi.bytes, t, None if t is None else none_tokens - t))
    fits, overflow, fixes = True, "", []
    if kv_bytes <= 0 or conc < 1:
        fits = False
        need = math.ceil(mml / block) * block * per_layer * model.layers
        biggest = max((i for i in (weights, nt, act, graph) if i.bytes), key=lambda i: i.bytes or 0)
        overflow = (
            f"KV cache {max(kv_bytes, 0) / GiB:.2f} GiB holds {kv_tokens} tokens, fewer than one request of "
            f"max-model-len {mml} ({need / GiB:.2f} GiB); "
            f"the largest item is {biggest.name} ({_known(biggest) / GiB:.2f} GiB)"
        )
        fixes = _fixes(
            model,
            total,
            _known(weights),
            mml,
            kv_tokens,
            kind_bytes(kinds),
            ("max-model-len", "--kv-cache-dtype fp8"),
            tp,
        )
    return FitResult(
        FIT_SCHEMA_VERSION,
        eng,
        version,
        rule_name,
        wheel,
        dev_name,
        model.name,
        tp,
        settings,
        items,
        kinds,
        max(kv_bytes, 0),
        blocks,
        block,
        kv_tokens,
        round(conc, 2),
        mml,
        costs,
        fits,
        overflow,
        fixes,
        notes,
    )


def _fixes(
    m: FitModel, total: int, weights: int, mml: int, tokens: int, kv_dtype: int, flags: tuple, tp: int
) -> list[str]:
    """Fixes that work: where the weights alone leave no room, the smallest --tp whose
    shard leaves a quarter of the device; else a max-model-len the cache holds, fp8 KV
    where halving the element doubles the tokens past one request, and more GPUs."""
    len_flag, fp8 = flags
    n = tp
    while weights * tp / n > 0.75 * total and n < 64:
        n *= 2
    if n > tp:
        return [f"--tp {n}"]
    out = []
    if tokens >= 16:
        out.append(f"--{len_flag} {tokens // 16 * 16}")
    if kv_dtype == 2 and tokens * 2 >= mml:
        out.append(fp8)
    out.append(f"--tp {tp * 2}")
    return out


def _sglang(model, dev_name, dev, eng, version, rule_name, rule, tp, flags, per_layer, kinds, items, weights, wheel):
    if model.sliding_layers:
        raise InputError(
            f"SGLang's hybrid sliding-window pool split (swa_full_tokens_ratio) is not modelled; {model.name} has "
            f"{model.sliding_layers} sliding-window layers",
            where="--engine",
            fix="fit it with --engine vllm==0.34.0, or a model with full attention only",
        )
    gpu_mem = dev.smi_total_mib
    chunk0, bs0 = sizing.sglang_defaults(gpu_mem, tp)
    chunk = _int_flag(flags, "chunked-prefill-size", chunk0)
    running = flags.get("max-running-requests")
    max_bs = _int_flag(flags, "cuda-graph-max-bs", bs0)
    if flags.get("cuda-graph-max-bs") is None and running is not None:
        max_bs = min(max_bs, _int_flag(flags, "max-running-requests", 1))
    page = _int_flag(flags, "page-size", 1)
    ctx_len = _int_flag(flags, "context-length", model.max_positions or 0)
    if ctx_len < 1:
        raise _refuse("context-length", "the config gives no max_position_embeddings", "give --context-length")
    prefill = sizing.sglang_prefill_sizes(chunk)
    frac = flags.get("mem-fraction-static")
    if frac is None:
        frac = sizing.sglang_mem_fraction(gpu_mem, tp, chunk, max_bs, len(prefill), model.mla)
    if not isinstance(frac, (int, float)) or not 0 < frac < 1:
        raise _refuse("mem-fraction-static", f"must be in (0, 1), got {frac!r:.30}", "e.g. --mem-fraction-static 0.85")
    decode = sizing.sglang_decode_sizes(max_bs)
    settings = {
        "mem-fraction-static": frac,
        "context-length": ctx_len,
        "chunked-prefill-size": chunk,
        "cuda-graph-max-bs": max_bs,
        "page-size": page,
        "kv-cache-dtype": flags.get("kv-cache-dtype") or "auto",
        "cuda-graph-bs": ",".join(map(str, decode)),
    }
    ctx = estimate.context()
    pre = dev.torch_total - _known(ctx)
    nt = estimate.non_torch(tp)
    act = estimate.activation_peak(model, tp, chunk, max_bs)
    graph = estimate.graph_memory(model, tp, dev.sm, len(decode) + len(prefill), max(decode))
    budget = FitItem(
        "engine budget",
        int(pre * frac),
        dev.torch_total_error,
        "rule",
        f"free at start x mem-fraction-static {frac} (kv_cache_configurator._profile_available_bytes)",
    )
    items += [ctx, budget, weights, nt, act, graph]
    kv_bytes = sizing.sglang_kv_bytes(pre, _known(weights), _known(nt), frac)
    cell = per_layer * model.layers
    tokens = max(kv_bytes, 0) // cell // page * page
    items.append(
        FitItem("KV cache", max(kv_bytes, 0), sum(i.error_bytes or 0 for i in items[1:]), "rule", rule.steps[3])
    )
    slack = int(pre * (1 - frac))
    notes = ["SGLang sizes its pool from a static fraction: capture sizes cost no tokens, they must fit in the slack"]
    costs = [
        SizeCost("engine default", decode, graph.bytes, tokens, 0),
        SizeCost("none", [], 0, tokens, 0),
    ]
    fits, overflow, fixes = True, "", []
    if kv_bytes <= 0:
        fits = False
        overflow = f"weights {_known(weights) / GiB:.2f} GiB leave no KV cache under mem-fraction-static {frac}"
        fixes = _fixes(model, pre, _known(weights), ctx_len, 0, 0, ("context-length", ""), tp)
    elif graph.bytes is not None and graph.bytes + _known(act) + _known(nt) > slack:
        fits = False
        overflow = (
            f"graph memory {graph.bytes / GiB:.2f} GiB + activations {_known(act) / GiB:.2f} GiB exceed the "
            f"{slack / GiB:.2f} GiB mem-fraction-static {frac} leaves"
        )
        fixes = [f"--mem-fraction-static {round(frac - 0.05, 2)}", f"--cuda-graph-max-bs {max(1, max_bs // 2)}"]
    elif tokens < ctx_len:
        fits = False
        overflow = f"KV cache holds {tokens} tokens, fewer than one request of context-length {ctx_len}"
        fixes = _fixes(
            model,
            pre,
            _known(weights),
            ctx_len,
            tokens,
            kind_bytes(kinds),
            ("context-length", "--kv-cache-dtype fp8_e4m3"),
            tp,
        )
    return FitResult(
        FIT_SCHEMA_VERSION,
        eng,
        version,
        rule_name,
        wheel,
        dev_name,
        model.name,
        tp,
        settings,
        items,
        kinds,
        max(kv_bytes, 0),
        tokens // page,
        page,
        tokens,
        round(tokens / ctx_len, 2),
        ctx_len,
        costs,
        fits,
        overflow,
        fixes,
        notes,
    )
