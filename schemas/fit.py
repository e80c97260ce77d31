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

__all__ = ["FitItem", "KvLayerType", "SizeCost", "FitResult", "FIT_SCHEMA_VERSION"]

FIT_SCHEMA_VERSION = 1

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
    #: "engine default", "fewer", "none", "plan"
    name: str
    sizes: list[int]
    graph_bytes: int | None
    kv_tokens: int | None
    #: tokens this set costs against capturing no graphs (None: unknown)
    tokens_cost: int | None


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
