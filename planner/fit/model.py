"""A model as `planner fit` sizes it: dimensions, layer types, KV bytes per token, weight bytes.

The dimensions come from :mod:`capture_plan.planner.inputs.hf_config` (one reader of
transformers configs: aliases, MoE fields, multimodal wrappers, every error located);
this module reads only the keys fit needs beyond them, each named where it is read:

* layer types: ``layer_types`` where the config lists them; Gemma-2's alternation
  (transformers' ``Gemma2DecoderLayer``: even layers slide), Gemma-3's
  ``sliding_window_pattern``, a ``sliding_window`` on every layer of Mistral-style
  configs (``use_sliding_window`` false switches it off, as Qwen2's config does);
* MLA (DeepSeek-V2/V3): ``kv_lora_rank`` and ``qk_rope_head_dim`` (the cached latent),
  ``q_lora_rank``, ``qk_nope_head_dim``, ``v_head_dim`` (the projections' weights);
* MoE: ``first_k_dense_replace`` (DeepSeek's dense first layers), shared experts;
* ``quantization_config``: fp8 (1 byte per linear weight, per-tensor or block scales),
  AWQ/GPTQ (``bits`` per weight, a 16-bit scale and a ``bits`` zero per ``group_size``);
* ``tie_word_embeddings``, ``max_position_embeddings`` (the rotary cache vLLM keeps);
* ``architectures`` and the text config's keys given (what an engine keys its KV pool on:
  SGLang's hybrid sliding-window pool, :mod:`.swa`);
* the context length's keys and rope rows, as the engines read them (:mod:`.context`).

Weight bytes are counted from these dimensions (embeddings, attention, MLP or experts,
norms, the untied head) unless a safetensors index gives the checkpoint's exact
``metadata.total_size``; the engine's rotary cos/sin cache (a buffer in no checkpoint) is
counted beside either. Tensor parallelism divides the sharded
weights by ``tp`` (norms are replicated; embeddings are vocab-parallel) and KV heads by
``tp`` (at least one per rank: vLLM and SGLang replicate a head when ``tp`` exceeds the
KV heads). Biases other than Qwen2's q/k/v are not counted (a few MiB at most).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import msgspec

from capture_plan.planner.inputs.hf_config import model_from_config
from capture_plan.planner.inputs.specs import model_presets
from capture_plan.schemas.errors import InputError

from .context import ContextConfig, config_int, read_config

if TYPE_CHECKING:
    from capture_plan.schemas.spec import Model

__all__ = [
    "replicated_bytes",
    "FitModel",
    "load_model",
    "from_spec",
    "from_dimensions",
    "kv_bytes_per_token",
    "weight_bytes",
    "rotary_cache_bytes",
    "KV_DTYPES",
]

#: ``--kv-cache-dtype`` values and their element size (auto: the model's dtype)
KV_DTYPES = {"auto": 0, "bfloat16": 2, "float16": 2, "fp8": 1, "fp8_e4m3": 1, "fp8_e5m2": 1}


class FitModel(msgspec.Struct, frozen=True):
    """The dimensions fit reads, per the whole model (before tensor parallelism)."""

    name: str
    model_type: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    v_head_dim: int
    intermediate: int
    vocab: int
    dtype_bytes: int
    tie_embeddings: bool = False
    sliding_layers: int = 0
    sliding_window: int = 0
    experts: int = 0
    experts_per_token: int = 0
    expert_intermediate: int = 0
    shared_expert_intermediate: int = 0
    dense_layers: int = 0  # MoE models' dense first layers (first_k_dense_replace)
    kv_lora_rank: int = 0  # MLA: the cached latent's width, 0 for ordinary attention
    qk_rope_head_dim: int = 0
    q_lora_rank: int = 0
    qkv_bias: bool = False
    max_positions: int = 0
    rotary_dim: int = 0
    quant_method: str = ""  # "", "fp8", "awq", "gptq"
    quant_bits: int = 16
    quant_group: int = 128
    exact_weight_bytes: int = 0  # a safetensors index's total_size, 0 when none
    source: str = ""
    #: what its config.json says of its context length (planner/fit/context.py); None: no config
    context: ContextConfig | None = None
    #: its config.json's ``architectures`` (none: no config)
    architectures: tuple[str, ...] = ()
    #: its text config's keys given a value other than null or false, sorted
    config_keys: tuple[str, ...] = ()
    #: its text config's attention_chunk_size (Llama 4's chunked attention; 0: none given)
    attention_chunk: int = 0
    #: its text config's num_nextn_predict_layers (a NextN/MTP draft checkpoint's own layers,
    #: where num_hidden_layers is the target's; 0: none given)
    nextn_layers: int = 0
    #: what both engines key a rotary cache on besides its sizes and dtype: the rope theta and
    #: the other rope parameters, as text (:func:`_rope_of`; none: no config)
    rope: tuple[tuple[str, str], ...] = ()
    #: the dtype SGLang runs it at by default (--dtype auto: :func:`_auto_dtype`; "": no config)
    dtype: str = ""
    #: an EAGLE3 head's draft_vocab_size, its own lm_head's rows (0: not given)
    draft_vocab: int = 0
    #: an EAGLE3 head's target_hidden_size, the width of the target states it reads (0: not given)
    target_hidden: int = 0

    @property
    def mla(self) -> bool:
        return self.kv_lora_rank > 0

    @property
    def full_layers(self) -> int:
        return self.layers - self.sliding_layers


def _int(cfg: dict, key: str, where: str, default: int = 0) -> int:
    v = config_int(cfg, key, where)
    return default if v is None else v


def _sliding(cfg: dict, model_type: str, layers: int, where: str) -> tuple[int, int]:
    """(sliding-window layers, window) as the model's attention layers use them."""
    window = cfg.get("sliding_window")
    if cfg.get("use_sliding_window") is False or not isinstance(window, int) or window <= 0:
        return 0, 0
    types = cfg.get("layer_types")
    if isinstance(types, list) and len(types) == layers:
        return sum(1 for t in types if t == "sliding_attention"), window
    if model_type == "gemma2":  # transformers Gemma2DecoderLayer: is_sliding = not layer_idx % 2
        return (layers + 1) // 2, window
    if model_type == "gemma3_text":
        pattern = _int(cfg, "sliding_window_pattern", where, 6)
        return sum(1 for i in range(layers) if (i + 1) % pattern), window
    return layers, window  # Mistral-style: every layer slides


def _rope_of(text: dict) -> tuple[tuple[str, str], ...]:
    """The rope settings a rotary cache is keyed on besides its sizes and dtype (vLLM's
    ``get_rope``: ``rope_parameters``; SGLang's: ``base`` and ``rope_scaling``): the rope theta
    (10000 where the config gives none, both engines' default), the rope type ("default" where
    none) and the rope's other parameters, each as text."""
    rope = text.get("rope_parameters") or text.get("rope_scaling") or {}
    params = dict(rope) if isinstance(rope, dict) else {}
    if "type" in params and "rope_type" not in params:
        params["rope_type"] = params.pop("type")
    params.setdefault("rope_type", "default")
    params["rope_theta"] = params.get("rope_theta", text.get("rope_theta", 10000))

    def text_of(v: object) -> str:
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            return repr(float(v))
        return repr(sorted(v.items())) if isinstance(v, dict) else repr(v)

    return tuple(sorted((str(k), text_of(v)) for k, v in params.items()))


def _auto_dtype(cfg: dict, text: dict, model_type: str) -> str:
    """The dtype SGLang's ``--dtype auto`` runs the model at (sglang/srt/configs/model_config.py
    ``_get_and_verify_dtype``: the config's ``dtype`` or ``torch_dtype``; float32 or none runs as
    float16, a Gemma's as bfloat16)."""
    given = next((d.get(k) for d in (text, cfg) for k in ("dtype", "torch_dtype") if d.get(k)), None)
    name = str(given).removeprefix("torch.") if given is not None else "float32"
    if name == "float32":
        return "bfloat16" if model_type.startswith("gemma") else "float16"
    return name


def _draft_vocab(text: dict, where: str) -> int:
    """An EAGLE3 head's ``draft_vocab_size`` (0 where absent or null: both engines then take its
    vocab_size), refused at its path unless a positive integer: vLLM's and SGLang's
    llama_eagle3.py build its lm_head of that many rows."""
    return _head_size(text, "draft_vocab_size", where, "its vocab_size is taken")


def _head_size(text: dict, key: str, where: str, absent: str) -> int:
    """An EAGLE3 head's optional size ``key``: 0 where absent or null (``absent`` says what the
    engines take then), refused at its path unless a positive integer."""
    v = text.get(key)
    if v is None:
        return 0
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise InputError(
            f"{key} must be a positive integer, got {v!r:.40}",
            where=f"{where}: $.{key}",
            fix=f"use the draft's own config.json (or leave {key} out: {absent})",
        )
    return v


def _chunk(cfg: dict) -> int:
    """The text config's attention_chunk_size (Llama 4), 0 where it gives none or no positive
    integer: read only for SGLang's hybrid pool (planner/fit/swa.py), which refuses a 0."""
    v = cfg.get("attention_chunk_size")
    return v if isinstance(v, int) and not isinstance(v, bool) and v > 0 else 0


def _quant(cfg: dict, where: str) -> tuple[str, int, int]:
    q = cfg.get("quantization_config")
    if not isinstance(q, dict):
        return "", 16, 128
    method = str(q.get("quant_method", "")).lower()
    if method == "fp8":
        return "fp8", 8, 128
    if method in ("awq", "gptq"):
        return method, _int(q, "bits", where + ": $.quantization_config", 4), _int(q, "group_size", where, 128) or 128
    raise InputError(
        f"quantization method {method!r} is not modelled",
        where=f"{where}: $.quantization_config.quant_method",
        fix="fit models fp8, awq and gptq checkpoints; give --weights-index for exact weight bytes",
    )


#: model types whose weights or attention fit does not count, and what it lacks
_UNMODELLED = {
    "gpt_oss": "its mxfp4 expert weights (vLLM pads and repacks them per kernel backend) and its attention sinks",
}


def _refuse_unmodelled(cfg: object, where: str) -> None:
    """Refuse, before reading dimensions, a model whose weights or KV fit would get wrong."""
    if not isinstance(cfg, dict):
        return
    model_type = str(cfg.get("model_type", ""))
    q = cfg.get("quantization_config")
    method = str(q.get("quant_method", "")).lower() if isinstance(q, dict) else ""
    if model_type in _UNMODELLED:
        raise InputError(
            f"model type {model_type!r} is not modelled: {_UNMODELLED[model_type]}",
            where=f"{where}: $.model_type",
            fix="fit models dense and MoE models of bf16/fp16, fp8, AWQ and GPTQ weights",
        )
    if method and method not in ("fp8", "awq", "gptq"):
        _quant(cfg, where)


def from_config(cfg: object, where: str, name: str) -> FitModel:
    """A transformers ``config.json`` (already parsed) as fit's model."""
    _refuse_unmodelled(cfg, where)
    m = model_from_config(cfg, where)
    assert isinstance(cfg, dict)
    inner = cfg.get("text_config")
    text: dict = inner if isinstance(inner, dict) else cfg
    model_type = str(text.get("model_type", cfg.get("model_type")))
    sliding, window = _sliding(text, model_type, m.layers, where)
    method, bits, group = _quant(cfg, where)
    kv_lora = _int(text, "kv_lora_rank", where)
    v_head = _int(text, "v_head_dim", where) if kv_lora else m.head_dim
    rope = text.get("rope_parameters") or text.get("rope_scaling") or {}
    partial = text.get("partial_rotary_factor") or (
        rope.get("partial_rotary_factor") if isinstance(rope, dict) else None
    )
    rot = _int(text, "qk_rope_head_dim", where) if kv_lora else int(m.head_dim * (partial or 1.0))

    base = from_dimensions(name, dimensions(m), model_type, where)
    return msgspec.structs.replace(
        base,
        v_head_dim=v_head,
        tie_embeddings=bool(text.get("tie_word_embeddings", cfg.get("tie_word_embeddings", False))),
        sliding_layers=sliding,
        sliding_window=window,
        attention_chunk=_chunk(text),
        nextn_layers=_int(text, "num_nextn_predict_layers", where),
        dense_layers=_int(text, "first_k_dense_replace", where),
        kv_lora_rank=kv_lora,
        qk_rope_head_dim=_int(text, "qk_rope_head_dim", where),
        q_lora_rank=_int(text, "q_lora_rank", where),
        qkv_bias=model_type in ("qwen2", "qwen2_moe"),
        max_positions=_int(text, "max_position_embeddings", where),
        rotary_dim=rot,
        quant_method=method,
        quant_bits=bits,
        quant_group=group,
        context=read_config(text, where, model_type),
        architectures=_architectures(cfg),
        config_keys=tuple(sorted(k for k, v in text.items() if v is not None and v is not False)),
        rope=_rope_of(text),
        dtype=_auto_dtype(cfg, text, model_type),
        draft_vocab=_draft_vocab(text, where),
        # llama_eagle3.py (vLLM and SGLang): fc reads target_hidden_size x 3, else hidden_size x 3
        target_hidden=_head_size(text, "target_hidden_size", where, "its hidden_size is taken"),
    )


def _architectures(cfg: dict) -> tuple[str, ...]:
    """The config's ``architectures`` (the strings of a list; anything else: none)."""
    a = cfg.get("architectures")
    return tuple(x for x in a if isinstance(x, str)) if isinstance(a, list) else ()


def from_spec(path: Path) -> FitModel:
    """A spec TOML's ``[model]`` (read as ``planner build --spec`` reads it): the config.json
    it names, read as ``--model CONFIG`` reads it; else its dimensions (listed, or its
    preset's) as capture-plan's reference decode step has them (references/decode.py):
    model type ``reference``, the family a plan's analytic figures describe (its graph
    nodes, planner/data/fit_estimates.toml [graph]), an untied head, no biases and no
    rotary cache (the reference has no rotary embeddings: ``max_positions`` 0)."""
    from capture_plan.planner.inputs.validate import decode_spec_sources
    from capture_plan.schemas.files import read_input

    raw = read_input(path, "spec", fix="check the path given to --model")
    spec, _ = decode_spec_sources(raw, str(path), presets=model_presets())
    m = spec.model
    if m.config is not msgspec.UNSET:
        return load_model(str(path.parent / m.config))
    return from_dimensions(m.name, dimensions(m), "reference", f"spec {path} (capture-plan's reference decode step)")


def dimensions(m: Model) -> dict[str, int]:
    """A spec's model (schemas/spec.py ``Model``) as its integer fields by name: the MoE ones
    only where given (:func:`from_dimensions` reads an absent one as 0, a dense MLP)."""
    return {k: v for k, v in msgspec.structs.asdict(m).items() if isinstance(v, int) and not isinstance(v, bool)}


def from_dimensions(name: str, d: dict[str, int], model_type: str, source: str) -> FitModel:
    """A model from a spec's dimensions (schemas/spec.py ``Model``'s integer fields by name;
    the MoE ones where given): full attention, V heads as wide as K's, no rotary cache. The
    one reading of a spec's model for fit (``--model SPEC`` and ``build --engine``)."""
    return FitModel(
        name=name,
        model_type=model_type,
        layers=d["layers"],
        hidden=d["hidden"],
        heads=d["heads"],
        kv_heads=d["kv_heads"],
        head_dim=d["head_dim"],
        v_head_dim=d["head_dim"],
        intermediate=d["intermediate"],
        vocab=d["vocab"],
        dtype_bytes=d.get("dtype_bytes", 2),
        experts=d.get("experts", 0),
        experts_per_token=d.get("experts_per_token", 0),
        expert_intermediate=d.get("expert_intermediate", 0),
        shared_expert_intermediate=d.get("shared_expert_intermediate", 0),
        source=source,
    )


def load_model(model: str, weights_index: Path | None = None) -> FitModel:
    """``model``: a preset name (planner/data/presets.toml), a ``config.json`` path or a
    spec TOML (:func:`from_spec`); ``weights_index``: a ``model.safetensors.index.json``
    whose ``metadata.total_size`` is the checkpoint's exact weight bytes."""
    path = Path(model)
    if path.suffix == ".toml":
        fit = from_spec(path)
    elif path.suffix == ".json" or path.is_file():
        from capture_plan.schemas.files import read_input

        raw = read_input(path, "config", fix="give --model the model's config.json")
        cfg = _decode(raw, path, "give --model the model's config.json")
        fit = from_config(cfg, str(path), path.parent.name if path.stem == "config" else path.stem)
    else:
        presets = model_presets()
        if model not in presets:
            raise InputError(
                f"unknown model {model!r}",
                where="--model",
                fix=f"give a config.json path, a spec TOML or a preset: {', '.join(sorted(presets))}",
            )
        fit = from_dimensions(
            model, dimensions(presets[model]), "preset", f"preset {model} (planner/data/presets.toml)"
        )
    if weights_index is not None:
        fit = msgspec.structs.replace(fit, exact_weight_bytes=_index_total(weights_index))
    return fit


def _decode(raw: bytes, path: Path, fix: str) -> object:
    """JSON through msgspec, as every input is read (its depth limit a located error)."""
    try:
        return msgspec.json.decode(raw)
    except msgspec.DecodeError as err:
        raise InputError(f"not valid JSON: {err}", where=str(path), fix=fix) from None
    except RecursionError:
        raise InputError("nested too deeply to read", where=str(path), fix=fix) from None


def _index_total(path: Path) -> int:
    from capture_plan.schemas.files import read_input

    doc = _decode(read_input(path, "config"), path, "give the checkpoint's model.safetensors.index.json")
    meta = doc.get("metadata") if isinstance(doc, dict) else None
    total = meta.get("total_size") if isinstance(meta, dict) else None
    if isinstance(total, bool) or not isinstance(total, int) or total <= 0:
        raise InputError(
            "no metadata.total_size in the safetensors index",
            where=str(path),
            fix="give the checkpoint's model.safetensors.index.json, or leave --weights-index out",
        )
    return total


def kv_heads_per_rank(m: FitModel, tp: int) -> int:
    """KV heads one rank holds (a head is replicated where tp exceeds the KV heads)."""
    return max(1, m.kv_heads // tp)


def qkv_width(m: FitModel, tp: int) -> int:
    """The merged qkv projection's output width on one rank (vLLM's llama.py LlamaAttention:
    the rank's query heads and its KV heads, at least one). MLA too: its prefill up-projects
    q, k and v to heads x head_dim (nope + rope), kv_heads = heads."""
    return (m.heads // tp + 2 * kv_heads_per_rank(m, tp)) * m.head_dim


def kv_bytes_per_token(m: FitModel, tp: int, kv_dtype_bytes: int) -> int:
    """KV bytes one token takes in one layer on one rank: K and V per KV head, or
    MLA's latent (kv_lora_rank + qk_rope_head_dim, one copy on every rank)."""
    if m.mla:
        return (m.kv_lora_rank + m.qk_rope_head_dim) * kv_dtype_bytes
    return kv_heads_per_rank(m, tp) * (m.head_dim + m.v_head_dim) * kv_dtype_bytes


def _linear(rows: int, cols: int, m: FitModel) -> float:
    """Bytes of one linear layer's weight as the checkpoint stores it."""
    n = rows * cols
    if m.quant_method == "fp8":
        return n * 1.0
    if m.quant_method in ("awq", "gptq"):
        groups = n / m.quant_group
        return n * m.quant_bits / 8 + groups * (2 + m.quant_bits / 8)  # scales, packed zeros
    return n * m.dtype_bytes


#: model types whose decoder layer has four RMS norms, not two: before and after attention and
#: before and after the MLP (input_layernorm, post_attention_layernorm, pre_feedforward_layernorm,
#: post_feedforward_layernorm: SGLang 0.5.23's models/gemma2.py and gemma3_causal.py, as
#: transformers' Gemma2DecoderLayer)
FOUR_NORMS = ("gemma2", "gemma3_text")
#: model types that keep the embedding's scale sqrt(hidden) as a one-element buffer in the
#: model's dtype (SGLang 0.5.23 models/gemma2.py Gemma2Model: register_buffer("normalizer"))
NORMALIZER = ("gemma2",)
#: model types whose MoE layers gate their shared expert by a Linear(hidden, 1), replicated
#: under tp (SGLang 0.5.23 models/qwen2_moe.py Qwen2MoeSparseMoeBlock.shared_expert_gate:
#: torch.nn.Linear(hidden_size, 1, bias=False))
SHARED_EXPERT_GATE = ("qwen2_moe",)


def _norms(m: FitModel) -> int:
    """Bytes of the hidden-sized RMS norms (two or :data:`FOUR_NORMS` a layer, the final one)
    and :data:`NORMALIZER`'s scalar (MLA's latent norms are its attention's)."""
    d, per_layer = m.dtype_bytes, 4 if m.model_type in FOUR_NORMS else 2
    return (per_layer * m.layers + 1) * m.hidden * d + (d if m.model_type in NORMALIZER else 0)


def replicated_bytes(m: FitModel) -> int:
    """Bytes every rank holds whole under tensor parallelism: the RMS norms (:func:`_norms`),
    an MoE's router (vLLM's ReplicatedLinear gate) and :data:`SHARED_EXPERT_GATE`'s gate."""
    d = m.dtype_bytes
    latent = m.layers * (m.kv_lora_rank + m.q_lora_rank) * d
    moe_layers = m.layers - m.dense_layers if m.experts else 0
    return _norms(m) + latent + moe_layers * m.hidden * m.experts * d + _shared_gate(m)


def _shared_gate(m: FitModel) -> int:
    """Bytes of :data:`SHARED_EXPERT_GATE`'s gates (0 for another model)."""
    if m.model_type not in SHARED_EXPERT_GATE or not m.experts or not m.shared_expert_intermediate:
        return 0
    return (m.layers - m.dense_layers) * m.hidden * m.dtype_bytes


def weight_bytes(m: FitModel, tp: int, rotary: int | None = None) -> int:
    """One rank's weight bytes, counted from the dimensions (see the module's docstring);
    with a safetensors index, its total split over ``tp`` but for :func:`replicated_bytes`.
    ``rotary``: the bytes of the engine's rotary cos/sin caches (a release's:
    ``planner/fit/rope.py rotary_cache``), counted on either path: the cache is a buffer the
    engine computes at load, in no checkpoint's index; None: :func:`rotary_cache_bytes`."""
    rotary = rotary_cache_bytes(m) if rotary is None else rotary
    if m.exact_weight_bytes:
        if tp == 1:
            return m.exact_weight_bytes + rotary
        rep = min(replicated_bytes(m), m.exact_weight_bytes)
        return (m.exact_weight_bytes - rep) // tp + rep + rotary
    h, d = m.hidden, m.dtype_bytes
    emb = m.vocab * h * d * (1 if m.tie_embeddings else 2)
    if m.mla:
        nope = m.head_dim - m.qk_rope_head_dim
        q = (
            _linear(h, m.q_lora_rank, m) + _linear(m.q_lora_rank, m.heads * m.head_dim, m) + m.q_lora_rank * d
            if m.q_lora_rank
            else _linear(h, m.heads * m.head_dim, m)
        )
        attn = (
            q
            + _linear(h, m.kv_lora_rank + m.qk_rope_head_dim, m)
            + m.kv_lora_rank * d
            + _linear(m.kv_lora_rank, m.heads * (nope + m.v_head_dim), m)
            + _linear(m.heads * m.v_head_dim, h, m)
        )
    else:
        qkv = (m.heads + 2 * m.kv_heads) * m.head_dim
        attn = _linear(h, qkv, m) + _linear(m.heads * m.head_dim, h, m) + (qkv * d if m.qkv_bias else 0)
    dense = 3 * _linear(h, m.intermediate, m)
    if m.experts:
        moe = m.experts * 3 * _linear(h, m.expert_intermediate, m) + h * m.experts * d
        moe += 3 * _linear(h, m.shared_expert_intermediate, m) if m.shared_expert_intermediate else 0
        mlp = m.dense_layers * dense + (m.layers - m.dense_layers) * moe
    else:
        mlp = m.layers * dense
    return int((emb + m.layers * attn + mlp) / tp + _norms(m) + _shared_gate(m) + rotary)


def rotary_cache_bytes(m: FitModel) -> int:
    """A default rope's cos/sin cache of ``m`` on every rank: one for the model (the engines
    share a rope by its settings), max_position_embeddings rows of rotary_dim elements of the
    model's dtype."""
    return m.max_positions * m.rotary_dim * m.dtype_bytes
