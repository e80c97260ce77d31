"""``HFTarget``: a transformers causal LM's decode step as a ``CaptureTarget``.

Maps a Hugging Face model onto the executor's contract the way an engine's
model runner does (see docs/adapters.md):

* **one static KV cache** (``transformers.StaticCache``) sized for the largest
  batch and the longest sequence, allocated once outside every graph pool;
  the graph of batch ``bs`` uses a view of its first ``bs`` rows (a shallow
  copy of the cache whose layers hold ``keys[:bs]`` / ``values[:bs]``: no
  memory of its own);
* **static input buffers**: token ids, position ids, a 4-D additive attention
  mask and the write position, per tokens-per-request; ``prepare`` writes
  random valid inputs into them; ``run`` reads slices of them;
* **outputs allocated in the step**: the logits the model returns, one row
  per token (``bs * tokens_per_request`` rows).

Every ``run`` first copies the prepared write position into each cache
layer's position counter (inside the graph, so replays and eager runs write
the new keys and values into the same slots and read the same history: a
replay equals an eager run on the same inputs). The mask is passed as a 4-D
tensor (one per layer type for hybrid sliding-window models), so
transformers builds none itself (its mask code reads tensor values
on the host when not capturing, which would make eager and captured runs
take different paths).

**Attention kernels are pinned** (``sdpa_backends``), as an engine pins its
attention backend instead of letting a dispatcher choose: by default ``run``
lets ``scaled_dot_product_attention`` use flash, memory-efficient or math
attention only, the kernels PyTorch's dispatcher still allows under
``torch.use_deterministic_algorithms(True)``. Left to itself, the dispatcher
puts cuDNN attention first on sm90 / sm100 with a cuDNN newer than 9.15
(``check_prefer_cudnn_attention`` in PyTorch's ``sdp_utils.cpp``; flash
attention takes no mask, so the masked decode attention goes to cuDNN), and
cuDNN attention is the kernel the dispatcher refuses in deterministic mode
("cuDNN SDPA is not deterministic"). Why this matters, measured on an H200
(torch 2.11, bench/models_bench.py, 2026-11-29, before the pin): with SDPA,
6-18 of 36 replays per model differed from an eager run of the same inputs
(up to 0.07 in bf16 logits) while Gemma2 with eager attention matched bit for
bit, and nothing on the Python side differs: the step dispatches the same
aten ops with the same arguments on the same buffers for any inputs, eager
or under capture, and reads no tensor value on the host
(tests/test_adapters.py checks that op by op). The models bench's
attention check measures both settings on the device: the kernel picked,
replays against eager runs, and eager runs against each other. Pass
``sdpa_backends=None`` to keep PyTorch's choice. PyTorch's SDPA flags are
process-wide, so the pin is too: it is set when the first ``run`` of any
pinned target starts and restored when the last one running ends (counted
under a lock: a background capture's thread and the serving thread's eager
fallback may run at the same time, and a plain save-and-restore per call
would let one of them undo the other's pin mid-run). Meanwhile every SDPA
call in the process sees the pin; targets that run concurrently share the
first one's backends.

**The cache has the shapes the model writes**: each layer is allocated from
one eager step of batch 1 with a dynamic cache (at construction), so MLA
attention (DeepSeek-V3, Kimi K2: a compressed latent of one head, its two
parts of different widths) needs no config arithmetic. **MoE experts** run
as transformers dispatches them (``experts_implementation``); ``grouped_mm``
(transformers' default) and ``batched_mm`` route on the device and are
accepted, ``eager`` (a loop over the experts hit, read on the host) is
refused. The forward's cache argument is ``cache`` where the model's
signature has it (transformers 5.24; ``past_key_values`` there warns) and
``past_key_values`` otherwise (5.17).

**Sliding-window layers** keep all ``max_seqlen`` slots like full layers,
and their window is applied by the mask (``HFTarget.window``; hybrid models
get one mask per layer type, as transformers keys them): transformers' own
sliding cache is a ring of ``window`` slots that rolls on a host-side
branch, which a captured graph would freeze. The cost is memory: a sliding
layer's cache is ``max_seqlen`` slots, not ``window``.

Constraints: the model is in eval mode on one device; sliding layers of
different windows narrower than the cache, and chunked attention (Llama 4)
narrower than the cache, are refused. Linear-attention layers (Qwen3-Next)
are refused: transformers allocates their state at first use, inside the
first capture's pool. Tested with transformers 5.17 and 5.24 on CPU
(tests/test_adapters.py: Llama, Mixtral, Qwen2-MoE, Qwen3-MoE,
DeepSeek-V3, GPT-OSS, GLM-4-MoE, Mistral, Gemma2 built from tiny configs;
decoding through a narrow window equals transformers' full-sequence forward)
and with 5.17 on an H200 for Llama, Mixtral, Qwen2-MoE and Gemma2 with
windows at least ``max_seqlen`` (tests/test_gpu_adapters.py also has the
other architectures and narrow windows; they had not run on a GPU when this
was written).
**Engine attention** (``attention="fa3"``): the model's attention modules call
FlashAttention-3's ``flash_attn_with_kvcache`` over the static cache instead of
transformers' attention, as vLLM's and SGLang's default backends do on sm90
(vllm/v1/attention/backends/flash_attn.py, sglang/srt/layers/attention/
flashattention_backend.py). It matters for graph memory: transformers' SDPA path with a
mask expands grouped K/V heads to every query head (``repeat_kv``) over the whole cache
inside the graph, ``2 x bs x heads x max_seqlen x head_dim`` per layer in the pool, which
no engine's decode allocates; FA3 reads the cache as it is (the transposed views, no copy)
and allocates only its output and, with ``fa3_splits`` above 1, its float32 split-KV
accumulators (vLLM's FULL graphs pass ``max_num_splits``, 32; SGLang passes 0, FA3's own
heuristic). Every row then attends to all slots before the write position and the new
tokens causally (``prepare`` draws no shorter per-row histories: FA3 takes per-row lengths,
not a gap before the new tokens); the masks are still written, so the model's own
attention over the same inputs computes the same thing. Refused: MLA models (the cache
holds a latent, not keys and values) and no importable FA3 (capture_plan.executor.fa3).
The model's config names the registered FA3 implementation from then on (transformers looks
the attention function up there at every call): a model serves one such target.
A sliding window narrower than the cache is passed to FA3 (``window_size``), which the
fa3-fwd wheel is built without.

What it does not do: paged KV, sampling, tensor parallelism, prefill with attention
(``profile_hidden`` is the profiling run's forward: attention skipped), a cache of only
``window`` slots for sliding layers.
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import threading
from dataclasses import dataclass

import torch

__all__ = ["HFTarget", "DETERMINISTIC_SDPA", "ATTENTIONS"]

#: ``torch.nn.attention.SDPBackend`` names the adapter allows by default: those
#: PyTorch keeps in deterministic mode (all but cuDNN attention), in its order.
DETERMINISTIC_SDPA = ("FLASH_ATTENTION", "EFFICIENT_ATTENTION", "MATH")

#: what ``HFTarget(attention=...)`` takes: the model's own attention (transformers', as its
#: config names it) or FlashAttention-3 over the static cache, as the engines run it
ATTENTIONS = ("model", "fa3")


@dataclass
class _Buffers:
    """Static inputs for one tokens-per-request value."""

    ids: torch.Tensor  # (max_bs, t) long
    positions: torch.Tensor  # (max_bs, t) long
    mask: torch.Tensor  # (max_bs, 1, t, max_seqlen) model dtype, additive
    #: the same for sliding-window layers (also hides slots a window behind); None without such layers
    window_mask: torch.Tensor | None = None
    #: per row, the slots its last new token sees (FA3's cache_seqlens, int32); None without FA3
    seqlens: torch.Tensor | None = None


class HFTarget:
    """A CaptureTarget for ``model`` (a ``*ForCausalLM``).

    ``tokens``: tokens per request of each phase (``{"decode": 1}``; a
    ``target_verify`` phase would be 4). ``max_bs`` and ``max_seqlen`` size
    the cache and the buffers. ``sdpa_backends``: the ``SDPBackend`` names
    ``run`` allows (default :data:`DETERMINISTIC_SDPA`), or ``None`` for
    PyTorch's own dispatch. ``attention``: one of :data:`ATTENTIONS` (module
    docstring); ``fa3_splits``: FA3's ``num_splits`` (0: its heuristic), with
    ``attention="fa3"`` only.
    """

    def __init__(
        self,
        model,
        *,
        max_bs: int = 256,
        max_seqlen: int = 512,
        tokens: dict | None = None,
        seed: int = 0,
        sdpa_backends: tuple[str, ...] | None = DETERMINISTIC_SDPA,
        attention: str = "model",
        fa3_splits: int = 0,
    ):
        # transformers is the hf extra: .ci/run type-checks with it installed, a checkout may lack it
        from torch.nn.attention import SDPBackend
        from transformers import StaticCache  # pyright: ignore[reportMissingImports]

        unknown = [b for b in (sdpa_backends or ()) if not hasattr(SDPBackend, b)]
        if sdpa_backends is not None and (unknown or not len(sdpa_backends)):
            raise ValueError(
                f"sdpa_backends {tuple(sdpa_backends)!r}: expected None or names of "
                f"torch.nn.attention.SDPBackend such as {DETERMINISTIC_SDPA}"
            )
        self.sdpa_backends = sdpa_backends
        if attention not in ATTENTIONS:
            raise ValueError(f"attention {attention!r}: expected one of {ATTENTIONS}")
        if fa3_splits < 0 or (fa3_splits and attention != "fa3"):
            raise ValueError(f"fa3_splits {fa3_splits}: expected 0, or FA3's num_splits >= 1 with attention='fa3'")
        self.attention, self.fa3_splits = attention, fa3_splits
        self._fa3 = None
        if attention == "fa3":
            from capture_plan.executor import fa3 as fa3_modules

            self._fa3 = fa3_modules.load_fa3()
            if self._fa3 is None:
                raise ImportError(
                    f"attention='fa3' needs FlashAttention-3: none of {fa3_modules.FA3_MODULES} imports; "
                    "install the fa3-fwd wheel (pip install fa3-fwd) or pass attention='model'"
                )

        self.model = model.eval()
        self.tokens = dict(tokens or {"decode": 1})
        self.max_bs, self.max_seqlen = max_bs, max_seqlen
        p = next(model.parameters())
        self.device, self.dtype = p.device, p.dtype
        cfg = model.config.get_text_config(decoder=True)
        self.vocab = cfg.vocab_size
        # transformers 5.24 renamed forward's `past_key_values` to `cache` (the old name
        # warns, and goes in 5.40); 5.17 knows only the old one. Ask the signature, not
        # the version: the rename is per model class.
        params = inspect.signature(model.forward).parameters
        self._cache_kwarg = "cache" if "cache" in params else "past_key_values"
        _check_experts(model)
        self.cache = StaticCache(config=model.config, max_cache_len=max_seqlen)
        #: the sliding window narrower than the cache (None: none is), and whether some layers attend fully
        self.window: int | None = None
        self._mixed = False
        self._allocate_cache(max_bs, getattr(cfg, "layer_types", None))
        if self._fa3 is not None:
            k, v = self.cache.layers[0].keys, self.cache.layers[0].values  # pyright: ignore[reportAttributeAccessIssue]
            if k.shape != v.shape:  # pyright: ignore[reportOptionalMemberAccess]
                raise ValueError(
                    f"attention='fa3' reads the cache as keys and values; {type(model).__name__} caches "
                    f"{tuple(k.shape)} and {tuple(v.shape)} (MLA's latent): pass attention='model'"  # pyright: ignore[reportOptionalMemberAccess]
                )
            # after the cache's probe step, which runs the model's own attention on a dynamic cache
            from transformers import AttentionInterface  # pyright: ignore[reportMissingImports]

            AttentionInterface.register(FA3_ATTENTION, _fa3_attention)
            model.config._attn_implementation = FA3_ATTENTION
        # Each layer's write position, reset from `position` at every run. The
        # counters are views of one tensor, so the reset is a single copy.
        self._counters = torch.zeros(len(self.cache.layers), dtype=torch.long, device=self.device)
        for i, layer in enumerate(self.cache.layers):
            # transformers' cache layers keep their write position here, undeclared in its types
            layer.cumulative_length = self._counters[i]  # pyright: ignore[reportAttributeAccessIssue]
        self.position = torch.zeros((), dtype=torch.long, device=self.device)
        self._views: dict[int, object] = {}
        self._buffers = {
            t: _Buffers(
                ids=torch.zeros(max_bs, t, dtype=torch.long, device=self.device),
                positions=torch.zeros(max_bs, t, dtype=torch.long, device=self.device),
                mask=torch.zeros(max_bs, 1, t, max_seqlen, dtype=self.dtype, device=self.device),
                window_mask=None
                if self.window is None
                else torch.zeros(max_bs, 1, t, max_seqlen, dtype=self.dtype, device=self.device),
                seqlens=None if self._fa3 is None else torch.zeros(max_bs, dtype=torch.int32, device=self.device),
            )
            for t in set(self.tokens.values())
        }
        gen = torch.Generator(device=self.device)
        gen.manual_seed(seed)
        for phase in self.tokens:
            self.prepare(phase, max_bs, max_bs, gen)

    def model_key(self) -> str:
        """What a start-up calibration of this target depends on besides the device
        (``predict_startup(cache=..., model_key=...)``): the model class, its whole
        config (attention implementation included; not the path it was loaded from),
        dtype, this adapter's buffer sizes and SDPA backends, and the transformers
        version whose code it runs. A digest,
        prefixed by the class and dtype for the logs; the same model gives the same key
        in every process."""
        import hashlib
        import json

        import transformers  # pyright: ignore[reportMissingImports]

        cfg = self.model.config.to_dict()
        # where the weights were loaded from, and the version that wrote the config, change
        # nothing the capture allocates (the version that runs is keyed below)
        for incidental in ("_name_or_path", "transformers_version"):
            cfg.pop(incidental, None)
        cfg["_attn_implementation"] = getattr(self.model.config, "_attn_implementation", None)
        parts = {
            "class": type(self.model).__qualname__,
            "config": cfg,
            "dtype": str(self.dtype),
            "transformers": transformers.__version__,
            "max_bs": self.max_bs,
            "max_seqlen": self.max_seqlen,
            "tokens": self.tokens,
            "sdpa": list(self.sdpa_backends) if self.sdpa_backends is not None else None,
        }
        if self._fa3 is not None:  # only then: the model's own attention keeps the keys it had
            parts["fa3"] = {"module": self._fa3.__name__, "splits": self.fa3_splits}
        raw = json.dumps(parts, sort_keys=True, default=str).encode()
        return f"{type(self.model).__name__} {self.dtype} {hashlib.sha256(raw).hexdigest()[:16]}"

    # -- CaptureTarget -------------------------------------------------------
    def run(self, phase: str, bs: int, workspace: torch.Tensor | None) -> torch.Tensor:
        t = self.tokens[phase]
        buf = self._buffers[t]
        self._counters.copy_(self.position.expand_as(self._counters))
        mask = buf.mask[:bs]
        if buf.window_mask is not None:
            # one mask per layer type, as transformers' hybrid models key them; a
            # model whose layers all slide takes the window's mask alone
            mask = (
                {"full_attention": mask, "sliding_attention": buf.window_mask[:bs]}
                if self._mixed
                else buf.window_mask[:bs]
            )
        extra = {}
        if buf.seqlens is not None:
            # transformers hands a forward's extra keyword arguments down to the attention function
            extra[FA3_ATTENTION] = (self._fa3, buf.seqlens[:bs], self.fa3_splits)
        with self._attention(), torch.no_grad():
            out = self.model(
                input_ids=buf.ids[:bs],
                position_ids=buf.positions[:bs],
                attention_mask=mask,
                use_cache=True,
                **{self._cache_kwarg: self._view(bs)},
                **extra,
            )
        return out.logits.reshape(bs * t, -1)

    def prepare(self, phase: str, n: int, bs: int, generator: torch.Generator) -> None:
        """Random valid inputs for ``bs`` rows: token ids, one write position
        shared by the batch (a static cache writes every row at the same
        slot), and per row a random history length below it, expressed by
        the mask (each new token sees that history and the new tokens up to
        itself). With FA3 every row's history is the whole of it (module
        docstring); the same draws are made, so the token ids are those of the
        model's own attention."""
        t = self.tokens[phase]
        buf = self._buffers[t]
        dev = self.device
        pos = torch.randint(0, self.max_seqlen - t + 1, (), generator=generator, device=dev)
        buf.ids[:bs].random_(0, self.vocab, generator=generator)
        history = (torch.rand(bs, generator=generator, device=dev) * (pos + 1).float()).long()  # 0..pos
        if buf.seqlens is not None:
            history = pos.expand(bs)
        self._place(buf, bs, pos, history)

    def _place(self, buf: _Buffers, bs: int, pos: torch.Tensor, history: torch.Tensor) -> None:
        """Write position ``pos`` (a 0-d tensor), the positions of the new tokens
        and the masks: row ``i``'s token ``j`` sees the slots below
        ``history[i]`` and the new tokens up to itself; in sliding-window
        layers only those less than a window behind it (position ``q`` sees
        ``q - window < slot <= q``, as transformers' sliding masks). With FA3,
        each row's length: the slots before ``pos`` and the new tokens."""
        t, dev = buf.ids.shape[1], self.device
        self.position.copy_(pos)
        if buf.seqlens is not None:
            buf.seqlens[:bs].copy_((pos + t).expand(bs))
        steps = torch.arange(t, device=dev)
        buf.positions[:bs].copy_((pos + steps).expand(bs, t))
        slot = torch.arange(self.max_seqlen, device=dev)[None, None, :]
        seen = slot < history[:, None, None]
        new = (slot >= pos) & (slot <= pos + steps[None, :, None])
        allowed = seen | new  # (bs, t, max_seqlen)
        low = torch.finfo(self.dtype).min
        buf.mask[:bs] = torch.where(allowed, 0.0, low).to(self.dtype)[:, None]
        if buf.window_mask is not None:
            # a window mask exists only where self.window is set (_allocate_cache)
            near = slot > pos + steps[None, :, None] - self.window  # pyright: ignore[reportOperatorIssue]
            buf.window_mask[:bs] = torch.where(allowed & near, 0.0, low).to(self.dtype)[:, None]

    def refresh(self, phase: str, n: int, bs: int, workspace: torch.Tensor) -> None:
        """Nothing to hoist: transformers' attention has no per-call workspace, and FA3's
        scheduler metadata is computed inside the graph (in the pool) here."""

    # -- an engine's profiling forward ---------------------------------------------
    def profile_hidden(self, ids: torch.Tensor) -> torch.Tensor:
        """The forward an engine's profiling run makes over ``ids`` (any number of new
        tokens, one sequence, positions from 0): the model's own layers with attention
        skipped, its output zeros (vLLM's profile_run: ``_dummy_run(..., skip_attn=True)``,
        whose attention backends, given no metadata, return ``output.fill_(0)``). The
        attention function is swapped for :func:`_skipped_attention` while it runs (a
        registered ``AttentionInterface``), and a one-element 4-D mask is passed, which
        transformers' mask code returns as it is: no ``n x n`` mask is built. No cache is
        read or written (``use_cache=False``). Returns the final-normed hidden states
        ``(n, hidden)``; the LM head is not applied."""
        from transformers import AttentionInterface  # pyright: ignore[reportMissingImports]

        AttentionInterface.register(SKIPPED_ATTENTION, _skipped_attention)
        config = self.model.config
        saved = config._attn_implementation
        n = ids.shape[0]
        positions = torch.arange(n, device=ids.device)[None]
        mask = torch.zeros(1, 1, 1, 1, dtype=self.dtype, device=self.device)
        config._attn_implementation = SKIPPED_ATTENTION
        try:
            with torch.no_grad():
                out = self.model.base_model(
                    input_ids=ids[None], position_ids=positions, attention_mask=mask, use_cache=False
                )
        finally:
            config._attn_implementation = saved
        return out.last_hidden_state[0]

    # -- pieces --------------------------------------------------------------
    def _allocate_cache(self, max_bs: int, layer_types: list | None) -> None:
        """Allocate every layer of the static cache now, outside any graph pool,
        with the shapes the model itself writes, and find the sliding window.

        Those shapes are read from one eager step of batch 1 with a dynamic
        cache, not from the config: MLA attention (DeepSeek-V3, Kimi K2)
        caches its compressed latent as one head, ``kv_lora_rank`` wide in the
        "keys" and ``qk_rope_head_dim`` wide in the "values" (transformers
        5.17-5.24 expand them to per-head keys and values after the cache),
        which neither the config's heads nor its ``head_dim`` describe.
        ``StaticCache``'s own ``early_initialization`` takes one head count
        and one head dim from the caller, and the first decode step then
        failed in ``index_copy_``.

        Every layer, sliding or not, gets ``max_seqlen`` slots written at their
        absolute positions: transformers' sliding layers (a ring of
        ``window`` slots) branch on a host-side counter and roll the ring,
        which a captured graph would freeze at the branch it took. The window
        is applied by the mask instead (``_place``). Memory: a sliding layer
        holds ``max_seqlen`` slots, not ``window``.

        Refused (ValueError): a layer whose state transformers allocates only
        at its first use (linear attention, e.g. Qwen3-Next's Gated DeltaNet
        layers): that allocation would land in the first capture's pool;
        sliding layers of different windows narrower than the cache (one
        window mask serves them all); a chunked-attention layer (Llama 4)
        whose chunk is narrower than the cache (its mask is not a window).
        """
        from transformers.cache_utils import DynamicCache, StaticLayer  # pyright: ignore[reportMissingImports]

        lazy = [
            (i, type(layer).__name__)
            for i, layer in enumerate(self.cache.layers)
            if not getattr(layer, "supports_early_init", True)
        ]
        if lazy:
            raise ValueError(
                f"cache layer {lazy[0][0]} is a {lazy[0][1]}, whose state transformers allocates at "
                "its first use (inside the first capture's pool); HFTarget supports attention layers "
                "with a key/value cache only"
            )
        probe = DynamicCache(config=self.model.config)
        ids = torch.zeros(1, 1, dtype=torch.long, device=self.device)
        with torch.no_grad():
            self.model(input_ids=ids, use_cache=True, **{self._cache_kwarg: probe})
        if len(probe.layers) != len(self.cache.layers):
            raise ValueError(
                f"the model wrote {len(probe.layers)} cache layers, the static cache has "
                f"{len(self.cache.layers)}: layers that share a cache are not supported"
            )
        windows: list[int | None] = []
        for i, seen in enumerate(probe.layers):
            w = getattr(seen, "sliding_window", None) if getattr(seen, "is_sliding", False) else None
            kind = layer_types[i] if layer_types else ("sliding_attention" if w is not None else "full_attention")
            if w is not None and w < self.max_seqlen and kind != "sliding_attention":
                raise ValueError(
                    f"layer {i} is {kind} over {w} tokens < max_seqlen {self.max_seqlen}: HFTarget "
                    "masks sliding windows only; lower max_seqlen"
                )
            windows.append(w if kind == "sliding_attention" else None)
        narrow = sorted({w for w in windows if w is not None})
        if narrow and narrow[0] < self.max_seqlen:
            if len(narrow) > 1:
                raise ValueError(
                    f"sliding windows {narrow} with max_seqlen {self.max_seqlen}: one window mask "
                    "serves every sliding layer; lower max_seqlen to at most the smallest"
                )
            self.window, self._mixed = narrow[0], None in windows
        # transformers types layers as a list of its layer mixins, some without keys and values
        # (linear attention); these are StaticLayers, and the probe's ran: their tensors exist
        self.cache.layers = [StaticLayer(max_cache_len=self.max_seqlen) for _ in probe.layers]  # pyright: ignore[reportAttributeAccessIssue]
        for layer, seen in zip(self.cache.layers, probe.layers):
            k, v = seen.keys, seen.values  # pyright: ignore[reportAttributeAccessIssue]
            # zero-length along the sequence: the layer allocates its full size, nothing else
            layer.lazy_initialization(
                k.new_zeros(max_bs, k.shape[1], 0, k.shape[-1]),  # pyright: ignore[reportOptionalMemberAccess]
                v.new_zeros(max_bs, v.shape[1], 0, v.shape[-1]),  # pyright: ignore[reportOptionalMemberAccess]
            )

    def _attention(self) -> contextlib.AbstractContextManager:
        """The SDPA kernels allowed while the model runs (read at every call, so
        the attribute can be changed between captures); none pinned with FA3."""
        if self.sdpa_backends is None or self._fa3 is not None:
            return contextlib.nullcontext()
        return _pinned(tuple(self.sdpa_backends))

    def _view(self, bs: int):
        """The cache seen by the graph of batch ``bs``: rows ``[:bs]`` of the one
        static cache. Shallow copies allocate no device memory, so one made
        during a capture puts nothing in the pool."""
        view = self._views.get(bs)
        if view is None:
            view = copy.copy(self.cache)
            view.layers = []
            for layer in self.cache.layers:
                lv = copy.copy(layer)
                # StaticLayers (see _allocate_cache), whose attributes transformers' types do not declare
                lv.keys, lv.values = layer.keys[:bs], layer.values[:bs]  # pyright: ignore[reportAttributeAccessIssue, reportOptionalSubscript]
                if hasattr(lv, "batch_size"):
                    lv.batch_size = bs  # pyright: ignore[reportAttributeAccessIssue]
                view.layers.append(lv)
            self._views[bs] = view
        return view


#: the attention implementation :meth:`HFTarget.profile_hidden` registers: attention skipped
SKIPPED_ATTENTION = "capture_plan_skipped"


def _skipped_attention(module, query, key, value, attention_mask, **kwargs):
    """An attention function that attends to nothing: zeros shaped as transformers' attention
    functions return them (``(batch, tokens, heads, head_dim)``), no weights."""
    b, h, s, _ = query.shape
    return query.new_zeros(b, s, h, value.shape[-1]), None


#: the attention implementation ``HFTarget(attention="fa3")`` registers, and the keyword its
#: ``run`` passes the FA3 module, the rows' lengths and the split count under
FA3_ATTENTION = "capture_plan_fa3"


def _fa3_attention(module, query, key, value, attention_mask, scaling=None, softcap=None, sliding_window=None, **kw):
    """transformers' attention call answered by FA3's ``flash_attn_with_kvcache`` over the
    whole static cache (``key``/``value``: the layer's cache, ``(bs, kv_heads, max_seqlen,
    head_dim)``, the new tokens already written at the write position), read through
    transposed views, each row up to its length, causally over the new tokens; ``scaling``,
    ``softcap`` (Gemma2's logit soft-capping) and a ``sliding_window`` narrower than the
    cache are passed on (FA3's window ``(w - 1, 0)`` is transformers' ``q - w < slot <=
    q``). Returns ``(bs, tokens, heads, head_dim)`` and no weights, as transformers'
    attention functions do."""
    fa3, seqlens, splits = kw[FA3_ATTENTION]
    window = sliding_window if sliding_window and sliding_window < key.shape[2] else None
    out = fa3.flash_attn_with_kvcache(
        query.transpose(1, 2),
        key.transpose(1, 2),
        value.transpose(1, 2),
        cache_seqlens=seqlens,
        causal=True,
        softmax_scale=scaling,
        window_size=(-1, -1) if window is None else (window - 1, 0),
        softcap=softcap or 0.0,
        num_splits=splits,
    )
    return (out[0] if isinstance(out, tuple) else out), None


def _check_experts(model) -> None:
    """Refuse MoE experts that route on the host.

    transformers runs a MoE block's experts through ``experts_implementation``:
    ``grouped_mm`` (its default where the kernel exists) and ``batched_mm``
    route on the device, the same kernels for any routing; ``eager`` loops
    over the experts that received tokens (``nonzero()`` read on the host),
    so a graph would replay the routing of the batch it was captured with.
    Experts classes are recognised by what transformers' experts decorator
    adds to them (``_apply_gate``); a MoE block that transformers does not
    route through that decorator is not checked here.
    """
    for name, module in model.named_modules():
        if hasattr(type(module), "_apply_gate") and getattr(module, "config", None) is not None:
            impl = getattr(module.config, "_experts_implementation", None)
            if impl == "eager":
                raise ValueError(
                    f"{name}: experts_implementation 'eager' routes tokens on the host (a captured graph "
                    "would replay one batch's routing); load the model with "
                    "experts_implementation='grouped_mm' or 'batched_mm'"
                )
            return


# -- the process-wide SDPA pin -------------------------------------------------
_pin_lock = threading.Lock()
_pin_users = 0
_pin_exit: contextlib.ExitStack | None = None


@contextlib.contextmanager
def _pinned(backends: tuple[str, ...]):
    """PyTorch's global SDPA flags set to ``backends`` while any pinned run is
    active: the first to enter sets them, the last to leave restores them."""
    global _pin_users, _pin_exit
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with _pin_lock:
        if _pin_users == 0:
            stack = contextlib.ExitStack()
            stack.enter_context(sdpa_kernel([getattr(SDPBackend, b) for b in backends]))
            _pin_exit = stack
        _pin_users += 1
    try:
        yield
    finally:
        with _pin_lock:
            _pin_users -= 1
            if _pin_users == 0:
                stack, _pin_exit = _pin_exit, None
                stack.close()  # pyright: ignore[reportOptionalMemberAccess]  # set while there are users
