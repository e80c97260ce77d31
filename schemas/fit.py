"""``planner fit --json``: where a device's memory goes for one engine release and its settings.

Versioned (``schema_version``); printed by ``planner schema fit``. Every figure is an
:class:`FitItem` naming its source and error bar; ``status`` says how it was obtained:
``exact`` (the model's config and the release's rule alone), ``rule`` (the release's own
arithmetic over other items), ``estimated`` (from the nearest measured item, with a wider
error bar), ``given`` (a flag, or a figure the engine logged), ``measured`` (a calibration report
measured on the device, with its narrow error bar) or ``unknown`` (nothing measured is near:
``bytes`` is null, never zero).
"""

from __future__ import annotations

from typing import Literal

import msgspec

__all__ = ["FitItem", "KvLayerType", "SizeCost", "FitTraffic", "Speculative", "FitResult", "FIT_SCHEMA_VERSION"]

#: 2: ``speculative`` (the draft's method, weights and KV, and the KV tokens without it);
#: 3: ``traffic`` and each size cost's ``padding_pct`` (``planner fit --traffic``), the
#: "traffic front K" rows
FIT_SCHEMA_VERSION = 3

Status = Literal["exact", "rule", "estimated", "given", "measured", "unknown"]


class FitItem(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    name: str
    bytes: int | None
    error_bytes: int | None
    status: Status
    source: str


class KvLayerType(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    #: "full attention", "sliding window", "chunked attention" (Llama 4 under SGLang) or "MLA latent"
    kind: str
    layers: int
    #: KV bytes one token takes in one layer on one rank, in the KV cache dtype
    bytes_per_token: int
    dtype_bytes: int


class SizeCost(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    #: "engine default", "plan", "traffic front K" (the traffic's best list of K sizes), "fewer", "none"
    name: str
    sizes: list[int]
    graph_bytes: int | None
    kv_tokens: int | None
    #: tokens this set costs against capturing no graphs (None: unknown)
    tokens_cost: int | None
    #: under ``--traffic``: the padded tokens a step runs with these sizes, % of the traffic's own
    #: tokens (:attr:`FitTraffic.cost`); None: no traffic, or a step above the largest size (it
    #: runs without a graph)
    padding_pct: float | None = None


class FitTraffic(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """The traffic ``--traffic`` gave (planner/sizes/traffic.py's forms), and how its front's
    lists (the size costs named "traffic front K") were chosen and shown."""

    #: the file as named, and the sha256 of its bytes
    source: str
    sha256: str
    #: "csv", "json" or "prometheus"
    form: str
    steps: float
    #: the engine's largest capture size: every front list ends with it
    largest: int
    #: the sizes the front's lists are chosen from
    candidates: str
    #: the step cost the front is chosen by and the padding is of, in words (an estimate, not measured)
    cost: str
    #: which counts of sizes are shown
    shown: str
    #: how the counts were read, where that is not exact (a histogram's buckets spread)
    notes: list[str] = []


class Speculative(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Speculative decoding's draft as the release loads and sizes it (the ``draft weights``
    item holds its bytes)."""

    #: the engine's method (vLLM's ngram, draft_model, eagle, eagle3; SGLang's NGRAM,
    #: STANDALONE, EAGLE, EAGLE3)
    method: str
    #: the draft model as given ("" where the method has none)
    draft: str
    #: tokens one step proposes (vLLM num_speculative_tokens, SGLang num_draft_tokens)
    tokens: int
    #: the draft's attention layers in the KV cache (0: it keeps no KV)
    draft_layers: int
    #: the draft's KV bytes one token takes on one rank, all its layers
    draft_kv_bytes_per_token: int
    #: KV tokens and max concurrency the same settings give without speculative decoding (at
    #: the same graph figure): what the draft costs
    kv_tokens_without: int | None
    max_concurrency_without: float | None
    #: the fit_rules.toml [speculative] row followed
    source: str


class FitResult(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    schema_version: int
    engine: str
    version: str
    #: the planner/data/fit_rules.toml row this release follows, and its wheel's sha256
    rule: str
    wheel_sha256: str
    device: str
    model: str
    tp: int
    #: the engine's settings under its own flag names, defaults resolved as the release does
    settings: dict[str, str | int | float | bool]
    items: list[FitItem]
    kv_layers: list[KvLayerType]
    kv_bytes: int | None
    #: vLLM's blocks (block_size tokens each) or SGLang's pages (page_size tokens)
    kv_blocks: int | None
    block_tokens: int
    kv_tokens: int | None
    #: requests at max-model-len (context-length) the KV cache holds at once
    max_concurrency: float | None
    max_model_len: int
    size_costs: list[SizeCost]
    fits: bool
    #: one line: the item that overflows and the fixes that work (empty when it fits)
    overflow: str = ""
    fixes: list[str] = []
    notes: list[str] = []
    #: speculative decoding's draft (None: none)
    speculative: Speculative | None = None
    #: ``--traffic``: the traffic the size costs' padding is of (None: none given)
    traffic: FitTraffic | None = None
