"""The items no release rule gives: CUDA context, non-torch memory, activation peak, graph memory.

Each is estimated from the nearest measured item in planner/data (fit_estimates.toml,
devices.toml's per-node graph-exec and stream workspace figures, the committed graph-exec
bench's node counts) and returned as a :class:`FitItem` with its error bar; an item with
nothing measured near it (a device whose compute capability has no per-node figure, a
model type with no measured family) is ``unknown``: ``bytes`` None, never zero.
"""

from __future__ import annotations

import msgspec

from capture_plan.planner.inputs.resources import data
from capture_plan.schemas.fit import FitItem

from . import graph_pool
from .graph_count import GraphCount
from .graph_pool import Captures
from .model import FitModel, qkv_width
from .tables import GiB, MiB, SamplerRow, SamplerRule, estimates

__all__ = [
    "context",
    "non_torch",
    "activation_peak",
    "sampler_phase",
    "activation_per_token",
    "eagle_profile_peak",
    "argmax_temporaries",
    "moe_workspace",
    "moe_workspace_item",
    "graph_memory",
    "per_graph",
    "nodes_per_layer",
]


def context() -> FitItem:
    e = estimates()["cuda_context"]
    return FitItem("CUDA context", e["bytes"], e["error_bytes"], "estimated", e["source"])


def non_torch(tp: int, sm: str = "", first_stream: bool = False) -> FitItem:
    """Memory outside torch's allocator that the start-up takes after its first free-memory
    reading (fit_estimates.toml ``[non_torch]``, more for tp > 1); ``first_stream``: the
    release creates the process's first torch stream in that span (its rule's
    ``first_stream = "profile"``), whose stream pools' driver bytes (planner/data/devices.toml
    ``[first_torch_stream]``, measured) are added where ``sm`` has that figure, else said to
    be within the error bar."""
    e = estimates()["non_torch"]
    b, err, src = e["bytes"], e["error_bytes"], e["source"]
    if tp > 1:
        b, err = b + e["tp_bytes"], err + e["tp_error_bytes"]
    if first_stream:
        pools = data("devices.toml").get("first_torch_stream", {}).get(sm)
        if pools is None:
            src += f"; the process's first torch stream (its pools) not measured for {sm}: within the error bar"
        else:
            b += int(pools)
            src += f"; + the process's first torch stream (its pools: devices.toml [first_torch_stream] {sm})"
    return FitItem("non-torch memory", b, err, "estimated", src)


def activation_per_token(m: FitModel, tp: int, engine: str = "vllm") -> int:
    """Bytes one token holds on one rank at a decoder layer's peak, the largest of its phases
    as the engines' eager layer code allocates them (vllm==0.34.0
    model_executor/models/llama.py ``LlamaModel``, ``LlamaDecoderLayer``, ``LlamaAttention``,
    ``LlamaMLP``; kernels/vllm_c.py: ``fused_add_rms_norm`` in place, ``rms_norm`` and
    ``SiluAndMul`` into new outputs; SGLang 0.5.23's, where read, differ as said below), in
    multiples of the hidden size from ``[activation]`` of planner/data/fit_estimates.toml:

    * attention, at o_proj's output: the residual, the layer's input (normed in place; the
      model's loop still holds it), the merged qkv (alive until the attention module returns;
      a rank keeps at least one KV head), the attention's output (heads x v head dim) and
      o_proj's output, and at tp > 1 its reduced copy (vLLM's all-reduce is out of place);
    * MLP: the residual, the layer's input and the normed MLP input (o_proj's output), then
      the larger of the activation's point (gate_up, 2 x the rank's intermediate, and the
      activation's output) and down_proj's (the activation's output, down_proj's, its
      reduced copy at tp > 1, and gate_up where the MLP keeps it to the end: every MLP read
      but vLLM's llama.py and mistral.py, ``gate_up_dies_at_activation``). An MoE layer's
      MLP phase is its shared expert's (none: Mixtral's);
    * an MoE layer's routed experts, besides those three: vLLM's (``engine`` "vllm") write
      their caches into the fused-MoE workspace its manager keeps (:func:`moe_workspace`) and
      allocate the output, then the sum with a shared expert's output, then its reduced copy;
      SGLang's (srt/layers/moe/moe_runner/triton_utils/fused_moe.py ``fused_experts_impl``)
      allocate at each call cache1 (tokens x top-k x 2 x the rank's expert intermediate,
      kept to the end by its second name ``gemm1_out``), cache2 (half of it), cache3 (tokens
      x top-k x hidden) and, beside a shared expert's output, a new output (with none it
      writes the input in place).

    A model type in ``out_of_place_norms`` runs vLLM's norms on their native path (Gemma's
    weight + 1 in float32, which vllm_c's kernels do not take: ir/ops/layernorm.py), whose
    fused add-norm returns new tensors while the loop holds the old: one more hidden-sized
    tensor at the MLP phase, two at attention's (SGLang's Gemma norms work in place). The rest
    of a layer (norms' temporaries, the embedding, the rotary embedding, the router's logits
    and top-k) stays below them. SGLang's layers were read for their MLPs and fused MoE; its
    layer-boundary residual stages (srt/layers/layer_boundary) were not traced."""
    e = estimates()["activation"]
    h, d = m.hidden, m.dtype_bytes
    native = engine == "vllm" and m.model_type in e["out_of_place_norms"]
    # vLLM's tensor-parallel all-reduce is out of place (distributed/parallel_state.py
    # GroupCoordinator.all_reduce): o_proj's and down_proj's unreduced outputs live beside
    # the reduced ones
    reduced = h if tp > 1 else 0
    qkv = qkv_width(m, tp)
    attention = (e["attention_hidden"] + 2 * native) * h + qkv + m.heads * m.v_head_dim // tp + reduced
    base = (e["mlp_hidden"] + native) * h
    inter = (m.shared_expert_intermediate if m.experts else m.intermediate) // tp
    # at the activation: gate_up and its output; at down_proj: its output (and the reduced
    # one) beside the activation's, and gate_up where the MLP keeps it to the end
    keeps = engine == "sglang" or m.model_type not in e["gate_up_dies_at_activation"]
    mlp = base + max(3 * inter, (2 * keeps + 1) * inter + h + reduced) if inter else 0
    routed = 0
    if m.experts:
        shared = 1 if m.shared_expert_intermediate else 0
        if engine == "sglang":
            # fused_experts_impl writes in place where the layer has no shared expert
            # (FusedMoE inplace=True by default; Qwen2-MoE passes inplace=False)
            n = 2 * m.expert_intermediate // tp
            routed = base + 2 * shared * h + m.experts_per_token * (n + n // 2 + h)
        else:  # the output, then the sum's beside both, then the reduced sum
            routed = base + (1 + 2 * shared) * h + reduced
    return d * max(attention, mlp, routed)


def moe_workspace(m: FitModel, tp: int, tokens: int) -> int:
    """The fused-MoE layer's workspace for ``tokens``: kept by the engine after the profiling
    run's forward, so it adds to the sampler's peak (0 for a dense model).

    vLLM 0.19.0 vllm/model_executor/layers/fused_moe/modular_kernel.py: _allocate_buffers
    takes workspace13 (sized for the output too) and workspace2 from the persistent
    current_workspace_manager() (vllm/v1/worker/workspace.py), unchunked (M_full); their
    shapes are TritonExperts.workspace_shapes (fused_moe.py): (M, topk, max(N / 2, K)) and
    (M, topk, max(N, K)), output (M, K), N = w1's rows (2 x the rank's expert
    intermediate), K = hidden, in the activation dtype."""
    if not m.experts:
        return 0
    n = 2 * m.expert_intermediate // tp
    ws13 = max(tokens * m.experts_per_token * max(n // 2, m.hidden), tokens * m.hidden)
    ws2 = tokens * m.experts_per_token * max(n, m.hidden)
    return m.dtype_bytes * (ws13 + ws2)


_ENGINES = {"vllm": "vLLM", "sglang": "SGLang"}


def sampler_phase(m: FitModel, tp: int, tokens: int, rows: int, r: SamplerRule) -> tuple[int, int | None]:
    """The profiling run's peak while its dummy sampler runs over ``rows`` requests after a
    forward of ``tokens``, as rule ``r`` counts it (planner/data/fit_rules.toml [sampler], each
    step's file and function in its ``sources``): the forward's hidden states and the sampled
    rows held, then the larger of the logits' gather (tp > 1: the shard, the all-gathered
    padded vocabulary and its reshaped copy) and the second pass (the model-dtype logits over the
    padded vocabulary, ``fp32_copies`` float32 copies, Gumbel-max's per-block scratch). Returns
    that figure and the one where FlashInfer's sampler runs instead (None: not read)."""
    d, v = m.dtype_bytes, m.vocab
    padded = r.padded_vocab(v)
    held = tokens * m.hidden * d + r.sampled_hidden_copies * rows * m.hidden * d
    logits = rows * padded * d
    gather = rows * d * (padded // tp + r.gather_copies * padded) if tp > 1 and r.gather_copies else logits
    scratch = rows * r.sample_blocks(v) * (8 + 4)
    default = held + max(gather, logits + r.fp32_copies * rows * v * 4 + scratch)
    if r.flashinfer_fp32_copies is None:
        return default, None
    return default, held + max(gather, logits + r.flashinfer_fp32_copies * rows * v * 4)


def moe_workspace_item(m: FitModel, tp: int, tokens: int) -> FitItem | None:
    """vLLM's fused-MoE workspace after its profiling run's forward of ``tokens``
    (:func:`moe_workspace`): its workspace manager keeps it, so it is persistent memory the
    release's profile counts (total_consumed), not its transient peak; None for a dense model."""
    b = moe_workspace(m, tp, tokens)
    if not b:
        return None
    e = estimates()["activation"]
    return FitItem(
        "MoE workspace",
        b,
        int(b * e["error_fraction"]),
        "estimated",
        f"vLLM's fused-MoE workspace at {tokens} tokens, kept by its workspace manager (vllm/v1/worker/workspace.py; "
        "fused_moe/modular_kernel.py _allocate_buffers, TritonExperts.workspace_shapes): planner/fit/estimate.py "
        "moe_workspace; another experts kernel asks for other shapes, in the error bar",
    )


def activation_peak(
    m: FitModel,
    tp: int,
    tokens: int,
    seqs: int,
    sampler: SamplerRow,
    workspace_held: bool = False,
    engine: str = "vllm",
    kept: int = 0,
    draft: tuple[int, str] | None = None,
) -> FitItem:
    """The profiling run's transient torch peak (vLLM's profile_run): ``tokens`` through the
    layers, then (``draft``: its peak's bytes and what it is, :func:`eagle_profile_peak`) the
    speculator's dummy propose, then the dummy sampler over min(``seqs``, ``tokens``) requests
    while the forward's hidden states are still held (:func:`sampler_phase`, the release's row
    ``sampler``), each on top of the MoE workspace the forward allocates; ``workspace_held``: the engine keeps that
    workspace (vLLM's workspace manager), so the transient peak over what stays allocated does
    not hold it (:func:`moe_workspace_item` counts it); ``engine`` "sglang": the layers are
    SGLang's, whose MoE layers allocate their caches at each call and free them, a phase of
    the layer (:func:`activation_per_token`), no workspace after it; ``kept``: bytes the dummy
    sampler makes and keeps after the forward (:func:`.buffers.made_by_profile`), which the
    headroom over what stays allocated does not hold beside the forward's peak. Where the
    row reads FlashInfer's sampler, which runs or not by the host's installation (fit cannot
    know), the central figure is the branch the release's stock install runs
    (``SamplerRule.branch``) and the error bar holds the other's difference."""
    e = estimates()["activation"]
    per_call = engine == "sglang"
    workspace = 0 if workspace_held or per_call else moe_workspace(m, tp, tokens)
    layer = max(tokens * activation_per_token(m, tp, engine) - kept, 0)
    triton, flashinfer = sampler_phase(m, tp, tokens, min(seqs, tokens), sampler.rule)
    central = sampler.rule.branch(sampler.version)
    phase, other = (flashinfer, triton) if central == "flashinfer" and flashinfer is not None else (triton, flashinfer)
    drafted = max((draft[0] if draft else 0) - kept, 0)
    b = workspace + max(layer, phase, drafted)
    err = int(b * e["error_fraction"])
    name, engine = sampler.name, _ENGINES.get(sampler.rule.engine, sampler.rule.engine)
    read = "" if sampler.read else f", {sampler.version} not read for it"
    source = (
        f"{engine} {sampler.version}'s profile_run, counted: planner/fit/estimate.py activation_peak, "
        f"the sampler as fit_rules.toml [sampler.{name}]{read} (not measured on an engine)"
    )
    if central == "flashinfer":
        source += f"; FlashInfer's sampler, which {sampler.version}'s stock install runs"
    if workspace_held and m.experts:
        source += "; the fused-MoE workspace, which the engine keeps, is an item of its own"
    if per_call and m.experts:
        source += "; the MoE layers' caches, allocated per call, in the layer's phase"
    if draft:
        top = "its peak" if drafted > max(layer, phase) else "below the target's"
        source += f"; the draft's dummy propose ({draft[1]}): {drafted / MiB:.1f} MiB, {top}"
    if kept and max(layer, drafted) >= phase:
        source += f"; the forward's peak less the sampler's kept scratch ({kept / MiB:.1f} MiB, made after it)"
    if other is not None and workspace + max(layer, other, drafted) != b:
        more = workspace + max(layer, other, drafted) - b
        err = max(err, abs(more))
        where = (
            "the Triton branch, where FlashInfer's does not run"
            if central == "flashinfer"
            else "FlashInfer's sampler, where the host runs it"
        )
        source += f"; {where}, {abs(more) / GiB:.2f} GiB {'more' if more > 0 else 'less'}: in the error bar"
    return FitItem("activation peak", b, err, "estimated", source)


def eagle_profile_peak(head: FitModel, target: FitModel, tp: int, tokens: int, reqs: int, argmax_block: int) -> int:
    """The transient peak of vLLM's dummy propose of an EAGLE head in the profiling run
    (gpu/model_runner.py ``_dummy_run``: ``speculator.propose`` after the target's forward,
    eagerly, while the target's hidden states are held; target_dependent_ar/speculator.py
    ``_prefill`` over all ``tokens`` with ``reqs`` sampled rows), the larger of two points:

    * the head's layer: ``tokens`` x :func:`activation_per_token` of the head, less one hidden
      state a token (its first layer's input norm is an identity, so its input is its residual:
      llama_eagle.py), plus the target's hidden states and the head's embedding (alive to the
      forward's return);
    * its sampling: the target's hidden states, the head's output, the gathered rows, the
      model-dtype logits over the target's vocabulary and the greedy argmax's result and
      partials (``argmax_block``: planner/memory/analytic.py eagle_draft_program).

    Its draft decode steps (one token a request) hold less at the profile's sizes and are not
    counted; nor is Inductor's code for the head (vLLM compiles it): the eager layer is priced."""
    d, h = head.dtype_bytes, head.hidden
    row = tokens * h * d
    # the head's layers are the engine's llama_eagle.py ones (llama.py's decoder layer, gate_up
    # dying at the activation) whatever its spec says: the project's reference spec's own
    # layer code keeps gate_up, the engine's EAGLE head does not
    code = msgspec.structs.replace(head, model_type="llama") if head.model_type == "reference" else head
    layer = tokens * activation_per_token(code, tp) - row + 2 * row
    padded = graph_pool.padded_vocab(target)
    vocab = reqs * padded * d  # the gathered rows on every rank (a rank's shard beside them at tp > 1)
    shard = reqs * padded // tp * d if tp > 1 else 0
    sampling = 2 * row + reqs * h * d + vocab + shard + reqs * 8 + argmax_temporaries(reqs, padded, d, argmax_block)
    return max(layer, sampling)


def argmax_temporaries(rows: int, vocab: int, dtype_bytes: int, block: int) -> int:
    """Bytes a draft's greedy argmax holds beside the logits and its int64 result: with
    ``block`` (0.34.0's greedy_argmax) its float32 and int32 partials [rows, ceil(vocab /
    block)], or, under ``block`` columns, its fallback's NaN mask and masked copy
    (``logits.masked_fill(logits.isnan(), -inf)``); 0: torch's argmax, none."""
    if not block:
        return 0
    if vocab < block:
        return rows * vocab * (1 + dtype_bytes)
    return rows * -(-vocab // block) * 8


def nodes_per_layer(m: FitModel) -> float | None:
    """Graph nodes per layer of one graph of this model's family (None: no family measured)."""
    from capture_plan.planner.memory.graph_nodes import nodes_per_layer as per_layer

    return per_layer(m.model_type)


def per_graph(sm: str) -> tuple[int | None, float | None]:
    """The driver bytes one graph exec takes apart from its nodes on ``sm``
    (planner/data/devices.toml ``[graph_exec_per_graph]``; None: not measured), and the
    per-node figure to go with it: ``[graph_exec_per_node]`` less the per-graph bytes it
    absorbed, since it was the instantiations' bytes over their nodes on the graphs
    ``[graph_exec_per_node_basis]`` names (None: no per-node figure)."""
    devs = data("devices.toml")
    node = devs.get("graph_exec_per_node", {}).get(sm)
    graph = devs.get("graph_exec_per_graph", {}).get(sm)
    if node is None or graph is None:
        return graph, node
    basis = devs["graph_exec_per_node_basis"][sm]
    return int(graph), node - graph * basis["graphs"] / basis["nodes"]


def graph_memory(
    m: FitModel,
    tp: int,
    sm: str,
    graphs: GraphCount,
    captures: Captures,
    pool: tuple[int, str] | None = None,
    transient: tuple[int, str] | None = None,
) -> FitItem:
    """Graph memory as one figure: graph-exec (``graphs.whole`` graphs' nodes x the device's
    per-node figure, + ``graphs.execs`` x its per-graph figure where one is measured; a draft's
    graphs in ``captures`` likewise, its layers' nodes counted as the target family's) + the
    pool (the engine's ``captures`` simulated in one pool, :func:`.graph_pool.pool_bytes`; or
    ``pool``'s bytes, a plan's predicted pool, and where they come from) + each capture
    stream's cuBLAS workspace; ``transient``: bytes an engine's kernels or its capture
    allocate besides the forward's activations (the engine's layer counts them), and what
    they are: added to a plan's pool too, where the caller found the plan's backend to be
    the one whose kernels allocate them (its simulation holds no such temporaries). Without a
    per-graph figure the execs are priced by their nodes only and the
    source says so: an engine's thousands of piecewise graphs may then cost more. The
    process's first torch stream (torch's stream pools) is not here: every release read makes
    it before its capture (:func:`non_torch`)."""
    if graphs.execs == 0 and captures.draft is None:
        return FitItem("graph memory", 0, 0, "exact", "no CUDA graphs captured")
    devs = data("devices.toml")
    exec_graph, per_node = per_graph(sm)
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
    # a draft's graphs: its layers' nodes (the target family's count a layer), one exec each
    dr = captures.draft
    exec_bytes, n_execs, how = int(graphs.whole * per_layer * m.layers * per_node), graphs.execs, graphs.how
    if dr is not None:
        exec_bytes += int(dr.layer_runs * per_layer * per_node)
        n_execs += dr.execs
        how += f" + {dr.how}, {dr.layer_runs} of its layers in all"
    if exec_graph is None:
        execs = (
            f"{how}, priced by their nodes only: the per-graph cost is not measured for {sm} "
            "(planner/data/devices.toml [graph_exec_per_graph]; bench/graph_exec_bench.py --overhead)"
        )
    else:
        exec_bytes += n_execs * exec_graph
        execs = f"{how} x {exec_graph} B per graph (planner/data/devices.toml [graph_exec_per_graph])"
    # each capture stream keeps its cuBLAS workspace (a draft's managers capture on streams of their own)
    streams = max(1, captures.streams)
    ws = int(workspace) * streams
    extra, why = transient if transient else (0, "")
    plus = f" + {why}" if extra else ""
    if pool is None:
        pooled, pool_how = graph_pool.pool_bytes(m, tp, sm, captures)
        b = exec_bytes + pooled + extra + ws
        on = f"; {streams} capture streams' cuBLAS workspaces" if streams > 1 else ""
        return FitItem(
            "graph memory",
            b,
            int(b * g["error_fraction"]),
            "estimated",
            f"{g['source']}; {pool_how}{plus}; {execs}{on}",
        )
    # the plan's pool is the allocator's simulation of its graphs: the estimate's error bar
    # is graph-exec's, the workspace's and the engine's kernels' transient bytes (which the
    # plan's simulation does not hold: the caller passes them only for the plan's backend)
    b = exec_bytes + pool[0] + extra + ws
    err = int((exec_bytes + extra + ws) * g["error_fraction"])
    return FitItem(
        "graph memory", b, err, "estimated", f"the pool: {pool[1]}{plus}; graph-exec: {g['exec_source']}; {execs}"
    )
