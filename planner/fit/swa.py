"""SGLang's KV pool for a model's layer types: one pool over every layer, or the hybrid
sliding-window (SWA) pool split between the full and the sliding-window layers
(planner/data/fit_rules.toml [swa.*], each fact's file and function named there).

SGLang 0.5.23 splits the pool only for the architectures ``is_hybrid_swa_model`` lists (or
a config that opts in), less those an override keeps in one pool (Gemma 2 and 3, Olmo2) and
less ``--disable-hybrid-swa-memory``. Every other model is sized by DefaultPoolConfigurator:
every layer, sliding-window ones included, holds every token (Gemma 2, Mistral: the window
is not used). The split (HybridSWAPoolConfigurator): a full-side token costs the full
layers' bytes and ``ratio`` x the sliding layers'; the full pool holds ``available //`` that
many tokens, page-aligned, the sliding pool ``int(full x ratio)``, page-aligned, and a
sliding pool of no more than the window and a page refuses to start, the window the one
SGLang resolves (the model class's: the config's sliding_window less one for most; Llama 4's
attention_chunk_size, its split by position: every 4th layer full).
"""

from __future__ import annotations

import msgspec

from capture_plan.schemas.fit import KvLayerType

from .inputs import FitInputs
from .model import FitModel
from .refusal import Refusal
from .tables import SwaRule, swa_rule

__all__ = ["Pool", "sglang_pool"]

#: the engine's flags of the split
RATIO_FLAG = "swa-full-tokens-ratio"
DISABLE_FLAG = "disable-hybrid-swa-memory"


class Pool(msgspec.Struct, frozen=True):
    """How the pool prices the tokens it holds."""

    #: KV bytes one token takes in the full layers (one pool: in every layer)
    full_bytes: int
    #: in the sliding-window layers (0: one pool)
    sliding_bytes: int
    #: sliding-window tokens per full-side token; None: one pool
    ratio: float | None
    #: the window SGLang checks the sliding pool against (resolve_sliding_window_size: the
    #: config's sliding_window, less one for most model classes; 0: one pool)
    window: int
    #: what fit says of the pool (a note)
    note: str
    #: the layer types the split prices, where they are not the model's own (Llama 4's chunked
    #: attention); None: the model's
    kv_layers: list[KvLayerType] | None = None

    @property
    def cell(self) -> float:
        """Bytes one full-side token costs (HybridSWAPoolConfigurator._cell_size)."""
        return self.full_bytes if self.ratio is None else self.full_bytes + self.ratio * self.sliding_bytes

    def tokens(self, kv_bytes: int, page: int) -> tuple[int, int]:
        """(full-side tokens, sliding-window tokens: 0 for one pool) in ``kv_bytes``, as
        calculate_pool_sizes rounds them."""
        avail = max(kv_bytes, 0)
        if self.ratio is None:
            return avail // self.full_bytes // page * page, 0
        full = int(avail // self.cell) // page * page
        return full, int(full * self.ratio) // page * page

    def holds_window(self, kv_bytes: int, page: int) -> bool:
        """validate_swa_pool_size: a sliding pool of window + page tokens or fewer admits no
        request (it raises where ``sliding_window_size + page_size >= swa_tokens``)."""
        return self.ratio is None or self.tokens(kv_bytes, page)[1] > self.window + page

    def window_fixes(self, kv_bytes: int, page: int) -> list[str]:
        """Where the sliding pool holds no request: the smallest swa-full-tokens-ratio (in
        hundredths, up to 1) under which it does, then one pool."""
        assert self.ratio is not None
        for hundredths in range(int(self.ratio * 100) + 1, 101):
            if msgspec.structs.replace(self, ratio=hundredths / 100).holds_window(kv_bytes, page):
                return [f"--{RATIO_FLAG} {hundredths / 100}", f"--{DISABLE_FLAG}"]
        return [f"--{DISABLE_FLAG}"]


def _hybrid(inp: FitInputs) -> tuple[str, str]:
    """(the architecture that gives ``inp``'s model the split pool, "") or ("", why it has one pool)."""
    m, rule = inp.model, swa_rule(inp.engine, inp.version)
    if rule is None:
        return "", f"{inp.engine} {inp.version} has no hybrid sliding-window pool"
    if inp.flags.get(DISABLE_FLAG):
        return "", f"--{DISABLE_FLAG}"
    first = m.architectures[0] if m.architectures else ""
    if first in rule.disabled_for and (not rule.disabled_for[first] or rule.disabled_for[first] in m.config_keys):
        return "", f"an override keeps {first} in one pool"
    for arch in m.architectures:
        if arch in rule.architectures and (arch not in rule.needs_sliding_layers or m.sliding_layers):
            return arch, ""
    if rule.opt_in_key in m.config_keys:
        return first or m.name, ""
    return "", f"{first or 'its config'} is not a hybrid SWA architecture"


class _Split(msgspec.Struct, frozen=True):
    """The layers of each side of a hybrid model's pool and the window SGLang checks."""

    full: int
    sliding: int
    #: the window validate_swa_pool_size checks (resolve_sliding_window_size)
    window: int
    #: what the sliding side's layers are, as the note says them
    what: str
    #: their layer type, as fit's table names it
    kind: str = "sliding window"


def _split(m: FitModel, rule: SwaRule, arch: str) -> _Split:
    """``m``'s layer split and window as SGLang resolves them for ``arch``: by position with
    Llama 4's attention_chunk_size as the window (``full_every``), else the config's layers and
    window, less one where the model class converts HF's inclusive window (``exclusive_window``)
    or the class's own (``fixed_window``)."""
    every = next((rule.full_every[a] for a in m.architectures if a in rule.full_every), 0)
    if every:
        full = sum(1 for i in range(m.layers) if (i + 1) % every == 0)
        what = f"chunked-attention layers' (attention_chunk_size {m.attention_chunk:,}, every {every}th layer full)"
        return _Split(full, m.layers - full, m.attention_chunk, what, "chunked attention")
    window = m.sliding_window - 1 if arch in rule.exclusive_window else m.sliding_window
    window = rule.fixed_window.get(arch, window)
    return _Split(m.full_layers, m.sliding_layers, window, "sliding-window layers'")


def _unmodelled(inp: FitInputs, arch: str, split: _Split) -> str:
    """Why fit cannot split ``inp``'s pool as the release does ("": it can)."""
    m = inp.model
    rule = swa_rule(inp.engine, inp.version)
    assert rule is not None
    by_position = any(a in rule.full_every for a in m.architectures)
    if not by_position and not any(a in rule.layer_types_architectures for a in m.architectures):
        return f"{arch}'s layer split is not read from its layer_types (configs/model_config.py get_hybrid_layer_ids)"
    if by_position and not m.attention_chunk:
        return (
            "its config gives no attention_chunk_size (a positive integer), the window SGLang checks "
            "(transformers' default is not read)"
        )
    if not split.sliding:
        return "fit reads no sliding-window layers from its config"
    if not split.full:
        return "every layer slides: the release sizes the sliding-window pool alone"
    if m.mla:
        return "its sliding-window layers cache an MLA latent"
    given = [k for k in rule.geometry_keys if k in m.config_keys]
    if given:
        return f"its config gives the sliding-window layers their own geometry ({', '.join(given)})"
    return ""


def sglang_pool(inp: FitInputs) -> Pool:
    """``inp``'s pool under its SGLang release: a split fit does not model is a
    :class:`.refusal.Refusal` whose change is ``--disable-hybrid-swa-memory`` (one pool)."""
    m, per = inp.model, inp.per_layer
    arch, one_pool = _hybrid(inp)
    if not arch:
        note = ""
        if m.sliding_layers:
            note = (
                f"SGLang {inp.version} keeps every layer in one KV pool ({one_pool}: DefaultPoolConfigurator): "
                f"the {m.sliding_layers} sliding-window layers hold every token, as the full ones do"
            )
        return Pool(per * m.layers, 0, None, 0, note)
    rule = swa_rule(inp.engine, inp.version)
    assert rule is not None
    split = _split(m, rule, arch)
    why = _unmodelled(inp, arch, split)
    if why:
        raise Refusal(
            f"SGLang {inp.version} splits {m.name}'s KV pool between its full and sliding-window layers "
            f"({arch} is a hybrid SWA model), a split fit does not model for it: {why}",
            where="--engine",
            hint="price the one pool SGLang keeps over every layer under --disable-hybrid-swa-memory",
            changes={DISABLE_FLAG: True},
        )
    ratio = inp.flags.get(RATIO_FLAG, rule.ratio)
    note = (
        f"SGLang {inp.version} splits the KV pool ({arch}, HybridSWAPoolConfigurator): a token costs the "
        f"{split.full} full layers' bytes and swa-full-tokens-ratio {ratio} x the {split.sliding} "
        f"{split.what}; KV tokens are the full layers'"
    )
    dtype = inp.kv_layers[0].dtype_bytes
    kinds = [KvLayerType("full attention", split.full, per, dtype), KvLayerType(split.kind, split.sliding, per, dtype)]
    return Pool(per * split.full, per * split.sliding, ratio, split.window, note, kinds)
