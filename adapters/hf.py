"""``HFTarget``: a transformers causal LM's decode step as a ``CaptureTarget``.

Maps a Hugging Face model onto the executor's contract the way an engine's
model runner does (see README, "Engine adapters"):

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
tensor, so transformers builds none itself (its mask code reads tensor values
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
(tests/test_adapters_cpu.py checks that op by op). The models bench's
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

Constraints: the model is in eval mode on one device; sliding-window layers
must have a window of at least ``max_seqlen`` (the cache never rolls: a
rolling window's update branches on a host-side counter, which a captured
graph would freeze), and their host-side write counter is reset by ``run``
on the batch's shared cache view, so a model with sliding-window layers must
not run the same batch size on two threads at once (a background capture
with the eager fallback can: use ``fallback="wait"`` for such models).
Linear-attention layers (Qwen3-Next) are refused: transformers allocates
their state at first use, inside the first capture's pool. Tested with
transformers 5.17 and 5.24 on CPU (tests/test_adapters_cpu.py: Llama,
Mixtral, Qwen2-MoE, Qwen3-MoE, DeepSeek-V3, GPT-OSS, GLM-4-MoE, Mistral,
Gemma2 built from tiny configs) and with 5.17 on an H200 for Llama,
Mixtral, Qwen2-MoE and Gemma2 (tests/test_gpu_adapters.py).
What it does not do: paged KV, sampling, tensor parallelism, prefill, a
rolling sliding window.
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import threading
from dataclasses import dataclass

import torch

__all__ = ["HFTarget", "DETERMINISTIC_SDPA"]

#: ``torch.nn.attention.SDPBackend`` names the adapter allows by default: those
#: PyTorch keeps in deterministic mode (all but cuDNN attention), in its order.
DETERMINISTIC_SDPA = ("FLASH_ATTENTION", "EFFICIENT_ATTENTION", "MATH")


@dataclass
class _Buffers:
    """Static inputs for one tokens-per-request value."""

    ids: torch.Tensor  # (max_bs, t) long
    positions: torch.Tensor  # (max_bs, t) long
    mask: torch.Tensor  # (max_bs, 1, t, max_seqlen) model dtype, additive


class HFTarget:
    """A CaptureTarget for ``model`` (a ``*ForCausalLM``).

    ``tokens``: tokens per request of each phase (``{"decode": 1}``; a
    ``target_verify`` phase would be 4). ``max_bs`` and ``max_seqlen`` size
    the cache and the buffers. ``sdpa_backends``: the ``SDPBackend`` names
    ``run`` allows (default :data:`DETERMINISTIC_SDPA`), or ``None`` for
    PyTorch's own dispatch.
    """

    def __init__(self, model, *, max_bs: int = 256, max_seqlen: int = 512, tokens: dict | None = None,
                 seed: int = 0, sdpa_backends: tuple[str, ...] | None = DETERMINISTIC_SDPA):
        from torch.nn.attention import SDPBackend
        from transformers import StaticCache

        unknown = [b for b in (sdpa_backends or ()) if not hasattr(SDPBackend, b)]
        if sdpa_backends is not None and (unknown or not len(sdpa_backends)):
            raise ValueError(f"sdpa_backends {tuple(sdpa_backends)!r}: expected None or names of "
                             f"torch.nn.attention.SDPBackend such as {DETERMINISTIC_SDPA}")
        self.sdpa_backends = sdpa_backends

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
        short = [layer.max_cache_len for layer in self.cache.layers
                 if getattr(layer, "is_sliding", False) and layer.max_cache_len < max_seqlen]
        if short:
            raise ValueError(f"sliding_window {short[0]} < max_seqlen {max_seqlen}: the static cache would roll, "
                             "which a captured graph cannot follow; lower max_seqlen")
        self._allocate_cache(max_bs)
        # Each layer's write position, reset from `position` at every run. The
        # counters are views of one tensor, so the reset is a single copy.
        self._counters = torch.zeros(len(self.cache.layers), dtype=torch.long, device=self.device)
        for i, layer in enumerate(self.cache.layers):
            layer.cumulative_length = self._counters[i]
        self.position = torch.zeros((), dtype=torch.long, device=self.device)
        self._views: dict[int, object] = {}
        self._buffers = {t: _Buffers(
            ids=torch.zeros(max_bs, t, dtype=torch.long, device=self.device),
            positions=torch.zeros(max_bs, t, dtype=torch.long, device=self.device),
            mask=torch.zeros(max_bs, 1, t, max_seqlen, dtype=self.dtype, device=self.device))
            for t in set(self.tokens.values())}
        gen = torch.Generator(device=self.device)
        gen.manual_seed(seed)
        for phase in self.tokens:
            self.prepare(phase, max_bs, max_bs, gen)

    # -- CaptureTarget -------------------------------------------------------
    def run(self, phase: str, bs: int, workspace: torch.Tensor | None) -> torch.Tensor:
        t = self.tokens[phase]
        buf = self._buffers[t]
        self._counters.copy_(self.position.expand_as(self._counters))
        for layer in self._view(bs).layers:
            if hasattr(layer, "cumulative_length_int"):  # sliding layers also count on the host
                layer.cumulative_length_int = 0
        with self._attention(), torch.no_grad():
            out = self.model(input_ids=buf.ids[:bs], position_ids=buf.positions[:bs], attention_mask=buf.mask[:bs],
                             use_cache=True, **{self._cache_kwarg: self._view(bs)})
        return out.logits.reshape(bs * t, -1)

    def prepare(self, phase: str, n: int, bs: int, generator: torch.Generator) -> None:
        """Random valid inputs for ``bs`` rows: token ids, one write position
        shared by the batch (a static cache writes every row at the same
        slot), and per row a random history length below it, expressed by
        the mask (each new token sees that history and the new tokens up to
        itself)."""
        t = self.tokens[phase]
        buf = self._buffers[t]
        dev = self.device
        pos = torch.randint(0, self.max_seqlen - t + 1, (), generator=generator, device=dev)
        self.position.copy_(pos)
        buf.ids[:bs].random_(0, self.vocab, generator=generator)
        steps = torch.arange(t, device=dev)
        buf.positions[:bs].copy_((pos + steps).expand(bs, t))
        history = (torch.rand(bs, generator=generator, device=dev) * (pos + 1).float()).long()  # 0..pos
        slot = torch.arange(self.max_seqlen, device=dev)
        seen = slot[None, None, :] < history[:, None, None]
        new = (slot[None, None, :] >= pos) & (slot[None, None, :] <= pos + steps[None, :, None])
        allowed = (seen | new)[:, None]  # (bs, 1, t, max_seqlen)
        buf.mask[:bs] = torch.where(allowed, 0.0, torch.finfo(self.dtype).min).to(self.dtype)

    def refresh(self, phase: str, n: int, bs: int, workspace: torch.Tensor) -> None:
        """Nothing to hoist: transformers' attention has no per-call workspace."""

    # -- pieces --------------------------------------------------------------
    def _allocate_cache(self, max_bs: int) -> None:
        """Allocate every layer of the static cache now, outside any graph pool,
        with the shapes the model itself writes.

        Those shapes are read from one eager step of batch 1 with a dynamic
        cache, not from the config: MLA attention (DeepSeek-V3, Kimi K2)
        caches its compressed latent as one head, ``kv_lora_rank`` wide in the
        "keys" and ``qk_rope_head_dim`` wide in the "values" (transformers
        5.17-5.24 expand them to per-head keys and values after the cache),
        which neither the config's heads nor its ``head_dim`` describe.
        ``StaticCache``'s own ``early_initialization`` takes one head count
        and one head dim from the caller, and the first decode step then
        failed in ``index_copy_``.

        Refused (ValueError): a layer whose state transformers allocates only
        at its first use (linear attention, e.g. Qwen3-Next's Gated DeltaNet
        layers): that allocation would land in the first capture's pool.
        """
        from transformers import DynamicCache

        lazy = [(i, type(layer).__name__) for i, layer in enumerate(self.cache.layers)
                if not getattr(layer, "supports_early_init", True)]
        if lazy:
            raise ValueError(f"cache layer {lazy[0][0]} is a {lazy[0][1]}, whose state transformers allocates at "
                             "its first use (inside the first capture's pool); HFTarget supports attention layers "
                             "with a key/value cache only")
        probe = DynamicCache(config=self.model.config)
        ids = torch.zeros(1, 1, dtype=torch.long, device=self.device)
        with torch.no_grad():
            self.model(input_ids=ids, use_cache=True, **{self._cache_kwarg: probe})
        if len(probe.layers) != len(self.cache.layers):
            raise ValueError(f"the model wrote {len(probe.layers)} cache layers, the static cache has "
                             f"{len(self.cache.layers)}: layers that share a cache are not supported")
        for layer, seen in zip(self.cache.layers, probe.layers):
            k, v = seen.keys, seen.values
            # zero-length along the sequence: the layer allocates its full size, nothing else
            layer.lazy_initialization(k.new_zeros(max_bs, k.shape[1], 0, k.shape[-1]),
                                      v.new_zeros(max_bs, v.shape[1], 0, v.shape[-1]))

    def _attention(self) -> contextlib.AbstractContextManager:
        """The SDPA kernels allowed while the model runs (read at every call, so
        the attribute can be changed between captures)."""
        if self.sdpa_backends is None:
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
                lv.keys, lv.values = layer.keys[:bs], layer.values[:bs]
                if hasattr(lv, "batch_size"):
                    lv.batch_size = bs
                view.layers.append(lv)
            self._views[bs] = view
        return view


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
                raise ValueError(f"{name}: experts_implementation 'eager' routes tokens on the host (a captured graph "
                                 "would replay one batch's routing); load the model with "
                                 "experts_implementation='grouped_mm' or 'batched_mm'")
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
                stack.close()
