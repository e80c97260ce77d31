"""Nodes per layer of one CUDA graph, estimated from the committed graph-exec bench: the one
owner of that estimate (``planner fit``'s graph memory and a plan built with
``planner build --device NAME`` read it).

The bench (bench/results/graph-exec-2026-12-01.json, named in planner/data/fit_estimates.toml
``[graph]``) captured one decode graph of each model family at bs 256 and counted its nodes;
a family's nodes per layer are those over its bench model's layers (``[graph.layers]``: the
reference's 32, the transformers cases' 4 to 8), and a model's nodes per graph are its
family's per layer times its layers. The count hardly
moves with the batch size (a kernel that changes with the size changes it by a few nodes), so
one figure serves every size. A family the bench did not measure has no estimate (None):
the caller says "unknown", never 0.
"""

from __future__ import annotations

from ..inputs.resources import data

__all__ = ["nodes_per_layer", "REFERENCE", "BENCH"]

#: the family of capture-plan's reference decode step (capture_plan.references), which a
#: plan's analytic figures describe
REFERENCE = "reference"


def _graph() -> dict:
    return data("fit_estimates.toml")["graph"]


#: where the node counts come from
BENCH: str = "nodes per layer from the graph-exec bench (planner/data/fit_estimates.toml [graph])"


def nodes_per_layer(model_type: str) -> float | None:
    """Graph nodes per layer of one graph of ``model_type``'s family (a config.json's
    ``model_type``, ``preset``, or :data:`REFERENCE`); None where no family was measured."""
    g = _graph()
    fam = g["families"].get(model_type)
    nodes = g["nodes"].get(fam) if fam else None
    return None if nodes is None else nodes / g["layers"][fam]


def device_estimate(device: str, layers: dict[str, int], model_type: str = REFERENCE):
    """What ``planner build --device NAME`` counts for a device without a calibration: a
    :class:`~capture_plan.planner.memory.device.Calibration` marked ``estimated`` whose graphs'
    nodes are ``model_type``'s nodes per layer times each phase's ``layers`` (phase -> its
    layers), for the device's compute capability (planner/data/fit_devices.toml). It measures
    nothing: allocator-other stays unknown, and graph-exec is unknown where the capability has
    no per-node figure (planner/data/devices.toml [graph_exec_per_node]) or none is listed (a
    device the roofline table alone names). ``device``: as ``--device`` names it
    (:func:`capture_plan.planner.inputs.devices.device_name`, which refuses a name no table knows)."""
    from ..inputs.devices import capability, device_name
    from .device import Calibration

    key = device_name(device)
    per_layer = nodes_per_layer(model_type)
    sm = capability(key) or "its compute capability unlisted"  # a roofline-only device: graph-exec unknown
    nodes = {} if per_layer is None else {p: {1: round(per_layer * n)} for p, n in layers.items()}
    return Calibration(
        device=f"{key} {sm} (estimated: no calibration)",
        capability=sm,
        allocator_other=None,
        source=f"--device {key}: {BENCH}, {model_type} family",
        graph_nodes=nodes,
        estimated=True,
    )
