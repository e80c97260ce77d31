"""Torch's reserve growth over vLLM 0.34.0's KV-cache sizing step, simulated: how far the
caching allocator's reserved memory rises above what it keeps allocated while the step runs
(vllm/v1/worker/gpu/warmup.py ``run_kv_cache_sizing_warmup``, lines 483-540: the largest dummy
step and its sampling, read around it by ``_measure_sizing_step``, lines 452-480), which
``measure_kv_cache_bytes`` keeps free beside the transient peak:
``available -= max(transient_peak, torch_reserve_growth)``.

Why a simulation: the step starts from an emptied cache (``gc.collect``; ``torch.cuda.empty_cache``)
and its tensors are tens to hundreds of MiB each. The allocator gives each request it cannot
serve from a free block a segment of its own (the request rounded up to 2 MiB) and never hands
segments back while the step runs, so the reserve's peak is the segments the step's order of
requests leaves, not its largest set of live tensors: the sampler's float32 copy of the logits
(rows x vocabulary x 4), bigger than every block the layers freed, takes a segment beside all
of theirs. On the reference decode step at 8192 tokens the runner measured 1.43 GiB of growth
against a 0.85 GiB transient peak (bench/fit_bench.py; tests/test_fit_reserve.py).

The step's requests, in order, are the engine's eager layers' (the same reading as
:func:`.estimate.activation_per_token`, tests/engines/engine_layers.py's stand-ins, module
docstring there; tests/test_engine_layers.py holds the two to the same order of requests, op by
op on the CPU): the embedding; each layer's norm (in place but for the first layer's and
Gemma's native path), merged qkv, the attention's output, o_proj's output (its reduced copy at
tp > 1), the MLP's gate_up, activation and down_proj (an MoE layer's router logits, shared
expert, top-k tensors, output and sum; its caches in the workspace the manager already keeps);
the final norm; then the dummy sampler's two passes over min(max_num_seqs, tokens) rows (the
gathered rows, the model-dtype logits over the padded vocabulary and, for a model with
``final_logit_softcapping``, the LogitsProcessor's three out-of-place soft-cap steps,
Gumbel-max's per-block scratch, the second pass's float32 copy, fit_rules.toml [sampler]).

The step follows the profiling run, the same requests, which also made and kept what the step
finds made (vLLM's fused-MoE workspace, asked for before the first MoE layer's activations; the
sampler's Triton top-k/top-p scratch, made in its second pass while the float32 copies live),
and an emptied cache: the segments with nothing allocated are given back, those that what the
profile kept pins stay, with free space the step reuses (the scratch pins a segment of the
layers' on the Qwen2-MoE case: 92 MiB less growth, as the runner measured). What came before
the profile is not simulated: free space pinned by the weights' load or the persistent buffers
can serve the step's requests and lower the growth, or split a later, larger request's way and
raise it; the item's error bar (:func:`reserve_growth_item`) holds either. Not modelled either:
kernels' scratch and requests below a MiB, and the stand-ins' row-chunk temporaries (the
engine's fused kernels allocate none)."""

from __future__ import annotations

from capture_plan.planner.memory.allocator import FREE, SMALL_SIZE, PoolSim
from capture_plan.schemas.fit import FitItem

from .model import FitModel, qkv_width
from .tables import SamplerRule, estimates

__all__ = ["sizing_step_growth", "sizing_step_requests", "reserve_growth_item"]


class _Step:
    """The step's requests in order, ``(bytes, id)`` to allocate and ``(FREE, id)`` to free
    (PoolSim.run's compact form), over ``tokens`` of ``m`` on one rank of ``tp``."""

    def __init__(self, m: FitModel, tp: int, tokens: int) -> None:
        e = estimates()["activation"]
        self.ops: list[tuple[int, int]] = []
        self._next = 0
        self.m, self.tp, self.t = m, tp, tokens
        self.h, self.d = m.hidden, m.dtype_bytes
        #: Gemma's norms on vLLM's native path (fit_estimates.toml [activation])
        self.native = m.model_type in e["out_of_place_norms"]
        #: the MLP keeps gate_up to its return
        self.keeps = m.model_type not in e["gate_up_dies_at_activation"]
        #: vLLM's tensor-parallel all-reduce, out of place
        self.reduced = tp > 1

    def new(self, nbytes: int) -> int:
        i = self._next
        self._next += 1
        self.ops.append((nbytes, i))
        return i

    def drop(self, *ids: int | None) -> None:
        self.ops.extend((FREE, i) for i in ids if i is not None)

    def hidden(self) -> int:
        """A new (tokens x hidden) tensor in the model's dtype."""
        return self.new(self.t * self.h * self.d)

    def reduce(self, partial: int) -> int:
        """The all-reduce's new tensor at tp > 1 (made while the partial one lives), else
        ``partial`` itself."""
        if not self.reduced:
            return partial
        out = self.hidden()
        self.drop(partial)
        return out

    def native_norm(self, residual: int | None) -> tuple[int, int | None]:
        """vLLM's ir/ops/layernorm.py ``rms_norm`` / ``fused_add_rms_norm`` (Gemma's weight + 1
        takes it): float32 copies, a new output (and, given a residual, a new residual); the
        input and the residual stay the caller's."""
        f32, rows = self.t * self.h * 4, self.t * 4
        x32 = self.new(f32)
        new_res = None
        if residual is not None:
            res32 = self.new(f32)
            summed = self.new(f32)
            self.drop(res32, x32)
            x32 = summed
            new_res = self.hidden()
        pw = self.new(f32)
        mean = self.new(rows)
        self.drop(pw)
        eps = self.new(rows)
        self.drop(mean)
        rs = self.new(rows)
        self.drop(eps)
        y = self.new(f32)
        self.drop(rs, x32)
        yw = self.new(f32)
        self.drop(y)
        out = self.hidden()
        self.drop(yw)
        return out, new_res

    def mlp(self, inter: int, gate: bool = False) -> int:
        """gate_up, the activation's output, down_proj's (reduced at tp > 1); gate_up freed at
        the activation or at the return (``keeps``); ``gate``: Qwen2-MoE's shared expert,
        ``sigmoid(gate(x)) * out`` before the return (Qwen2MoeMLP.forward), never reduced."""
        t, d = self.t, self.d
        gate_up = self.new(t * 2 * inter * d)
        act = self.new(t * inter * d)
        if not self.keeps:
            self.drop(gate_up)
        down = self.hidden()
        self.drop(act)
        if gate:
            logit = self.new(t * d)
            sig = self.new(t * d)
            self.drop(logit)
            gated = self.hidden()
            self.drop(sig, down)
            down = gated
        else:
            down = self.reduce(down)
        if self.keeps:
            self.drop(gate_up)
        return down

    def moe(self) -> int:
        """vLLM's ``*SparseMoeBlock.forward``: the router's logits, a shared expert (its sigmoid
        gate), fused_topk's float32 weights, int32 ids and token-expert indices, the fused
        kernel's output (its caches in the workspace the manager keeps), the sum beside a
        shared expert's output, reduced at tp > 1."""
        m, t = self.m, self.t
        router = self.new(t * m.experts * self.d)
        shared = self.mlp(m.shared_expert_intermediate // self.tp, gate=True) if m.shared_expert_intermediate else None
        topk = [self.new(t * m.experts_per_token * 4) for _ in range(3)]
        fused = self.hidden()
        self.drop(*topk)
        if shared is not None:
            total = self.hidden()
            self.drop(shared, fused)
            fused = total
        fused = self.reduce(fused)
        self.drop(router)
        return fused

    def layer(self, index: int, hidden: int, residual: int) -> tuple[int, int]:
        """One decoder layer; the model's loop holds its input and the residual until it
        returns (then drops what the layer replaced). Returns (output, residual)."""
        m, tp = self.m, self.tp
        if self.native:
            x, new_res = self.native_norm(None if index == 0 else residual)
            layer_res = residual if new_res is None else new_res
        else:  # rms_norm's new output for the first layer, else the fused add-norm in place
            x, layer_res = (self.hidden() if index == 0 else hidden), residual
        qkv = self.new(self.t * qkv_width(m, tp) * self.d)
        attn = self.new(self.t * m.heads * m.v_head_dim // tp * self.d)
        o = self.hidden()
        self.drop(qkv, attn)
        o = self.reduce(o)
        if x != hidden:
            self.drop(x)
        if self.native:  # the post-attention norm (no residual), then the pre-feedforward one with it
            y, _ = self.native_norm(None)
            self.drop(o)
            o, res2 = self.native_norm(layer_res)
            self.drop(y)
            if layer_res != residual:
                self.drop(layer_res)
            assert res2 is not None  # given a residual, the native path makes a new one
            layer_res = res2
        out = self.moe() if m.experts and index >= m.dense_layers else self.mlp(m.intermediate // tp)
        self.drop(o)
        if self.native:  # the post-feedforward norm
            normed, _ = self.native_norm(None)
            self.drop(out)
            out = normed
        if hidden != residual:
            self.drop(hidden)
        if layer_res != residual:
            self.drop(residual)
        return out, layer_res

    def sampler(self, rows: int, s: SamplerRule, kept: int = 0) -> None:
        """The dummy sampler's default pass and its warm-up pass (fit_rules.toml [sampler]): the
        gathered rows, the logits over the padded vocabulary (tp > 1: the shard, the
        all-gathered copy and its reshaped one), Gumbel-max's per-block scratch each pass, the
        second pass's float32 copies; ``kept``: what the second pass makes and keeps once, after
        its float32 copies (the Triton top-k/top-p scratch: the profiling run makes it, the
        sizing step finds it made)."""
        m, d, v = self.m, self.d, self.m.vocab
        padded = s.padded_vocab(v)
        sampled = [self.new(rows * m.hidden * d) for _ in range(s.sampled_hidden_copies)]
        if self.tp > 1 and s.gather_copies:
            shard = self.new(rows * padded // self.tp * d)
            copies = [self.new(rows * padded * d) for _ in range(s.gather_copies)]
            logits = copies.pop()
            self.drop(shard, *copies)
        else:
            logits = self.new(rows * padded * d)
        if "final_logit_softcapping" in m.config_keys:  # logits / cap, tanh, * cap: each rebinds
            for _ in range(3):
                capped = self.new(rows * v * d)
                self.drop(logits)
                logits = capped
        blocks = s.sample_blocks(v)
        for copies in (0, s.fp32_copies):
            f32 = [self.new(rows * v * 4) for _ in range(copies)]
            if copies and kept:
                self.new(kept)  # never freed
            scratch = [self.new(rows * blocks * 8), self.new(rows * blocks * 4)] if blocks else []
            self.drop(*scratch, *f32)
        self.drop(logits, *sampled)


def sizing_step_requests(
    m: FitModel, tp: int, tokens: int, rows: int, sampler: SamplerRule, made: tuple[int, int] = (0, 0)
) -> list[tuple[int, int]]:
    """The sizing step's allocations and frees on one rank, in order (module docstring):
    ``tokens`` through the layers, then the dummy sampler's two passes over ``rows``; with
    ``made`` (the profiling run, the same step): (the fused-MoE workspace its first MoE layer
    asks for before the activations, what its sampler's second pass keeps), both kept."""
    step = _Step(m, tp, tokens)
    workspace, kept = made
    if workspace:
        step.new(workspace)  # never freed (vLLM's workspace manager keeps it)
    hidden = step.hidden()  # the embedding
    if step.native:  # Gemma2Model.embed_input_ids: times the normalizer, a new tensor
        scaled = step.hidden()
        step.drop(hidden)
        hidden = scaled
    residual = hidden
    for index in range(m.layers):
        hidden, residual = step.layer(index, hidden, residual)
    if step.native:  # the final norm with the residual: new tensors
        final, res = step.native_norm(residual)
        step.drop(hidden, residual, res)
        hidden = final
    elif residual != hidden:
        step.drop(residual)  # the final fused add-norm works in place; the residual dies with the forward
    step.sampler(rows, sampler, kept)
    step.drop(hidden)
    return step.ops


def sizing_step_growth(
    m: FitModel, tp: int, tokens: int, rows: int, sampler: SamplerRule, made: tuple[int, int] = (0, 0)
) -> int:
    """The reserve's peak over the step, less what it leaves allocated (none: it frees every
    request), as ``_measure_sizing_step`` reads it (reserved_bytes.all.peak - reserved before -
    left allocated), after the profiling run (:func:`sizing_step_requests` with ``made``) and
    the cache emptied: the segments left with nothing allocated are given back (here: each taken
    whole by a request the step never frees, so that the step cannot use it), those that what
    the profile keeps pins stay, with their free space."""
    pool = PoolSim()
    pool.run(sizing_step_requests(m, tp, tokens, rows, sampler, made), {})
    for small, size, blocks in sorted(pool.layout(), key=lambda seg: -seg[1]):
        if not any(allocated for _, allocated in blocks):  # torch.cuda.empty_cache gives it back
            for _ in range(size // SMALL_SIZE if small else 1):  # a small segment: its 1 MiB halves
                pool.alloc(SMALL_SIZE if small else size)
    before, held = pool.reserved, pool.allocated
    pool.peak_reserved = before
    pool.run(sizing_step_requests(m, tp, tokens, rows, sampler), {})
    return pool.peak_reserved - before - (pool.allocated - held)


def reserve_growth_item(
    m: FitModel, tp: int, tokens: int, seqs: int, rule: SamplerRule, transient: int, made: tuple[int, int] = (0, 0)
) -> FitItem:
    """0.34.0's torch reserve growth over its sizing step (:func:`sizing_step_growth`, at
    ``tokens`` = max_num_batched_tokens and min(max_num_seqs, tokens) rows, the sampler as
    ``rule``, after the profiling run that made and kept ``made``), which the KV cache's sizing
    keeps free where it exceeds the ``transient`` peak.
    The error bar, the activation items' fraction of it (fit_estimates.toml [activation]
    error_fraction) or its excess over the transient peak (the larger), holds what the
    simulation does not see (module docstring): free space pinned before the profile lowers or
    raises it, and a speculator whose propose keeps tensors in the profile's freed segments can
    take it to nothing, where the transient peak is what the rule keeps free."""
    rows = min(seqs, tokens)
    b = sizing_step_growth(m, tp, tokens, rows, rule, made)
    return FitItem(
        "torch reserve growth",
        b,
        max(int(b * estimates()["activation"]["error_fraction"]), b - transient),
        "estimated",
        f"the sizing step ({tokens} tokens, {rows} sampled rows) simulated after the profiling run and "
        "an emptied cache in PyTorch's caching allocator (planner/fit/reserve.py, planner/memory/allocator.py): "
        "its reserve's peak; "
        "vllm/v1/worker/gpu/warmup.py run_kv_cache_sizing_warmup, extensible_kv_cache.py measure_kv_cache_bytes "
        "keeps max(transient peak, this) free",
    )
