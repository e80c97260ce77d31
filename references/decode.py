"""Reference workload: a Llama-shaped decode step with random weights.

For tests, benchmarks and as the integration example: it implements
:class:`capture_plan.executor.target.CaptureTarget` the way an engine would (static input
buffers, a KV cache, outputs allocated inside the step). Attention is FA3's
``flash_attn_with_kvcache`` (official ``flash_attn_interface``, else the
``fa3_fwd_interface`` wheel) appending the new K/V in place; where FA3 is
missing it falls back to torch SDPA over the cache. Phases: ``decode`` (one
token per request) and multi-token phases such as ``target_verify``.

With a hoisted workspace, FA3's scheduler metadata is computed outside the
graph by ``refresh`` into the hoisted buffer (it depends on the sequence
lengths, so it runs before every replay) and passed to the kernel; otherwise
FA3 allocates it inside the graph, in the pool.

Not modelled: rotary embeddings, paged KV, sampling. ``profile_hidden`` is the one forward
over any number of new tokens (an engine's profiling run: attention skipped). With ``tp_group`` set,
attention heads and the MLP are split over ranks (column/row parallel) with an
all-reduce after the O and down projections, inside the graph.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from capture_plan.executor.fa3 import load_fa3
from capture_plan.schemas.spec import Model

__all__ = ["ReferenceConfig", "ReferenceModel", "CacheRows"]


@dataclass(frozen=True)
class ReferenceConfig:
    """The model's shape is the spec's own :class:`capture_plan.schemas.spec.Model` (bf16
    activations and float32 logits are fixed here, as in the default spec)."""

    model: Model = Model()
    max_bs: int = 256
    max_seqlen: int = 512
    #: tokens per request of each phase
    tokens: dict = field(default_factory=lambda: {"decode": 1, "target_verify": 4})
    seed: int = 0
    #: FA3's ``num_splits`` for its scheduler metadata and its calls (0: FA3's own heuristic;
    #: vLLM's FULL graphs pass ``max_num_splits``, 32, whose split-KV accumulators each call
    #: then allocates)
    fa3_splits: int = 0
    #: draw each weight and cache into a tensor of its own allocated first, its float32 draw
    #: given back to the device at once (an engine loads its weights into tensors of their
    #: size); False: the draw is cast into a new tensor, and the freed draws' space is split
    #: by the next tensors, leaving free space pinned in their segments (reserved by torch,
    #: not allocated: used memory to a free-memory reading; 1-2 GiB at 32 layers in the
    #: allocator model, planner/memory/allocator.py). The values are the same either way
    own_segments: bool = False


def _rmsnorm(x: torch.Tensor, w: torch.Tensor, eps: float = 1e-5) -> torch.Tensor:
    # Deliberately unfused (float32 upcast), like the analytic memory model.
    x32 = x.float()
    var = x32.pow(2).mean(-1, keepdim=True)
    return (x32 * torch.rsqrt(var + eps)).to(x.dtype) * w


@dataclass(frozen=True)
class CacheRows:
    """Which KV-cache rows a batch attends over (engines with a request pool).

    ``index``: int32 cache row per batch row (FA3's ``cache_batch_idx``);
    ``seqlens``: int32 cached tokens per batch row; ``append``: write the new
    K/V at ``seqlens`` (False: attend read-only, as a draft step over the
    request's context does).
    """

    index: torch.Tensor
    seqlens: torch.Tensor
    append: bool = True


class ReferenceModel:
    """A CaptureTarget. ``backend``: "auto" (FA3 if importable), "fa3" or "torch"."""

    def __init__(self, cfg: ReferenceConfig, backend: str = "auto", device: str | torch.device = "cuda", tp_group=None):
        self.cfg = cfg
        m = cfg.model
        self.device = torch.device(device)
        self.tp_group = tp_group
        tp = torch.distributed.get_world_size(tp_group) if tp_group is not None else 1
        if m.heads % tp or m.intermediate % tp or max(m.kv_heads, tp) % min(m.kv_heads, tp):
            raise ValueError(
                f"tp={tp} does not divide heads={m.heads}, kv_heads={m.kv_heads}, intermediate={m.intermediate}"
            )
        self.tp = tp
        self.heads = m.heads // tp
        self.kv_heads = max(1, m.kv_heads // tp)
        self.inter = m.intermediate // tp
        self.head_dim = m.head_dim
        fa3 = load_fa3() if backend in ("auto", "fa3") else None
        if backend == "fa3" and fa3 is None:
            raise ImportError("FA3 requested but neither flash_attn_interface nor fa3_fwd_interface is importable")
        self.fa3 = fa3
        self.backend = "fa3" if fa3 is not None else "torch"
        g = torch.Generator(device=self.device)
        g.manual_seed(cfg.seed + 1000 * (torch.distributed.get_rank(tp_group) if tp_group is not None else 0))
        dt = torch.bfloat16
        hd, H, KV = m.head_dim, self.heads, self.kv_heads

        def w(*shape, std=0.02):
            if not cfg.own_segments:
                return (torch.randn(*shape, generator=g, device=self.device, dtype=torch.float32) * std).to(dt)
            out = torch.empty(*shape, device=self.device, dtype=dt)
            draw = torch.randn(*shape, generator=g, device=self.device, dtype=torch.float32)
            out.copy_(draw.mul_(std))  # the same float32 product, cast as .to casts it
            del draw
            if self.device.type == "cuda":
                torch.cuda.empty_cache()  # the draw's segment back to the device, not split later
            return out

        self.embed = w(m.vocab, m.hidden, std=1.0)
        self.lm_head = w(m.vocab, m.hidden)
        self.final_norm = torch.ones(m.hidden, device=self.device, dtype=dt)
        self.layers = []
        for _ in range(m.layers):
            self.layers.append(
                dict(
                    norm1=torch.ones(m.hidden, device=self.device, dtype=dt),
                    norm2=torch.ones(m.hidden, device=self.device, dtype=dt),
                    wqkv=w((H + 2 * KV) * hd, m.hidden),
                    wo=w(m.hidden, H * hd),
                    wgu=w(2 * self.inter, m.hidden),
                    wd=w(m.hidden, self.inter),
                    k_cache=w(cfg.max_bs, cfg.max_seqlen, KV, hd, std=1.0),
                    v_cache=w(cfg.max_bs, cfg.max_seqlen, KV, hd, std=1.0),
                )
            )
        max_tokens = cfg.max_bs * max(cfg.tokens.values())
        self.input_ids = torch.zeros(max_tokens, dtype=torch.long, device=self.device)
        self.cache_seqlens = torch.ones(cfg.max_bs, dtype=torch.int32, device=self.device)
        self._md_len: dict[tuple[str, int], int] = {}
        self._gen = torch.Generator(device=self.device)
        self._gen.manual_seed(cfg.seed + 7)
        self.prepare("decode", cfg.max_bs, cfg.max_bs, self._gen)

    # -- CaptureTarget -------------------------------------------------------
    def prepare(self, phase: str, n: int, bs: int, generator: torch.Generator) -> None:
        tpr = self.cfg.tokens[phase]
        self.input_ids[: bs * tpr].random_(0, self.cfg.model.vocab, generator=generator)
        # room for the longest phase's new tokens: the prepared lengths may be
        # replayed by any phase (they share the static buffers)
        hi = self.cfg.max_seqlen - max(self.cfg.tokens.values())
        seqlens = torch.randint(1, hi + 1, (bs,), generator=generator, device=self.device, dtype=torch.int32)
        self.cache_seqlens[:bs].copy_(seqlens)

    def refresh(self, phase: str, n: int, bs: int, workspace: torch.Tensor) -> None:
        if self.fa3 is None:
            return
        self._md_len[(phase, bs)] = self.scheduler_metadata(
            bs, self.cfg.tokens[phase], self.cache_seqlens[:bs], workspace
        )

    def scheduler_metadata(self, bs: int, tpr: int, seqlens: torch.Tensor, workspace: torch.Tensor) -> int:
        """Write FA3's scheduler metadata for this model's attention over ``tpr``
        new tokens per request into the hoisted ``workspace``; returns its int32 length."""
        # called only with FA3 loaded (refresh returns early without it)
        md = self.fa3.get_scheduler_metadata(  # pyright: ignore[reportOptionalMemberAccess]
            bs,
            tpr,
            self.cfg.max_seqlen,
            self.heads,
            self.kv_heads,
            self.head_dim,
            seqlens,
            qkv_dtype=torch.bfloat16,
            headdim_v=self.head_dim,
            max_seqlen_k_new=tpr,
            causal=True,
            num_splits=self.cfg.fa3_splits,
        )
        buf = workspace.view(torch.int32)
        if md.numel() > buf.numel():
            raise ValueError(
                f"FA3 scheduler metadata needs {md.numel() * 4} B at bs={bs}, "
                f"the hoisted workspace has {workspace.numel()} B"
            )
        buf[: md.numel()].copy_(md)
        return md.numel()

    def run(self, phase: str, bs: int, workspace: torch.Tensor | None) -> torch.Tensor:
        tpr = self.cfg.tokens[phase]
        md = None
        if workspace is not None and self.fa3 is not None:
            md = workspace.view(torch.int32)[: self._md_len[(phase, bs)]]
        h = F.embedding(self.input_ids[: bs * tpr], self.embed)
        for layer in self.layers:
            h = self._layer(layer, h, bs, tpr, md)
        return self._logits(h)

    # -- an engine's profiling forward ------------------------------------------
    def profile_hidden(self, ids: torch.Tensor) -> torch.Tensor:
        """The forward an engine's profiling run makes over ``ids`` (any number of new
        tokens, one row each): every layer's norms, projections and MLP over the rows,
        attention skipped, its output zeros (vLLM's profile_run: ``_dummy_run(...,
        skip_attn=True)``, whose attention backends, given no metadata, return
        ``output.fill_(0)``: v1/attention/backends/flash_attn.py); returns the final-normed
        hidden states (the logits are computed apart, on the sampled rows:
        :meth:`compute_logits`). The KV cache is neither read nor written."""
        h = F.embedding(ids, self.embed)
        for layer in self.layers:
            h = self._layer(layer, h, 1, ids.shape[0], None, skip_attention=True)
        return _rmsnorm(h, self.final_norm)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The LM head over final-normed hidden states, in the model's dtype (vLLM's
        ``compute_logits``; the sampler makes its own float32 copy)."""
        return hidden @ self.lm_head.t()

    # -- pieces --------------------------------------------------------------
    # Each piece is a function so that its temporaries die when it returns:
    # the allocation pattern is then the one planner/memory/analytic.py models.
    def _layer(
        self, layer, h: torch.Tensor, bs: int, tpr: int, md, rows: CacheRows | None = None, skip_attention=False
    ) -> torch.Tensor:
        hd, H, KV = self.head_dim, self.heads, self.kv_heads
        x = _rmsnorm(h, layer["norm1"])
        qkv = x @ layer["wqkv"].t()
        q, k, v = qkv.split([H * hd, KV * hd, KV * hd], dim=-1)
        if skip_attention:  # profile_hidden: the attention output allocated and zeroed, as vLLM's
            attn = torch.zeros(bs, tpr, H, hd, dtype=q.dtype, device=q.device)
        else:
            attn = self._attention(
                layer, q.view(bs, tpr, H, hd), k.view(bs, tpr, KV, hd), v.view(bs, tpr, KV, hd), bs, md, rows
            )
        o = attn.reshape(bs * tpr, H * hd) @ layer["wo"].t()
        self._all_reduce(o)
        res = h + o
        x2 = _rmsnorm(res, layer["norm2"])
        gate_up = x2 @ layer["wgu"].t()
        gate, up = gate_up.chunk(2, dim=-1)
        d = (F.silu(gate) * up) @ layer["wd"].t()
        self._all_reduce(d)
        return res + d

    def _logits(self, h: torch.Tensor) -> torch.Tensor:
        x = _rmsnorm(h, self.final_norm)
        logits = x @ self.lm_head.t()
        return logits.float()

    def _all_reduce(self, t: torch.Tensor) -> None:
        if self.tp_group is not None:
            torch.distributed.all_reduce(t, group=self.tp_group)

    def _attention(self, layer, q, k, v, bs: int, md, rows: CacheRows | None = None) -> torch.Tensor:
        if rows is None:  # request i owns cache row i
            kc, vc, idx = layer["k_cache"][:bs], layer["v_cache"][:bs], None
            seqlens, append = self.cache_seqlens[:bs], True
        else:
            kc, vc, idx, seqlens, append = layer["k_cache"], layer["v_cache"], rows.index, rows.seqlens, rows.append
        if self.fa3 is not None:
            new = dict(k=k, v=v) if append else {}
            out = self.fa3.flash_attn_with_kvcache(
                q,
                kc,
                vc,
                **new,
                cache_seqlens=seqlens,
                cache_batch_idx=idx,
                causal=True,
                scheduler_metadata=md,
                num_splits=self.cfg.fa3_splits,
            )
            return out[0] if isinstance(out, tuple) else out
        # SDPA fallback: append K/V at each request's position, then attend with a mask.
        tpr = q.shape[1]
        pos = seqlens.long()[:, None] + torch.arange(tpr, device=q.device)[None, :]
        crow = (torch.arange(bs, device=q.device) if idx is None else idx.long())[:, None].expand(bs, tpr)
        if append:
            kc[crow, pos] = k
            vc[crow, pos] = v
        else:  # read-only: the query rows sit right after the cached tokens
            pos = pos - tpr
        if idx is not None:
            kc, vc = kc[idx.long()], vc[idx.long()]
        L = kc.shape[1]
        keys = torch.arange(L, device=q.device)[None, None, :]
        mask = keys <= pos[:, :, None]  # (bs, tpr, L): causal over the cache
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), kc.transpose(1, 2), vc.transpose(1, 2), attn_mask=mask[:, None], enable_gqa=True
        )
        return out.transpose(1, 2)
