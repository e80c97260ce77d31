"""Speculative-decoding reference workload (EAGLE-style), with plantable bugs.

A :class:`~capture_plan.executor.target.CaptureTarget` with the four phases of an EAGLE
plan, run as an engine runs them, over one set of static buffers shared by
every phase (request slots, cache lengths, accepted lengths, the engine's
``req_to_token`` table and the target's hidden states handed to the draft):

* ``decode`` -- the target over one token per request;
* ``target_verify`` -- the target over ``num_draft_tokens`` tokens per
  request; returns the logits of every token and the last layer's hidden
  states (the draft reads them);
* ``draft_decode`` -- ``num_steps`` draft steps inside one graph, ``topk``
  candidates per request and step; each step builds the draft's
  ``kv_indices`` (rows of ``draft_kv_width`` token locations, one row per
  branch -- ``bs * topk`` of them -- holding the branch's draft tokens so
  far: the per-branch level of cascade attention, whose shared level is the
  request's context) and attends over the request's context;
* ``draft_extend`` -- the draft over ``num_steps + 1`` tokens per request
  of which the first ``accept_lens`` are real; returns the top-k of the last
  accepted token and its hidden state.

Every phase builds its KV metadata inside the graph from the per-request
cache locations, as engines do: a page table ``req_to_token[slot, ::page] //
page`` whose first page gives the cache row (the FA3 forward build here has
no paged-KV kernel, so attention runs over a contiguous cache through
``cache_batch_idx``; the page table still decides which row is read). With
``page_size > 1`` the draft also scatters its ``num_steps`` new token
locations into a page table of its own. Padded batch rows carry the engine's
sentinel slot -1 and are mapped to a spare cache row that no request uses.

The metadata kernels exist twice (:mod:`capture_plan.references.speculative_kernels`):
Triton kernels (on CUDA; the engine's way, and the only place bugs can be planted) and
plain torch (the specification, used on the CPU; a GPU test checks that both agree).
The small reference of the planted-bug tests and a planted-bug run in a process of its
own are :mod:`capture_plan.references.planted`'s.

**Planted bugs** (``bugs=...``; off by default), each written the way the
real ones were -- an unmasked Triton store with flat index arithmetic:

* ``kv-indices-topk`` -- the draft ``kv_indices`` buffer is allocated
  (inside the graph, so in the pool) for ``bs`` rows instead of
  ``bs * topk`` and written with ``bs * topk`` rows: it spills into the
  neighbouring pool memory (dormant at ``topk == 1``);
* ``page-table-scatter`` -- with ``page_size > 1``, the draft's page table
  (one row of ``draft_page_cols`` pages per branch) is allocated
  with only ``decode_length + 1`` (2) columns, sized for a one-token decode,
  while the ``num_steps``-wide scatter of the new token locations (and the
  read that follows it) still use the full row stride: past the buffer, into
  whatever the pool put after it;
* ``wild`` -- ``draft_extend`` records each row's accepted length in a
  per-slot table, reading the raw slot as an unsigned 32-bit index (a
  signed/unsigned mix-up): the padded rows' sentinel -1 becomes 2^32 - 1
  rows of 256 B, about a TiB past the table -- an illegal address that kills
  the CUDA context on the first padded replay. Capture itself survives only
  because the executor never calls ``prepare``: warm-ups run on whatever the
  static buffers hold, which the constructor fills unpadded (a padded
  ``prepare`` before capture makes the warm-up fault).

Not modelled: rotary embeddings, sampling, tree masks (draft steps attend
over the request's context, not over earlier draft tokens), EAGLE's fc over
the concatenated embedding and hidden state (a sum here).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

import msgspec
import torch
import torch.nn.functional as F

from capture_plan.schemas.spec import Model

from .decode import CacheRows, ReferenceConfig, ReferenceModel
from .speculative_kernels import _torch_kv_rows, _torch_page_scatter, _triton_kernels

__all__ = [
    "SpeculativeConfig",
    "SpeculativeModel",
    "BUGS",
    "PHASES",
]

#: the phases of an EAGLE plan, by kind
PHASES = ("decode", "target_verify", "draft_decode", "draft_extend")
BUGS = ("kv-indices-topk", "page-table-scatter", "wild")
#: what the engine writes into the slots of padded batch rows
PAD_SLOT = -1
#: int32 entries per slot of the engine's per-slot speculative state
SLOT_STATE = 64


@dataclass(frozen=True)
class SpeculativeConfig:
    """Shapes of the target (the spec's :class:`~capture_plan.schemas.spec.Model`) and of
    the speculative setup. ``phases`` maps the plan's phase names to kinds
    (the EAGLE preset names each phase after its kind)."""

    model: Model = Model()
    draft_layers: int = 1
    max_bs: int = 256
    #: the context limit: cache length of every request slot
    max_seqlen: int = 512
    num_steps: int = 3
    topk: int = 1
    num_draft_tokens: int = 4
    page_size: int = 1
    #: token slots per branch row of the draft's kv_indices (None: num_steps). Wider rows
    #: make the planted kv-indices-topk overflow larger: measured on an H200, 64 slots made
    #: the eager warm-up itself hit an illegal address now and then (past a segment's end)
    draft_kv_width: int | None = None
    #: pages per branch row of the draft's page table (page_size > 1)
    draft_page_cols: int = 16
    bugs: frozenset = frozenset()
    phases: dict = field(default_factory=lambda: {p: p for p in PHASES})
    seed: int = 0
    #: the target's and the draft's weights drawn into tensors of their own segments
    #: (references/decode.py ReferenceConfig.own_segments)
    own_segments: bool = False
    #: FA3's split count for the target's and the draft's attention (ReferenceConfig.fa3_splits;
    #: 0: FA3's heuristic)
    fa3_splits: int = 0

    def __post_init__(self):
        unknown = set(self.bugs) - set(BUGS)
        if unknown:
            raise ValueError(f"unknown planted bug(s) {sorted(unknown)}; known: {list(BUGS)}")
        if min(self.num_steps, self.topk, self.num_draft_tokens, self.page_size, self.draft_layers) < 1:
            raise ValueError("num_steps, topk, num_draft_tokens, page_size and draft_layers must be >= 1")
        if self.draft_kv_width is not None and self.draft_kv_width < self.num_steps:
            raise ValueError(f"draft_kv_width {self.draft_kv_width} cannot hold num_steps {self.num_steps} tokens")
        if self.draft_page_cols < max(2, self.num_steps if self.page_size > 1 else 0):
            raise ValueError(f"draft_page_cols {self.draft_page_cols} cannot hold num_steps {self.num_steps} pages")
        longest = max(self.num_draft_tokens, self.num_steps + 1)
        if self.max_seqlen <= longest:
            raise ValueError(
                f"max_seqlen {self.max_seqlen} leaves no context before the longest phase's {longest} new tokens"
            )
        if self.max_seqlen % self.page_size:
            raise ValueError(f"max_seqlen {self.max_seqlen} is not a multiple of page_size {self.page_size}")

    def tokens(self, kind: str) -> int:
        """Tokens per request a phase of this kind runs."""
        return {
            "decode": 1,
            "target_verify": self.num_draft_tokens,
            "draft_decode": 1,
            "draft_extend": self.num_steps + 1,
        }[kind]


class SpeculativeModel:
    """The CaptureTarget; see the module docstring. ``backend`` as for
    :class:`~capture_plan.references.decode.ReferenceModel`."""

    def __init__(self, cfg: SpeculativeConfig, backend: str = "auto", device: str | torch.device = "cuda"):
        self.cfg = cfg
        #: planted bugs in effect (a benchmark may change them between captures)
        self.bugs = frozenset(cfg.bugs)
        self.device = torch.device(device)
        if cfg.bugs and self.device.type != "cuda":
            raise ValueError("planted bugs are Triton kernels: they need a CUDA device")
        slots = cfg.max_bs + 1  # the last row is the padding rows' spare
        self.pad_row = cfg.max_bs
        toks = {k: cfg.tokens(k) for k in PHASES}
        # the target and the draft: the same slots, cache length and weight drawing, their own seeds
        config = ReferenceConfig(
            model=cfg.model,
            max_bs=slots,
            max_seqlen=cfg.max_seqlen,
            tokens=toks,
            seed=cfg.seed,
            own_segments=cfg.own_segments,
            fa3_splits=cfg.fa3_splits,
        )
        self.target = ReferenceModel(config, backend, self.device)
        draft_shape = msgspec.structs.replace(cfg.model, layers=cfg.draft_layers)
        draft_config = replace(config, model=draft_shape, seed=cfg.seed + 1)
        self.draft = ReferenceModel(draft_config, backend, self.device)
        self.draft.embed = self.target.embed  # EAGLE shares the target's embedding; its lm_head is its own
        self.backend = self.target.backend
        self.kernels = _triton_kernels() if self.device.type == "cuda" else None
        if cfg.bugs and self.kernels is None:
            raise ValueError("planted bugs are Triton kernels: triton is not importable")
        dev, m = self.device, cfg.model
        max_tokens = cfg.max_bs * max(toks.values()) * cfg.topk
        i32: dict[str, Any] = dict(dtype=torch.int32, device=dev)
        self.input_ids = torch.zeros(max_tokens, dtype=torch.long, device=dev)
        self.req_pool_indices = torch.arange(cfg.max_bs, **i32)
        self.seq_lens = torch.ones(cfg.max_bs, **i32)
        self.accept_lens = torch.ones(cfg.max_bs, **i32)
        #: token location of every (slot, position): a flat token pool, one
        #: contiguous run per slot (read-only lookup table)
        self.req_to_token = torch.arange(slots * cfg.max_seqlen, **i32).view(slots, cfg.max_seqlen)
        #: target hidden states for draft_extend, and draft_extend's results
        #: for draft_decode (the engine copies them between phases)
        self.spec_hidden = torch.zeros(max_tokens, m.hidden, dtype=torch.bfloat16, device=dev)
        self.draft_ids = torch.zeros(cfg.max_bs * cfg.topk, dtype=torch.long, device=dev)
        self.draft_hidden = torch.zeros(cfg.max_bs * cfg.topk, m.hidden, dtype=torch.bfloat16, device=dev)
        self.draft_scores = torch.ones(cfg.max_bs * cfg.topk, dtype=torch.float32, device=dev)
        #: per-slot accepted lengths the engine keeps (draft_extend writes them)
        self.slot_accept = torch.zeros(slots, SLOT_STATE, **i32)
        self._md_len: dict[tuple[str, int], int] = {}
        self._gen = torch.Generator(device=dev)
        self._gen.manual_seed(cfg.seed + 7)
        self.prepare(self._kind_name("decode"), cfg.max_bs, cfg.max_bs, self._gen)

    def _kind_name(self, kind: str) -> str:
        return next((p for p, k in self.cfg.phases.items() if k == kind), kind)

    def kind(self, phase: str) -> str:
        try:
            return self.cfg.phases[phase]
        except KeyError:
            raise ValueError(f"unknown phase {phase!r}; this target has {sorted(self.cfg.phases)}") from None

    def read_only(self) -> dict[str, torch.Tensor]:
        """Tensors no graph may write: weights and the engine's lookup table
        (``verify`` checksums them around every replay). The KV caches are
        written by design and are not listed."""
        out = {"req_to_token": self.req_to_token, "embed": self.target.embed}
        for name, model in (("target", self.target), ("draft", self.draft)):
            out[f"{name}.lm_head"] = model.lm_head
            out[f"{name}.final_norm"] = model.final_norm
            for i, layer in enumerate(model.layers):
                for key in ("norm1", "norm2", "wqkv", "wo", "wgu", "wd"):
                    out[f"{name}.layers.{i}.{key}"] = layer[key]
        return out

    # -- CaptureTarget -------------------------------------------------------
    def prepare(self, phase: str, n: int, bs: int, generator: torch.Generator) -> None:
        """Random valid inputs for ``n`` requests in distinct slots; rows
        ``n..bs`` are padding (sentinel slot). Cache lengths reach the context
        limit: the longest phase's tokens still fit."""
        self._check_bs(bs)
        if not 1 <= n <= bs:
            raise ValueError(f"{n} requests do not fit a batch of {bs}")
        cfg, dev = self.cfg, self.device
        self.input_ids.random_(0, cfg.model.vocab, generator=generator)
        perm = torch.randperm(cfg.max_bs, generator=generator, device=dev).to(torch.int32)
        self.req_pool_indices[:n].copy_(perm[:n])
        self.req_pool_indices[n:bs].fill_(PAD_SLOT)
        room = cfg.max_seqlen - max(cfg.num_draft_tokens, cfg.num_steps + 1)
        self.seq_lens[:bs].copy_(torch.randint(1, room + 1, (bs,), generator=generator, device=dev, dtype=torch.int32))
        self.accept_lens[:bs].copy_(
            torch.randint(1, cfg.num_steps + 2, (bs,), generator=generator, device=dev, dtype=torch.int32)
        )
        self.spec_hidden.normal_(generator=generator)
        self.draft_hidden.normal_(generator=generator)
        self.draft_ids.random_(0, cfg.model.vocab, generator=generator)
        self.draft_scores.uniform_(0.1, 1.0, generator=generator)

    def refresh(self, phase: str, n: int, bs: int, workspace: torch.Tensor) -> None:
        """FA3's scheduler metadata for the phase's attention calls, computed
        outside the graph into the hoisted buffer (``draft_decode``'s steps
        each see other lengths, so its plans keep the workspace in the pool)."""
        if self.target.fa3 is None:
            return
        kind = self.kind(phase)
        if kind == "draft_decode":
            raise ValueError("draft_decode cannot use a hoisted workspace: each step's lengths differ")
        model = self.draft if kind == "draft_extend" else self.target
        self._md_len[(phase, bs)] = model.scheduler_metadata(bs, self.cfg.tokens(kind), self.seq_lens[:bs], workspace)

    def _check_bs(self, bs: int) -> None:
        if not 1 <= bs <= self.cfg.max_bs:
            raise ValueError(f"batch {bs} is outside 1..max_bs={self.cfg.max_bs} of this target")

    def run(self, phase: str, bs: int, workspace: torch.Tensor | None):
        self._check_bs(bs)
        kind = self.kind(phase)
        md = None
        if workspace is not None and self.target.fa3 is not None:
            md = workspace.view(torch.int32)[: self._md_len[(phase, bs)]]
        if kind in ("decode", "target_verify"):
            return self._target(kind, bs, md)
        if kind == "draft_extend":
            return self._draft_extend(bs, md)
        return self._draft_decode(bs)

    # -- phases --------------------------------------------------------------
    def _target(self, kind: str, bs: int, md):
        tpr = self.cfg.tokens(kind)
        rows = CacheRows(self._cache_rows(bs), self.seq_lens[:bs])
        h = F.embedding(self.input_ids[: bs * tpr], self.target.embed)
        for layer in self.target.layers:
            h = self.target._layer(layer, h, bs, tpr, md, rows)
        logits = self.target._logits(h)
        return logits if kind == "decode" else (logits, h)

    def _draft_extend(self, bs: int, md):
        t = self.cfg.num_steps + 1
        slots = self._cache_rows(bs)
        rows = CacheRows(slots, self.seq_lens[:bs])
        h = self._draft_input(self.input_ids[: bs * t], self.spec_hidden[: bs * t])
        for layer in self.draft.layers:
            h = self.draft._layer(layer, h, bs, t, md, rows)
        last = h.view(bs, t, -1)[torch.arange(bs, device=h.device), self.accept_lens[:bs].long() - 1]
        probs = torch.softmax(self.draft._logits(last), dim=-1)
        top = probs.topk(self.cfg.topk, dim=-1)
        self._record_accept(bs)
        return top.indices, top.values, last

    def _draft_decode(self, bs: int):
        cfg = self.cfg
        k, rows = cfg.topk, bs * cfg.topk
        seqlens = self.seq_lens[:bs].repeat_interleave(k)
        locs = self._draft_locations(bs)
        # In place (no allocation, so the graph's memory is unchanged): a stray
        # write into these lengths (the planted page-table overflow lands on them
        # in eager runs) must give wrong draft tokens, not an attention read past
        # the cache that ends the process.
        seqlens.clamp_(1, cfg.max_seqlen - cfg.num_steps)
        ids, hidden, scores = self.draft_ids[:rows], self.draft_hidden[:rows], self.draft_scores[:rows]
        out_ids = torch.empty(bs, cfg.num_steps * k, dtype=torch.long, device=self.device)
        out_scores = torch.empty(bs, cfg.num_steps * k, dtype=torch.float32, device=self.device)
        for step in range(cfg.num_steps):
            ids, hidden, scores = self._draft_step(bs, step, ids, hidden, scores, seqlens)
            out_ids[:, step * k : (step + 1) * k] = ids.view(bs, k)
            out_scores[:, step * k : (step + 1) * k] = scores.view(bs, k)
        return out_ids, out_scores, locs

    def _draft_step(self, bs, step, ids, hidden, scores, seqlens):
        k = self.cfg.topk
        rows = CacheRows(self._draft_kv_rows(bs, step), seqlens + step, append=False)
        h = self._draft_input(ids, hidden)
        for layer in self.draft.layers:
            h = self.draft._layer(layer, h, bs * k, 1, None, rows)
        probs = torch.softmax(self.draft._logits(h), dim=-1)
        top = probs.topk(k, dim=-1)  # (bs*k, k) children of every row
        joint = (top.values * scores[:, None]).view(bs, k * k)
        best = joint.topk(k, dim=-1)  # the k best paths of each request
        parent = (best.indices // k + torch.arange(bs, device=h.device)[:, None] * k).view(-1)
        child = top.indices.view(bs, k * k).gather(1, best.indices).view(-1)
        return child, h[parent], best.values.view(-1)

    def _draft_input(self, ids, hidden):
        # Clamped as a defensive engine does: a stray write into the ids (the
        # planted bugs do that during warm-up, outside any pool) must give
        # wrong draft tokens, not a device assert that ends the process.
        return F.embedding(ids.clamp(0, self.cfg.model.vocab - 1), self.draft.embed) + hidden

    # -- KV metadata built inside the graph ----------------------------------
    def _slots(self, bs: int) -> torch.Tensor:
        """int32 cache row per batch row: padded rows (sentinel) use the spare row."""
        s = self.req_pool_indices[:bs]
        return torch.where(s < 0, self.pad_row, s)

    def _cache_rows(self, bs: int) -> torch.Tensor:
        """The page table of the batch, then each row's cache row from its first page."""
        page = self.cfg.page_size
        table = self.req_to_token[self._slots(bs).long(), ::page] // page
        return (table[:, 0] * page // self.cfg.max_seqlen).to(torch.int32)

    def _draft_kv_rows(self, bs: int, step: int) -> torch.Tensor:
        """Build the step's ``kv_indices`` (each branch's ``step + 1`` draft
        token locations in a row of ``draft_kv_width``), then read each
        branch's cache row from its first entry."""
        cfg, k = self.cfg, self.cfg.topk
        width = cfg.draft_kv_width or cfg.num_steps
        alloc_rows = bs if "kv-indices-topk" in self.bugs else bs * k
        kv = torch.empty(alloc_rows * width, dtype=torch.int32, device=self.device)
        slots = self._slots(bs)
        if self.kernels is None:
            rows = _torch_kv_rows(self.req_to_token, slots, self.seq_lens[:bs], step, kv, k, width)
        else:
            rows = self.kernels.kv_rows(
                self.req_to_token, slots, self.seq_lens[:bs], step, kv, k, width, cfg.max_seqlen
            )
        return rows.clamp(0, self.pad_row)  # a corrupted row must not send attention out of the cache

    def _draft_locations(self, bs: int) -> torch.Tensor:
        """Token locations of every row's ``num_steps`` draft tokens, (bs, steps*k).

        With ``page_size > 1`` they pass through the draft's page table: the
        new pages are scattered into it and read back (the bug class lives in
        that scatter)."""
        cfg, k = self.cfg, self.cfg.topk
        slots = self._slots(bs).long().repeat_interleave(k)
        pos = self.seq_lens[:bs].long().repeat_interleave(k)[:, None] + torch.arange(cfg.num_steps, device=self.device)
        locs = self.req_to_token[slots[:, None], pos].long()  # (rows, steps)
        if cfg.page_size == 1:
            return locs.view(bs, -1)
        stride = cfg.draft_page_cols  # pages per branch row
        cols = 2 if "page-table-scatter" in self.bugs else stride  # decode_length + 1 vs the row's pages
        table = torch.empty(bs * k * cols, dtype=torch.int32, device=self.device)
        if self.kernels is None:
            pages = _torch_page_scatter(locs, table, stride, cfg.page_size)
        else:
            pages = self.kernels.page_scatter(locs, table, stride, cfg.page_size)
        return (pages.long() * cfg.page_size + locs % cfg.page_size).view(bs, -1)

    def _record_accept(self, bs: int) -> None:
        """Keep each request's accepted length in the per-slot table."""
        if self.kernels is None:
            slots = self._slots(bs).long()
            self.slot_accept[:, 0].index_copy_(0, slots, self.accept_lens[:bs])
            return
        wild = "wild" in self.bugs
        slots = self.req_pool_indices[:bs] if wild else self._slots(bs)
        self.kernels.record_accept(slots, self.accept_lens[:bs], self.slot_accept, wild)
