"""A bench case's model as the vLLM runners of this folder drive it (bench/fit_bench.py): the
reference decode step, the speculative reference (EAGLE) or a transformers model in
``HFTarget`` (bench.harness ``case_target``), in tests/engines/toy.py's interface.

The case models have no piecewise split: :class:`CaseModel` is one piece, the whole forward.
A decode graph of ``n`` requests runs the case's own decode phase (``decode``, or EAGLE's
``target_verify`` at its query length), hidden states out (bench/baselines.py
``hidden_state_outputs``); a dummy run (the runner's ``_dummy_run``, wrapped by
:func:`route_dummy_runs`) runs vLLM's eager decoder layers over a transformers model's or
the reference decode step's weights (tests/engines/engine_layers.py; the MoE layers' caches
in the workspace the case model holds as vLLM's manager does, or, SGLang's, allocated per
call), attention skipped as vLLM's profiling run skips it. The EAGLE draft is vLLM's EAGLE
head over the speculative reference's draft layer (:func:`as_vllm_eagle`,
:func:`route_vllm_eagle`). Also what the bench measures of
the model: its weights' bytes and its own decode cache (:func:`measured_weights`,
:func:`decode_cache`). SGLang's decode runner (tests/engines/sglang_runner.py,
bench/fit_bench_sglang.py) drives :class:`SGLangCaseModel`.
"""

from __future__ import annotations

import torch

from capture_plan.references.decode import ReferenceModel

from . import engine_layers


def _main(target):
    """The model whose forward is the target's: the speculative reference's target model, else the target."""
    return getattr(target, "target", target)


class CaseModel:
    """The runner's model: ``x`` the token ids the dummy runs read (vLLM's input buffer, zeros),
    one piece, :attr:`dummy` set while the runner's dummy run runs; ``phase`` at ``q`` tokens
    per request for the decode graphs."""

    def __init__(self, target, max_tokens: int, phase: str = "decode", q: int = 1):
        self.target, self.phase, self.q = target, phase, q
        main = _main(target)
        hf = getattr(target, "model", None)
        #: the LM head over hidden states, taken before hidden_state_outputs swaps it
        self.head = hf.lm_head if isinstance(hf, torch.nn.Module) else main.compute_logits
        text = hf.config.get_text_config(decoder=True) if isinstance(hf, torch.nn.Module) else None
        self.softcap = getattr(text, "final_logit_softcapping", None)
        self.device = target.device
        self.x = torch.zeros(max_tokens, dtype=torch.long, device=self.device)
        self.wp = [None]
        self.dummy = False
        #: the MoE dimensions of vLLM's fused-MoE workspace (None: a dense model), and the
        #: workspace as its manager holds it (:meth:`moe_workspace`)
        self.moe = moe_dims(text) if self.persistent_moe_workspace else None
        self.workspace: torch.Tensor | None = None
        #: the transformers model whose dummy runs take the engine's eager layers
        #: (tests/engines/engine_layers.py; None: the target's own ``profile_hidden``)
        self.engine_layers = hf if isinstance(hf, torch.nn.Module) and engine_layers.supports(hf) else None
        #: the reference decode step whose dummy runs take the engine's layers (engine_layers
        #: reference_forward; the EAGLE case's target included)
        self.reference = main if isinstance(main, ReferenceModel) else None

    #: the engine keeps its fused-MoE workspace after a forward (vLLM's workspace manager)
    persistent_moe_workspace = True
    #: whose layer code the dummy runs follow (engine_layers.code_of)
    engine = "vllm"

    def piece(self, k: int, x: torch.Tensor) -> torch.Tensor:
        if self.dummy:
            self.moe_workspace(x.shape[0])
            if self.engine_layers is not None:
                held = engine_layers.Workspace(self.workspace)  # None: SGLang's, allocated per call
                return engine_layers.profile_forward(self.engine_layers, x, held, self.engine)
            if self.reference is not None:
                return engine_layers.reference_forward(self.reference, x)
            return _main(self.target).profile_hidden(x)
        out = self.target.run(self.phase, x.shape[0] // self.q, None)
        return out[0] if isinstance(out, tuple) else out  # EAGLE's verify: (hidden states, last layer's)

    def launch(self, fn) -> None:
        fn()

    def new(self, rows: int):
        raise AssertionError("one piece: no buffer between pieces")

    def moe_workspace(self, tokens: int) -> None:
        """vLLM's fused-MoE workspace for a forward of ``tokens``, grown as its manager grows it
        and kept (vllm/v1/worker/workspace.py ``WorkspaceManager._ensure_workspace_size``: a
        larger request drops the old buffer, empties the cache and allocates the new size; the
        buffer stays allocated between forwards), asked for before the layers' activations,
        where vLLM's first MoE layer asks; the dummy runs' MoE layers (engine_layers) cut their
        caches from it. Nothing for a dense model."""
        if self.moe is None:
            return
        need = fused_moe_workspace_bytes(tokens, *self.moe)
        if self.workspace is not None and self.workspace.numel() >= need:
            return
        self.workspace = None
        torch.cuda.empty_cache()
        self.workspace = torch.empty(need, dtype=torch.uint8, device=self.device)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The model's head (Gemma2's final soft-capping included, as vLLM's LogitsProcessor
        applies it: ``logits / cap``, ``tanh``, ``* cap``, each rebinding ``logits``)."""
        logits = self.head(hidden)
        if self.softcap:
            logits = logits / self.softcap
            logits = torch.tanh(logits)
            logits = logits * self.softcap
        return logits


def moe_dims(text) -> tuple[int, int, int, int] | None:
    """(top-k, expert intermediate, hidden, dtype bytes) of a transformers MoE text config
    (Mixtral's ``num_local_experts`` and ``intermediate_size``, Qwen2-MoE's ``num_experts`` and
    ``moe_intermediate_size``); None for a dense one or no config."""
    if text is None or not (getattr(text, "num_local_experts", 0) or getattr(text, "num_experts", 0)):
        return None
    inter = getattr(text, "moe_intermediate_size", None) or text.intermediate_size
    dtype = getattr(text, "dtype", None) or torch.bfloat16
    dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    return text.num_experts_per_tok, inter, text.hidden_size, torch.empty((), dtype=dtype).element_size()


def fused_moe_workspace_bytes(tokens: int, top_k: int, inter: int, hidden: int, elem: int) -> int:
    """The bytes vLLM 0.19.0-0.34.0's fused-MoE layer asks its workspace manager for at a forward
    of ``tokens`` (fused_moe/modular_kernel.py ``_allocate_buffers``: one ``get_simultaneous``
    of max(workspace13, the output) and workspace2; fused_moe.py ``TritonExperts.workspace_shapes``:
    workspace13 (M, topk, max(N / 2, K)), workspace2 (M, topk, max(N, K)), the output (M, K),
    N = 2 x the expert intermediate, K = hidden, in the activation dtype). The views' 256-byte
    alignment is left out (the layout: engine_layers.workspace_layout)."""
    return elem * sum(engine_layers.workspace_layout(tokens, top_k, 2 * inter, hidden))


class SGLangCaseModel(CaseModel):
    """The case model as SGLang's decode runner calls it (``forward(phase, n, labels)``): its
    decode step (hidden states out), then the LogitsProcessor's tail: logits in the model's
    dtype, copied into the rows of the process's shared float32 logits buffer, which the
    graph returns a view of (sglang/srt/model_executor/graph_shared_output.py
    ``GraphSharedOutput.get_logits_buffer``: ``torch.zeros((max_rows, vocab), float)``, made
    before the decode runner's capture; layers/logits_processor.py ``_copy_logits_to_buffer``).
    :meth:`prefill_peak` is the runner's eager prefill chunk (module docstring of
    tests/engines/sglang_memory.py)."""

    #: SGLang's fused MoE allocates its intermediate caches per call (transients)
    persistent_moe_workspace = False
    #: SGLang's layer code: in-place Gemma norms, gate_up kept, the fused MoE in place
    engine = "sglang"

    def __init__(self, target, max_tokens: int, phase: str = "decode"):
        super().__init__(target, max_tokens, phase)
        self.vocab = vocab_size(target)
        self.logits_buffer: torch.Tensor | None = None

    def create_logits_buffer(self, rows: int) -> torch.Tensor:
        self.logits_buffer = torch.zeros((rows, self.vocab), dtype=torch.float, device=self.device)
        return self.logits_buffer

    def forward(self, phase: str, n: int, labels) -> torch.Tensor:
        """The decode step, the head's model-dtype logits, and their float32 copy into the
        shared buffer; Gemma2's final soft-capping fused into that copy, in place on the
        buffer (layers/logits_processor.py ``_copy_logits_to_buffer``: ``softcap_to_float32_logits``
        writes cap * tanh(logits / cap) into the float32 buffer, no model-dtype temporaries)."""
        assert self.logits_buffer is not None, "create_logits_buffer before the decode runner captures"
        out = self.logits_buffer[:n]
        out.copy_(self.head(self.piece(0, self.x[:n])))
        if self.softcap:
            out.div_(self.softcap).tanh_().mul_(self.softcap)
        return out

    def prefill_peak(self, tokens: int, rows: int) -> int:
        """Torch's allocated peak over what stays allocated, for one eager prefill chunk of
        ``tokens`` (the model's ``profile_hidden``: attention skipped) and its sampling over
        ``rows`` requests' last tokens (the logits as float32, their softmax, the argmax)."""
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        self.dummy = True
        try:
            hidden = self.piece(0, self.x[:tokens])
        finally:
            self.dummy = False
        last = torch.arange(tokens - rows, tokens, device=self.device)
        logits = self.compute_logits(hidden[last]).float()
        logits.softmax(-1).argmax(-1)
        del hidden, logits
        torch.cuda.synchronize()
        stats = torch.cuda.memory_stats()
        return stats.get("allocated_bytes.all.peak", 0) - stats.get("allocated_bytes.all.current", 0)


def route_dummy_runs(runner, model: CaseModel) -> None:
    """The runner's dummy runs (profile_run's, the sizing warm-up's) through ``model.dummy``."""
    dummy_run = runner._dummy_run

    def routed(num_tokens):
        model.dummy = True
        try:
            return dummy_run(num_tokens)
        finally:
            model.dummy = False

    runner._dummy_run = routed


class DraftModel:
    """What the runner's EAGLE speculator reads of its draft before :func:`route_vllm_eagle`
    replaces its forward: token rows, one piece, the device."""

    def __init__(self, target, max_tokens: int):
        self.device = target.device
        self.x = torch.zeros(max_tokens, dtype=torch.long, device=self.device)
        self.wp = [None]

    def piece(self, k: int, x: torch.Tensor):
        raise AssertionError("the speculator's forward is routed to the EAGLE head (route_vllm_eagle)")

    def launch(self, fn) -> None:
        fn()


def as_vllm_eagle(target) -> None:
    """The speculative reference's draft made vLLM's EAGLE head (0.33.0 and 0.34.0:
    model_executor/models/llama_eagle.py; v1/worker/gpu/spec_decode/eagle/utils.py
    load_eagle_model): an ``fc`` of 2 x hidden to hidden (ReplicatedLinear, no bias), the
    target's embedding and lm_head (share_target_lm_head: a checkpoint without its own), no
    final norm and no input norm in its first layer (llama_eagle.py: an Identity). The
    reference's layer code still runs that norm, so its weight is the target's first one (one
    storage, which :func:`measured_weights` counts once); the draft's own embedding, head and
    norms are given back to the device. Call before the weights are measured."""
    d, t, m = target.draft, target.target, target.cfg.model
    if hasattr(d, "fc"):  # made so already
        return
    g = torch.Generator(device=target.device)
    g.manual_seed(target.cfg.seed + 2)
    fc = torch.empty(m.hidden, 2 * m.hidden, device=target.device, dtype=torch.bfloat16)
    draw = torch.randn(m.hidden, 2 * m.hidden, generator=g, device=target.device, dtype=torch.float32)
    fc.copy_(draw.mul_(0.02))
    del draw
    d.fc = fc
    d.embed, d.lm_head, d.final_norm = t.embed, t.lm_head, t.final_norm
    d.layers[0]["norm1"] = t.layers[0]["norm1"]
    if fc.device.type == "cuda":
        torch.cuda.empty_cache()  # the draws and the draft's own copies back to the device


def route_vllm_eagle(speculator, target, max_tokens: int, max_reqs: int, steps: int, argmax_block: int) -> None:
    """The speculator's forward (``_forward(num_reqs, num_tokens, cg_mode, skip_attn, prefill)``)
    as vLLM's EAGLE head runs it over :func:`as_vllm_eagle`'s head and the reference draft's
    cache (target_dependent_ar/speculator.py ``_prefill`` and ``_decode``, llama_eagle.py
    LlamaModel.forward, speculator.py sample_draft's greedy path): ``prefill`` (None: where a
    request has several tokens), one step over all of them (the draft prefill manager's graphs, the profiling run's
    propose), the last token of each request sampled; where it has one, ``steps`` steps (the
    draft decode manager's fused multi-step decode: num_speculative_tokens - 1). A step: the
    requests' positions gathered (several tokens a request), the embedding, its concatenation
    with the target's hidden states, fc, the layers (the case's own layer code in a graph, as
    the target's graphs run theirs; ``skip_attn``, the profiling run's dummy propose: vLLM's
    eager layers, attention skipped, engine_layers.py ``eagle_forward``), the logits of the sampled rows in the model
    dtype through the target's lm_head, and the greedy argmax (``argmax_block``: 0.34.0's
    greedy_argmax's int64 result and float32 and int32 partials per block of columns; 0:
    torch's argmax), the results copied into the speculator's persistent buffers
    (``max_tokens`` rows: its hidden states, input ids and positions; ``max_reqs`` rows: its
    last-token indices, sampling positions and draft tokens), made here, before the profile, as vLLM
    makes them at the runner's init."""
    from capture_plan.references.decode import CacheRows

    d, t, dev = target.draft, target.target, target.device
    m, rows_max = target.cfg.model, max_reqs
    hidden = torch.zeros(max_tokens, m.hidden, dtype=torch.bfloat16, device=dev)
    ids = torch.zeros(max_tokens, dtype=torch.int32, device=dev)
    positions = torch.zeros(max_tokens, dtype=torch.int64, device=dev)
    last = torch.zeros(rows_max, dtype=torch.int64, device=dev)
    sampled_src = torch.zeros(rows_max, dtype=torch.int64, device=dev)
    draft_tokens = torch.zeros(rows_max, steps + 1, dtype=torch.int64, device=dev)

    def sample(rows: torch.Tensor) -> torch.Tensor:
        logits = rows @ t.lm_head.t()  # LogitsProcessor: the model dtype, no float32 copy
        n, vocab = logits.shape
        out = torch.empty(n, dtype=torch.int64, device=dev)
        if argmax_block:  # greedy_argmax's partials, then its result
            splits = -(-vocab // argmax_block)
            values = torch.empty(n, splits, dtype=torch.float32, device=dev)
            index = torch.empty(n, splits, dtype=torch.int32, device=dev)
            torch.argmax(logits, dim=-1, out=out)
            del values, index
            return out
        return logits.argmax(dim=-1)

    def step(n: int, q: int, cache: CacheRows, skip_attn: bool, col: int) -> None:
        tokens, prefill = n * q, col == 0  # the prefill samples draft token 0
        if prefill:  # positions[last_token_indices] and its successor, alive to the step's end
            at = positions[last[:n]]
            src = at + 1
        embeds = torch.nn.functional.embedding(ids[:tokens].long(), t.embed)
        x = torch.cat((embeds, hidden[:tokens]), dim=-1) @ d.fc.t()
        if skip_attn:  # the profiling run's dummy propose: vLLM's eager layers (engine_layers.py)
            x = engine_layers.eagle_forward(d, x)
        else:  # a graph: the case's own layer code, as the target's graphs run theirs
            for layer in d.layers:
                x = d._layer(layer, x, n, q, None, cache)
        del embeds
        rows = x[last[:n]] if prefill else x  # last_hidden_states[last_token_indices]: a gather
        draft_tokens[:n, col].copy_(sample(rows))
        hidden[:n].copy_(rows)
        if prefill:
            positions[:n].copy_(at)
            sampled_src[:n].copy_(src)

    # the attention's cache rows and lengths, as vLLM builds its metadata outside the graph:
    # made at a size's first (eager) run, its warm-up, and read by its capture
    made: dict = {}

    def cache_of(n: int, ahead: int) -> CacheRows:
        if (n, ahead) not in made:
            index = made[(n, 0)].index if (n, 0) in made else target._cache_rows(n)
            made[(n, ahead)] = CacheRows(index, target.seq_lens[:n] + ahead)
        return made[(n, ahead)]

    def forward(num_reqs, num_tokens, cg_mode, skip_attn: bool = False, prefill: bool | None = None):
        if num_tokens % num_reqs:
            raise ValueError(f"{num_tokens} tokens are not whole requests of {num_reqs}")
        q = num_tokens // num_reqs
        if (q > 1) if prefill is None else prefill:
            step(num_reqs, q, cache_of(num_reqs, 0), skip_attn, 0)
            return
        for s in range(steps):
            step(num_reqs, 1, cache_of(num_reqs, s + 1), skip_attn, s + 1)

    speculator._forward = forward
    speculator.state = (hidden, ids, positions, last, sampled_src, draft_tokens)


def _reference_models(target) -> list:
    return [target.target, target.draft] if hasattr(target, "draft") else [target]


def measured_weights(target, rotary: bool = True) -> int:
    """Bytes of the model's parameters and buffers (one count per storage: EAGLE's draft shares
    the target's embedding), its KV caches not included; without ``rotary``, a transformers
    model's rotary buffers (``rotary_emb.inv_freq``, ``original_inv_freq``) left out."""
    model = getattr(target, "model", None)
    if isinstance(model, torch.nn.Module):
        buffers = [b for n, b in model.named_buffers() if rotary or "rotary_emb." not in f".{n}"]
        tensors = [*model.parameters(), *buffers]
    else:
        tensors = []
        for m in _reference_models(target):
            tensors += [m.embed, m.lm_head, m.final_norm, *([m.fc] if hasattr(m, "fc") else [])]
            tensors += [t for layer in m.layers for k, t in layer.items() if not k.endswith("_cache")]
    seen = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    return sum(seen.values())


#: rope types whose cache has max_position_embeddings rows in both engines (only the
#: frequencies differ): the types the bench's case models use
MAX_ROW_ROPES = (None, "default", "llama3")


def rotary_cache(config, device, dtype: torch.dtype) -> torch.Tensor | None:
    """The rotary cos/sin cache an engine's ``RotaryEmbedding.__init__`` makes while the
    weights load (``_compute_cos_sin_cache``: ``(max_position_embeddings, rotary_dim)``, cos
    then sin), kept as ``dtype`` (SGLang: float32 on CUDA; vLLM: the model's dtype), one for
    the model (both engines share a rope by its settings). ``config``: a transformers config
    (None, or one without rotary embeddings: None). A rope type whose rows are not
    max_position_embeddings (:data:`MAX_ROW_ROPES`) raises ValueError: not modelled here."""
    if config is None:
        return None
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    if not getattr(text, "max_position_embeddings", None):
        return None
    rope = getattr(text, "rope_parameters", None) or {}
    kind = rope.get("rope_type", rope.get("type"))
    if kind not in MAX_ROW_ROPES:
        raise ValueError(f"rope type {kind!r}: its cache rows are not modelled by tests/engines/case_model.py")
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    rotary_dim = int(head_dim * (getattr(text, "partial_rotary_factor", None) or 1.0))
    base = getattr(text, "rope_theta", None) or rope.get("rope_theta", 10000.0)
    inv_freq = 1.0 / (base ** (torch.arange(0, rotary_dim, 2, dtype=torch.float, device=device) / rotary_dim))
    t = torch.arange(text.max_position_embeddings, dtype=torch.float, device=device)
    freqs = torch.einsum("i,j -> ij", t, inv_freq)
    return torch.cat((freqs.cos(), freqs.sin()), dim=-1).to(dtype)


def engine_weights(target, dtype: torch.dtype | None = None) -> tuple[int, torch.Tensor | None]:
    """(bytes, rope cache) of the case model as an engine holds it: its parameters and buffers
    with the engine's rotary cache (:func:`rotary_cache`, kept as ``dtype``; None: the model's
    dtype) in place of transformers' inv_freq buffers, which neither engine keeps. The cache is
    made on the model's device and must stay alive while the engine's memory is read; a target
    without a transformers model (the reference) is its :func:`measured_weights` and no cache."""
    hf = getattr(target, "model", None)
    if not isinstance(hf, torch.nn.Module):
        return measured_weights(target), None
    rope = rotary_cache(hf.config, next(hf.parameters()).device, dtype or hf.dtype)
    return measured_weights(target, rotary=rope is None) + (rope.nbytes if rope is not None else 0), rope


def vocab_size(target) -> int:
    """The model's vocabulary as the engines read it (vLLM's model_config.get_vocab_size(): the
    text config's vocab_size, unpadded, which ``HFTarget.vocab`` holds); the reference's, its
    spec's."""
    main = _main(target)
    return getattr(main, "vocab", None) or main.cfg.model.vocab


def decode_cache(target) -> tuple[int, int, int, int]:
    """(bytes, KV bytes one token takes in one layer, full layers, sliding layers) of the
    model's own decode cache (EAGLE's: the target's and the draft's layers)."""
    model = getattr(target, "model", None)
    if isinstance(model, torch.nn.Module):
        layers = target.cache.layers
        total = sum(layer.keys.nbytes + layer.values.nbytes for layer in layers)
        k, v = layers[0].keys, layers[0].values
        per_token = k[0, :, 0].nbytes + v[0, :, 0].nbytes
        types = getattr(model.config.get_text_config(decoder=True), "layer_types", None) or []
        sliding = sum(t == "sliding_attention" for t in types)
        return total, per_token, len(layers) - sliding, sliding
    layers = [layer for m in _reference_models(target) for layer in m.layers]
    total = sum(layer[k].nbytes for layer in layers for k in ("k_cache", "v_cache"))
    k = layers[0]["k_cache"]
    return total, 2 * k[0, 0].nbytes, len(layers), 0
