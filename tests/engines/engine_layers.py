"""The profiling run's forward as the engines' eager decoder layers make it, over a
transformers model's own weights or the reference decode step's: what the runners' dummy
runs run, so that the activation peak they measure is the engine's layer code's, not
transformers'. vLLM 0.34.0's code by default; SGLang 0.5.23's where it differs
(:func:`code_of`).

Followed (vllm==0.34.0, the eager path with its CUDA kernels; the profiling run skips
attention: its backends, given no metadata, fill their output with zeros):

* ``model_executor/models/llama.py`` (Qwen2's ``qwen2.py`` has the same layer and attention,
  with q/k/v biases):
  ``LlamaModel.forward`` (the embedding; ``residual = None`` before the first layer; the
  final ``norm(hidden_states, residual)``), ``LlamaDecoderLayer.forward`` (the first layer
  keeps the embedding as its residual and norms into a new tensor; later ones add and norm
  in place), ``LlamaAttention.forward`` (one ``qkv_proj`` output split into views; the rotary
  embedding in place; the attention's output; ``o_proj``; q/k/v live until it returns),
  ``LlamaMLP.forward`` (``gate_up_proj``'s output, then ``SiluAndMul``'s new output, then
  ``down_proj``; the name ``x`` rebinds, so gate_up dies at the activation's return).
* ``model_executor/models/gemma2.py`` ``Gemma2Model.embed_input_ids`` (embedding times the
  normalizer: a new tensor) and ``Gemma2DecoderLayer.forward`` (four norms; the post-attention
  and post-feedforward norms without residual make new tensors); ``GeluAndMul`` (tanh).
* ``kernels/vllm_c.py``: ``rms_norm`` writes a new output, ``fused_add_rms_norm`` works in
  place (``inplace=True``) where input and weight share a dtype; Gemma's norms pass
  ``weight.float() + 1`` (``layers/layernorm.py GemmaRMSNorm.forward_native``), which that
  implementation does not take, so they run ``ir/ops/layernorm.py``'s native functions: float32
  temporaries, new outputs (copied here step by step: :func:`_native_rms_norm`). SGLang's
  (0.5.23 srt/layers/layernorm.py ``GemmaRMSNorm._forward_impl``) work in place.
* The MLPs: ``LlamaMLP.forward`` (llama.py, mistral.py) rebinds ``x``, so gate_up dies at the
  activation's return; qwen2.py, gemma2.py and qwen2_moe.py name it ``gate_up`` and keep it
  to their return, beside down_proj's output; SGLang 0.5.23's keep it in every model read
  (:func:`code_of`).
* ``layers/attention``: the layer allocates its output (tokens x heads x head_dim) and the
  backend fills it with zeros.

* MoE layers (Mixtral, Qwen2-MoE): ``models/mixtral.py`` and ``models/qwen2_moe.py``
  ``*SparseMoeBlock.forward`` (the router's logits, then the experts); ``layers/fused_moe``:
  ``runner/moe_runner.py`` (a shared expert first, ``Qwen2MoeMLP.forward`` with its sigmoid
  gate, then the routed experts, then ``shared_output + fused_output``, a new tensor),
  ``fused_topk`` (float32 weights, int32 ids and token-expert indices), ``modular_kernel.py``
  ``FusedMoEKernelModularImpl.apply`` (the output, a new tensor) and ``_allocate_buffers``
  (workspace13 and workspace2 from the workspace manager, which keeps them), and
  ``TritonExperts.apply`` (cache1 in workspace2, cache2 in workspace13, cache3 in
  workspace2 again, the routing weights applied by the second GEMM, ``moe_sum`` into the
  output). SGLang 0.5.23 (``srt/layers/moe/moe_runner/triton_utils/fused_moe.py``
  ``fused_experts_impl``) allocates its caches per call instead: cache1 (kept alive to the
  end by its second name ``gemm1_out``), cache2, cache3 (:class:`Workspace`), and a new
  output only beside a shared expert (``FusedMoE(inplace=True)`` by default writes the input).
* The reference decode step (references/decode.py): ``LlamaDecoderLayer.forward`` over its
  merged ``wqkv`` and ``wgu`` (:func:`reference_forward`), its MLP keeping gate_up as its own
  code does, o_proj's and down_proj's outputs all-reduced out of place at tp > 1 (vLLM's
  ``GroupCoordinator.all_reduce``).

Stand-ins, and why they are exact for memory: a fused kernel that allocates nothing but its
output (``rms_norm``, ``fused_add_rms_norm``, ``SiluAndMul``) is computed here in row
chunks of :data:`ROWS` into that output, so its temporaries are tens of KiB; the projections
of q/k/v (and gate/up) are one output buffer written by one GEMM per weight into contiguous
slices of its transpose (no concatenated weight: the weights stay the model's); the
rotary embedding is not applied (in place in the engine, it allocates nothing, and the
profile's attention reads nothing); the fused MoE's GEMMs are one per expert over chunks of
its rows, written into the caches (their gathers are chunk-sized), and ``moe_align_block_size``'s
index buffers (tens of KiB) are left out.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

#: rows a stand-in of a fused kernel computes at a time (its temporaries: a few MiB at most)
ROWS = 64

#: transformers model types whose decoder layer this file follows (vLLM's class for each)
TYPES = {
    "llama": "LlamaDecoderLayer",
    "qwen2": "Qwen2DecoderLayer",
    "gemma2": "Gemma2DecoderLayer",
    "mixtral": "MixtralDecoderLayer",
    "qwen2_moe": "Qwen2MoeDecoderLayer",
}


class Code(NamedTuple):
    """Where the engines' layer code allocates differently (:func:`code_of`)."""

    #: Gemma's norms take vLLM's native path: new tensors, float32 temporaries
    native_norms: bool
    #: the MLP keeps gate_up to its return, beside down_proj's output
    keeps_gate_up: bool
    #: the fused MoE writes its output into its input where the layer has no shared expert
    inplace_moe: bool


def code_of(engine: str, model_type: str) -> Code:
    """vLLM 0.34.0's code (``engine`` "vllm": Gemma's norms native; gate_up dies at the
    activation in llama.py and mistral.py only, fit_estimates.toml [activation]
    ``gate_up_dies_at_activation``) or SGLang 0.5.23's (in-place Gemma norms; every MLP keeps
    gate_up, models/llama.py LlamaMLP.forward; ``FusedMoE(inplace=True)`` by default)."""
    from capture_plan.planner.fit.tables import estimates

    if engine == "sglang":
        return Code(native_norms=False, keeps_gate_up=True, inplace_moe=True)
    dies = estimates()["activation"]["gate_up_dies_at_activation"]
    return Code(native_norms=True, keeps_gate_up=model_type not in dies, inplace_moe=False)


def supports(model) -> bool:
    """Whether ``model`` (a transformers ``*ForCausalLM``) is of a type this file follows."""
    config = model.config.get_text_config(decoder=True)
    return config.model_type in TYPES


def workspace_layout(tokens: int, top_k: int, n: int, hidden: int) -> tuple[int, int]:
    """(workspace13, workspace2) elements of vLLM's fused-MoE workspace at ``tokens``, one after
    the other in the buffer its manager keeps (fused_moe/modular_kernel.py ``_allocate_buffers``:
    max(workspace13, the output (M, K)), then workspace2; ``TritonExperts.workspace_shapes``:
    workspace13 (M, topk, max(N / 2, K)), workspace2 (M, topk, max(N, K))); ``n``: N, 2 x the
    expert intermediate."""
    rows = tokens * top_k
    return max(rows * max(n // 2, hidden), tokens * hidden), rows * max(n, hidden)


class Workspace:
    """Where the fused MoE's caches live: ``held`` (vLLM's workspace manager's buffer, a
    uint8 tensor at least :func:`workspace_layout` long, which the views are cut from) or None
    (SGLang's: each call allocates its own)."""

    def __init__(self, held: torch.Tensor | None = None):
        self.held = held

    def caches(self, tokens: int, top_k: int, n: int, hidden: int, like: torch.Tensor):
        """(cache1 (tokens x top_k, n), cache2 (tokens x top_k, n / 2), a function giving
        cache3 (tokens, top_k, hidden) once cache1 is done with), as the engine places them."""
        rows = tokens * top_k

        def new(*shape):
            return torch.empty(*shape, dtype=like.dtype, device=like.device)

        if self.held is None:  # SGLang: three allocations, cache1 alive to the end
            return new(rows, n), new(rows, n // 2), lambda: new(tokens, top_k, hidden)
        flat = self.held.view(like.dtype)
        ws13, ws2_len = workspace_layout(tokens, top_k, n, hidden)
        ws2 = flat[ws13 : ws13 + ws2_len]
        return (
            ws2[: rows * n].view(rows, n),
            flat[: rows * n // 2].view(rows, n // 2),
            lambda: ws2[: rows * hidden].view(tokens, top_k, hidden),
        )


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of ``x`` in float32, times ``weight``, in ``x``'s dtype (vllm_c's kernel's math)."""
    f = x.float()
    return (f * torch.rsqrt(f.pow(2).mean(-1, keepdim=True) + eps) * weight.float()).to(x.dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """vllm_c ``rms_norm``: a new output, nothing else kept."""
    out = torch.empty_like(x)
    for i in range(0, x.shape[0], ROWS):
        out[i : i + ROWS] = _rms(x[i : i + ROWS], weight, eps)
    return out


def fused_add_rms_norm_(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float):
    """vllm_c ``fused_add_rms_norm``: ``residual += x``, then ``x`` = its norm; in place."""
    for i in range(0, x.shape[0], ROWS):
        r = residual[i : i + ROWS]
        r.add_(x[i : i + ROWS])
        x[i : i + ROWS] = _rms(r, weight, eps)
    return x, residual


def _native_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None):
    """ir/ops/layernorm.py ``rms_norm`` (``residual`` None) and ``fused_add_rms_norm``, as
    written: float32 copies, new outputs."""
    orig = x.dtype
    x = x.to(torch.float32)
    if residual is not None:
        x = x + residual.to(torch.float32)
        residual = x.to(orig)
    x = x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + eps)
    x = x.to(weight.dtype) * weight
    return x.to(orig) if residual is None else (x.to(orig), residual)


def _projections(x: torch.Tensor, linears) -> torch.Tensor:
    """The merged projection's output (tokens x the linears' rows), one allocation: each
    linear's GEMM writes a contiguous slice of its transpose (bias added by the GEMM)."""
    rows = sum(lin.weight.shape[0] for lin in linears)
    out = torch.empty(rows, x.shape[0], dtype=x.dtype, device=x.device)
    at = 0
    for lin in linears:
        n = lin.weight.shape[0]
        if lin.bias is None:
            torch.mm(lin.weight, x.t(), out=out[at : at + n])
        else:
            torch.addmm(lin.bias[:, None], lin.weight, x.t(), out=out[at : at + n])
        at += n
    return out.t()


def _act_and_mul(gate_up: torch.Tensor, inter: int, tanh_gelu: bool) -> torch.Tensor:
    """vllm_c ``silu_and_mul`` / ``gelu_tanh_and_mul``: a new (tokens x inter) output."""
    out = torch.empty(gate_up.shape[0], inter, dtype=gate_up.dtype, device=gate_up.device)
    for i in range(0, out.shape[0], ROWS):
        g, u = gate_up[i : i + ROWS, :inter], gate_up[i : i + ROWS, inter:]
        out[i : i + ROWS] = (F.gelu(g, approximate="tanh") if tanh_gelu else F.silu(g)) * u
    return out


def _attention(attn, x: torch.Tensor) -> torch.Tensor:
    """``LlamaAttention.forward`` in the profiling run: qkv, the layer's zero-filled output, o_proj."""
    qkv = _projections(x, (attn.q_proj, attn.k_proj, attn.v_proj))
    heads = attn.config.num_attention_heads
    out = torch.empty(x.shape[0], heads * attn.head_dim, dtype=x.dtype, device=x.device)
    out.fill_(0)
    o = F.linear(out, attn.o_proj.weight, attn.o_proj.bias)
    del qkv, out
    return o


def _mlp(mlp, x: torch.Tensor, tanh_gelu: bool, keeps_gate_up: bool, gate=None) -> torch.Tensor:
    """The MLP's forward: gate_up, the activation, down; gate_up dies at the activation
    (``LlamaMLP.forward`` rebinds ``x``) or at the return (``Qwen2MLP.forward`` and the
    others name it ``gate_up``, ``keeps_gate_up``); ``gate``: Qwen2-MoE's shared-expert gate,
    ``sigmoid(gate(x)) * out`` before the return (``Qwen2MoeMLP.forward``)."""
    gate_up = _projections(x, (mlp.gate_proj, mlp.up_proj))
    act = _act_and_mul(gate_up, mlp.gate_proj.weight.shape[0], tanh_gelu)
    if not keeps_gate_up:
        del gate_up
    out = F.linear(act, mlp.down_proj.weight, mlp.down_proj.bias)
    del act
    if gate is not None:
        out = torch.sigmoid(F.linear(x, gate.weight)) * out
    return out


def _fused_experts(
    block, x: torch.Tensor, router: torch.Tensor, workspace: Workspace, inplace: bool = False
) -> torch.Tensor:
    """The routed experts over ``x`` (fused_topk, the fused kernel's caches, moe_sum) into a
    new output, or into ``x`` (``inplace``: SGLang's ``fused_experts_impl``, whose GEMMs
    have read it before the sum writes it); ``block``: a transformers sparse-MoE block (its
    router and stacked experts)."""
    gate, experts = block.gate, block.experts
    tokens, k = x.shape[0], gate.top_k
    renorm = getattr(gate, "norm_topk_prob", True)  # Mixtral renormalises, Qwen2-MoE by its config
    weights = torch.empty(tokens, k, dtype=torch.float32, device=x.device)
    ids = torch.empty(tokens, k, dtype=torch.int32, device=x.device)
    token_expert = torch.empty(tokens, k, dtype=torch.int32, device=x.device)  # noqa: F841 (fused_topk's third output)
    for i in range(0, tokens, ROWS):
        v, j = torch.topk(torch.softmax(router[i : i + ROWS].float(), -1), k, -1)
        weights[i : i + ROWS] = v / v.sum(-1, keepdim=True) if renorm else v
        ids[i : i + ROWS] = j
    output = x if inplace else x.new_empty(tokens, x.shape[1])
    w13, w2 = experts.gate_up_proj, experts.down_proj  # (E, 2 x inter, hidden), (E, hidden, inter)
    n = w13.shape[1]
    cache1, cache2, cache3_of = workspace.caches(tokens, k, n, x.shape[1], x)
    flat = ids.view(-1)
    rows_of = [(e, (flat == e).nonzero().squeeze(1)) for e in range(w13.shape[0])]
    for e, rows in rows_of:
        for i in range(0, rows.shape[0], ROWS):
            r = rows[i : i + ROWS]
            cache1[r] = F.linear(x[r // k], w13[e])
    for i in range(0, cache1.shape[0], ROWS):
        g = cache1[i : i + ROWS]
        cache2[i : i + ROWS] = F.silu(g[:, : n // 2]) * g[:, n // 2 :]
    cache3 = cache3_of().view(tokens * k, -1)
    for e, rows in rows_of:
        for i in range(0, rows.shape[0], ROWS):
            r = rows[i : i + ROWS]
            cache3[r] = (F.linear(cache2[r], w2[e]) * weights.view(-1)[r, None]).to(x.dtype)
    for i in range(0, tokens, ROWS):  # moe_sum
        output[i : i + ROWS] = cache3.view(tokens, k, -1)[i : i + ROWS].sum(1)
    return output


def _moe(block, x: torch.Tensor, workspace: Workspace, code: Code) -> torch.Tensor:
    """``*SparseMoeBlock.forward`` through the MoE runner: the router's logits, a shared
    expert first (its sigmoid gate applied inside, Qwen2MoeMLP), the routed experts (in place
    where the engine's kernel writes its input and no shared expert needs it), their sum."""
    router = F.linear(x, block.gate.weight)
    shared = None
    if getattr(block, "shared_expert", None) is not None:
        shared = _mlp(block.shared_expert, x, False, code.keeps_gate_up, block.shared_expert_gate)
    fused = _fused_experts(block, x, router, workspace, inplace=code.inplace_moe and shared is None)
    return fused if shared is None else shared + fused


def _eps(norm) -> float:
    return getattr(norm, "variance_epsilon", None) or norm.eps


def _dense_layer(layer, h: torch.Tensor, residual: torch.Tensor | None, workspace: Workspace, code: Code):
    """``LlamaDecoderLayer.forward`` (Qwen2's, Mixtral's and Qwen2-MoE's alike, their MLP a
    sparse-MoE block: :func:`_moe`)."""
    n1, n2 = layer.input_layernorm, layer.post_attention_layernorm
    if residual is None:
        residual, h = h, rms_norm(h, n1.weight, _eps(n1))
    else:
        h, residual = fused_add_rms_norm_(h, residual, n1.weight, _eps(n1))
    h = _attention(layer.self_attn, h)
    h, residual = fused_add_rms_norm_(h, residual, n2.weight, _eps(n2))
    if hasattr(layer.mlp, "experts"):
        return _moe(layer.mlp, h, workspace, code), residual
    return _mlp(layer.mlp, h, False, code.keeps_gate_up), residual


def _gemma_norm(norm, x: torch.Tensor, residual: torch.Tensor | None, native: bool):
    """A Gemma norm (weight + 1): vLLM's native path (new tensors, ``native``) or SGLang's
    kernels (``gemma_fused_add_rmsnorm`` in place, ``gemma_rmsnorm`` into a new output)."""
    weight = norm.weight.float() + 1.0
    if native:
        return _native_rms_norm(x, weight, norm.eps, residual)
    return rms_norm(x, weight, norm.eps) if residual is None else fused_add_rms_norm_(x, residual, weight, norm.eps)


def _gemma2_layer(layer, h: torch.Tensor, residual: torch.Tensor | None, workspace: Workspace, code: Code):
    """``Gemma2DecoderLayer.forward``: four norms (:func:`_gemma_norm`)."""
    native = code.native_norms
    if residual is None:
        residual, h = h, _gemma_norm(layer.input_layernorm, h, None, native)
    else:
        h, residual = _gemma_norm(layer.input_layernorm, h, residual, native)
    h = _attention(layer.self_attn, h)
    h = _gemma_norm(layer.post_attention_layernorm, h, None, native)
    h, residual = _gemma_norm(layer.pre_feedforward_layernorm, h, residual, native)
    h = _mlp(layer.mlp, h, True, code.keeps_gate_up)
    return _gemma_norm(layer.post_feedforward_layernorm, h, None, native), residual


def profile_forward(model, ids: torch.Tensor, workspace: Workspace | None = None, engine: str = "vllm") -> torch.Tensor:
    """The final-normed hidden states ``(tokens, hidden)`` of ``ids`` through ``model``'s
    layers as ``engine``'s eager code runs its profiling forward ("vllm", "sglang":
    :func:`code_of`; module docstring); the LM head is not applied. ``model``: a
    transformers ``*ForCausalLM`` that :func:`supports`; ``workspace``: where an MoE layer's
    caches live (default: allocated per call, SGLang's)."""
    workspace = workspace or Workspace()
    config = model.config.get_text_config(decoder=True)
    base = model.base_model
    gemma = config.model_type == "gemma2"
    code = code_of(engine, config.model_type)
    with torch.no_grad():
        h = F.embedding(ids, base.embed_tokens.weight)
        if gemma:  # Gemma2Model.embed_input_ids: embedding x normalizer, a new tensor
            h = h * torch.tensor(config.hidden_size**0.5, dtype=h.dtype)
        residual = None
        for layer in base.layers:
            h, residual = (_gemma2_layer if gemma else _dense_layer)(layer, h, residual, workspace, code)
        norm = base.norm
        if gemma:
            h, _ = _gemma_norm(norm, h, residual, code.native_norms)
        else:
            h, _ = fused_add_rms_norm_(h, residual, norm.weight, _eps(norm))
    return h


#: the reference decode step's norms' epsilon (references/decode.py ``_rmsnorm``)
REFERENCE_EPS = 1e-5


def _reference_layer(ref, layer: dict, h: torch.Tensor, residual: torch.Tensor | None):
    """``LlamaDecoderLayer.forward`` over one of the reference decode step's layers (its
    merged ``wqkv`` and ``wgu``; o_proj's and down_proj's outputs all-reduced out of place)."""
    if residual is None:
        residual, h = h, rms_norm(h, layer["norm1"], REFERENCE_EPS)
    else:
        h, residual = fused_add_rms_norm_(h, residual, layer["norm1"], REFERENCE_EPS)
    o = _reference_attention(ref, layer, h)
    h, residual = fused_add_rms_norm_(o, residual, layer["norm2"], REFERENCE_EPS)
    gate_up = F.linear(h, layer["wgu"])  # kept to the return, as the reference's own MLP names it
    act = _act_and_mul(gate_up, ref.inter, tanh_gelu=False)
    down = _reduced(ref, F.linear(act, layer["wd"]))
    del act, gate_up
    return down, residual


def _reference_attention(ref, layer: dict, h: torch.Tensor) -> torch.Tensor:
    """``LlamaAttention.forward`` over a reference layer in the profiling run: the merged qkv,
    the layer's zero-filled output (attention skipped), o_proj's output all-reduced; qkv and the
    zeros die at the return."""
    qkv = F.linear(h, layer["wqkv"])
    out = torch.empty(h.shape[0], ref.heads * ref.head_dim, dtype=h.dtype, device=h.device)
    out.fill_(0)
    o = _reduced(ref, F.linear(out, layer["wo"]))
    del qkv, out
    return o


def _reduced(ref, partial: torch.Tensor) -> torch.Tensor:
    """vLLM's tensor-parallel all-reduce, out of place (distributed/parallel_state.py
    ``GroupCoordinator.all_reduce``): a new tensor made while the partial one lives; the
    partial one itself where the reference runs on one rank."""
    if ref.tp == 1:
        return partial
    out = partial.clone()
    ref._all_reduce(out)
    return out


def reference_forward(ref, ids: torch.Tensor) -> torch.Tensor:
    """:func:`profile_forward` over the reference decode step's weights
    (references/decode.py ``ReferenceModel``): what its own ``profile_hidden`` computes, with
    vLLM's eager layers' allocations."""
    with torch.no_grad():
        h, residual = F.embedding(ids, ref.embed), None
        for layer in ref.layers:
            h, residual = _reference_layer(ref, layer, h, residual)
        h, _ = fused_add_rms_norm_(h, residual, ref.final_norm, REFERENCE_EPS)
    return h


def eagle_forward(ref, h: torch.Tensor) -> torch.Tensor:
    """vLLM's EAGLE head's layers after its fc (model_executor/models/llama_eagle.py
    ``LlamaModel.forward``, its ``LlamaDecoderLayer``) over a reference model's layers, as the
    profiling run's dummy propose runs them (attention skipped): the first layer's input norm an
    Identity (its input is its residual), the others' fused in place; then ``hidden + residual``
    (no final norm)."""
    with torch.no_grad():
        residual = None
        for i, layer in enumerate(ref.layers):
            if i == 0:
                residual = h
            else:
                h, residual = fused_add_rms_norm_(h, residual, layer["norm1"], REFERENCE_EPS)
            o = _reference_attention(ref, layer, h)
            h, residual = fused_add_rms_norm_(o, residual, layer["norm2"], REFERENCE_EPS)
            gate_up = F.linear(h, layer["wgu"])
            act = _act_and_mul(gate_up, ref.inter, tanh_gelu=False)
            del gate_up  # llama.py LlamaMLP rebinds x: gate_up dies at the activation
            h = _reduced(ref, F.linear(act, layer["wd"]))
            del act
        return h + residual
