"""vLLM's graphs in the plan's terms: the plan phase of each descriptor, the managers
``capture_model`` runs, every graph the runner will capture as :class:`~.core.EngineKey`,
and what the plugin does not route (:mod:`.vllm` names them in its docstring). Imports
neither torch nor vLLM: it reads the objects it is handed.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from capture_plan.adapters.plugins import core

ENGINE = "vllm"
#: how vLLM orders its captures (the refusal of a plan it cannot follow)
ORDER = "vLLM captures the model's graphs, then each speculator manager's; in each, PIECEWISE, then FULL"
_MODES = {"PIECEWISE": 0, "FULL": 1}


def _name(mode) -> str:
    return str(getattr(mode, "name", mode))


def phase_of(desc, prefix: str = "", parent=None) -> str:
    """The plan phase of a descriptor (module docstring), ``prefix`` the manager's. A
    micro-batch twin is named for ``parent``, the FULL descriptor it is the twin of
    (:func:`twin_parents`): ``_maybe_ubatch_twin`` sets a twin's ``uniform_token_count``,
    so a mixed graph's twin would otherwise read as a uniform-decode one."""
    if parent is not None and desc.num_ubatches > 1:
        return phase_of(parent, prefix) + "_ubatch"
    mode = _name(desc.cg_mode)
    if mode == "PIECEWISE":
        routine = "piecewise"
    elif desc.uniform_token_count is not None or desc.max_query_len is not None:
        routine = "full_decode"
    else:
        routine = "full_mixed"
    return prefix + routine + ("_ubatch" if desc.num_ubatches > 1 else "")


def twin_parents(descs) -> dict:
    """twin -> the descriptor it is the micro-batch twin of, in one mode's list of
    ``_capture_descs``: ``_init_candidates`` appends a twin right after its descriptor and
    sorts by tokens only (stably), so its parent is the nearest descriptor before it with
    one micro-batch, its tokens and its LoRA count."""
    out, last = {}, {}
    for d in descs:
        key = (d.num_tokens, d.num_active_loras)
        if d.num_ubatches == 1:
            last[key] = d
        elif key in last:
            out[d] = last[key]
    return out


def labels_of(desc) -> tuple[tuple[str, str], ...]:
    """A descriptor's labels: ``loras``, its LoRA count (where the plan's phase declares
    the axis, or it is not 0: :func:`engine_keys`)."""
    return (("loras", str(desc.num_active_loras)),)


def managers(runner, manager_cls) -> list[tuple[str, Any]]:
    """(phase prefix, manager) of every manager ``capture_model`` runs, in its order: the
    runner's, then the speculator's ``CudaGraphManager`` attributes (as vLLM's
    ``profile_cudagraph_memory`` finds them: ``prefill_cudagraph_manager`` ->
    ``draft_prefill_``, ``cudagraph_manager`` -> ``draft_``), less the draft decode
    manager of a speculator with one speculative step (vLLM does not capture it)."""
    out = [("", runner.cudagraph_manager)] if runner.cudagraph_manager is not None else []
    speculator = getattr(runner, "speculator", None)
    if speculator is not None:
        # TargetDependentARSpeculator.capture returns before the draft decode manager's
        # capture with one speculative step: its graphs are never captured
        one_step = getattr(speculator, "num_speculative_steps", None) == 1
        for name, value in vars(speculator).items():
            if one_step and name == "decode_cudagraph_manager":
                continue
            if isinstance(value, manager_cls):
                role = name.removesuffix("cudagraph_manager").strip("_")
                out.append((f"draft_{role}_" if role else "draft_", value))
    return out


def engine_keys(runner, manager_cls) -> tuple[core.EngineKey, ...]:
    """Every graph the runner's managers will capture, in the plan's terms (``loras=0``
    a default: a plan without LoRA axes matches an engine without LoRA)."""
    keys = []
    for m, (prefix, manager) in enumerate(managers(runner, manager_cls)):
        for mode, descs in manager._capture_descs.items():
            parents = twin_parents(descs)
            for desc in descs:
                rank = (m, _MODES.get(_name(mode), 2))
                keys.append(
                    core.EngineKey(
                        phase_of(desc, prefix, parents.get(desc)),
                        desc.num_tokens,
                        labels_of(desc),
                        core.key_fields_of(ENGINE, desc),
                        rank,
                        defaults=(("loras", "0"),),
                        native=(manager, desc),
                    )
                )
    return tuple(keys)


def facts_of(vllm_config, keys: tuple[core.EngineKey, ...] = ()) -> core.EngineFacts:
    """TP size and the model's config.json from vLLM's config; the graphs it will capture."""
    tp = getattr(getattr(vllm_config, "parallel_config", None), "tensor_parallel_size", 1) or 1
    model = getattr(getattr(vllm_config, "model_config", None), "model", None)
    config = Path(model) / "config.json" if isinstance(model, str) and Path(model).is_dir() else None
    return core.EngineFacts(ENGINE, tp=int(tp), model_config=config, keys=keys, order=ORDER)


def _unroutable(runner, manager_cls) -> str | None:
    """What the plugin does not route, by the runner's settings (None: everything);
    each known before the first graph."""
    config = runner.vllm_config
    if getattr(config, "use_cumem_cudagraph_pool", False):
        return "sleep mode records graphs into its cuMem pool, not the plan's"
    pp = getattr(getattr(config, "parallel_config", None), "pipeline_parallel_size", 1) or 1
    if int(pp) > 1:  # ModelCudaGraphManager: a non-last rank keeps intermediate_tensors, hidden_states stays None
        return (
            f"pipeline parallelism (pipeline_parallel_size={pp}): a rank before the last returns intermediate "
            "tensors from its graphs, not the hidden states the plan's steps hold"
        )
    for prefix, manager in managers(runner, manager_cls):
        if getattr(manager, "use_breakable_cg", False):
            return f"the {prefix or 'model'} manager records breakable PIECEWISE graphs (VLLM_USE_BREAKABLE_CUDAGRAPH)"
    speculator = getattr(runner, "speculator", None)
    spec_config = getattr(speculator, "speculative_config", None)
    dynamic = getattr(spec_config, "uses_dynamic_speculative_decoding", None)
    # TargetDependentARSpeculator.capture passes specialize_spec_tokens=this to the draft
    # decode manager, which then makes a graph per speculative token count inside its capture
    if getattr(speculator, "supports_decode_metadata_update", False) and callable(dynamic) and dynamic():
        return (
            "dynamic speculative decoding (num_speculative_tokens_per_batch_size) makes the draft decode "
            "graphs per speculative token count inside their capture, after the plugin checked the keys"
        )
    return None
