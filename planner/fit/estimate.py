"""The items no release rule gives: CUDA context, non-torch memory, activation peak, graph memory.

Each is estimated from the nearest measured item in planner/data (fit_estimates.toml,
devices.toml's per-node graph-exec and stream workspace figures, the committed graph-exec
bench's node counts) and returned as a :class:`FitItem` with its error bar; an item with
nothing measured near it (a device whose compute capability has no per-node figure, a
model type with no measured family) is ``unknown``: ``bytes`` None, never zero.
"""

from __future__ import annotations

from capture_plan.planner.inputs.resources import data
from capture_plan.schemas.fit import FitItem

from .model import FitModel
from .tables import estimates

__all__ = ["context", "non_torch", "activation_peak", "activation_per_token", "graph_memory", "nodes_per_layer"]


def context() -> FitItem:
    e = estimates()["cuda_context"]
    return FitItem("CUDA context", e["bytes"], e["error_bytes"], "estimated", e["source"])


def non_torch(tp: int) -> FitItem:
    e = estimates()["non_torch"]
    b, err = e["bytes"], e["error_bytes"]
    if tp > 1:
        b, err = b + e["tp_bytes"], err + e["tp_error_bytes"]
    return FitItem("non-torch memory", b, err, "estimated", e["source"])


def activation_per_token(m: FitModel, tp: int) -> int:
    """Bytes of the live tensors one token holds at a layer's peak on one rank."""
    e = estimates()["activation"]
    d = m.dtype_bytes
    # MLA too: its prefill up-projects q, k and v to heads x head_dim (nope + rope), kv_heads = heads
    qkv = (m.heads + 2 * m.kv_heads) * m.head_dim // tp
    if m.experts:
        mlp = m.experts_per_token * (3 * m.expert_intermediate + m.hidden) // max(1, tp)
    else:
        mlp = 3 * m.intermediate // tp  # gate_up (2I) and its activation (I)
    return d * (e["hidden_copies"] * m.hidden + qkv + mlp)


def activation_peak(m: FitModel, tp: int, tokens: int, seqs: int) -> FitItem:
    """The profiling run's transient torch peak: ``tokens`` through the layers, then the
    dummy sampler's float32 logits over ``seqs`` requests (vLLM's profile_run)."""
    e = estimates()["activation"]
    layer = tokens * activation_per_token(m, tp)
    sampler = min(seqs, tokens) * (m.vocab // tp if tp > 1 else m.vocab) * 4 * e["sampler_copies"]
    b = max(layer, sampler)
    return FitItem("activation peak", b, int(b * e["error_fraction"]), "estimated", e["source"])


def nodes_per_layer(m: FitModel) -> float | None:
    """Graph nodes per layer of one graph of this model's family (None: no family measured)."""
    from capture_plan.planner.memory.graph_nodes import nodes_per_layer as per_layer

    return per_layer(m.model_type)


def graph_memory(
    m: FitModel, tp: int, sm: str, graphs: int, largest: int, pool: tuple[int, str] | None = None
) -> FitItem:
    """Graph memory as one figure: graph-exec (nodes x the device's per-node figure) + the
    pool (the largest size's activations, which every smaller graph reuses; or ``pool``'s
    bytes, a plan's predicted pool, and where they come from) + the capture stream's cuBLAS
    workspace. ``graphs``: whole-model graphs captured (a piecewise size's pieces count as
    one: their nodes add up to about one graph's)."""
    if graphs == 0:
        return FitItem("graph memory", 0, 0, "exact", "no CUDA graphs captured")
    devs = data("devices.toml")
    per_node = devs.get("graph_exec_per_node", {}).get(sm)
    workspace = devs.get("stream_workspace", {}).get(sm)
    per_layer = nodes_per_layer(m)
    g = estimates()["graph"]
    if per_node is None or workspace is None or per_layer is None:
        missing = (
            f"no per-node graph-exec figure for {sm} (planner/data/devices.toml)"
            if per_node is None or workspace is None
            else f"no measured node count for model type {m.model_type}"
        )
        return FitItem("graph memory", None, None, "unknown", missing)
    exec_bytes = int(graphs * per_layer * m.layers * per_node)
    if pool is None:
        b = exec_bytes + largest * activation_per_token(m, tp) + int(workspace)
        return FitItem("graph memory", b, int(b * g["error_fraction"]), "estimated", g["source"])
    # the plan's pool is the allocator's simulation of its graphs: the estimate's error bar
    # is graph-exec's and the workspace's
    b = exec_bytes + pool[0] + int(workspace)
    err = int((exec_bytes + int(workspace)) * g["error_fraction"])
    return FitItem("graph memory", b, err, "estimated", f"the pool: {pool[1]}; graph-exec: {g['exec_source']}")
