"""Speculative decoding as fit prices it: the draft model's weights and its KV, as each release
loads and sizes them (planner/data/fit_rules.toml [speculative.NAME], each step's file and
function named there).

:func:`draft_of` reads the engine's own flags (vLLM's ``--speculative-config`` JSON; SGLang's
``--speculative-algorithm``, ``--speculative-draft-model-path`` and the step counts), loads the
draft's config as ``--model`` loads one (:func:`.model.load_model`: a config.json, a spec TOML
or a preset) and counts:

* its weights by the method (the rule's ``methods``): none (n-gram), the whole draft model, or
  an EAGLE head (its decoder layers, its fc, the target's embedding and lm_head shared: the
  shared copy is the error bar, as a draft checkpoint with its own differing copy keeps it);
* its KV bytes per token on one rank by the rule's ``kv``: vLLM's draft layers at their own
  bytes per token in the target's one full-attention group, SGLang's target cell grown by
  ``int(cell x draft layers / target layers)``;
* its rotary cos/sin cache by the rule's ``draft_positions`` and ``draft_dtype``: its rows as
  the release sizes them (vLLM raises an EAGLE head's max_position_embeddings to the target's
  max-model-len; SGLang runs the draft at the target's context length), none where its rope
  has the target's key (both engines keep one cache per key, process-wide);
* the max-model-len the release lowers the target's to (the rule's ``limit_to_draft``: vLLM's
  ``VllmConfig._limit_max_model_len_to_draft``, vllm/config/vllm.py): a draft that does not
  share the target's positions (a draft_model draft, or a rope type that is not cache-only)
  whose own max_model_len is smaller caps the target's at it, with the warning the release
  logs (:func:`.inputs.resolve` applies it, fit's notes quote it).

Graph memory of the draft (its decode and extend graphs, the target's verify widths) is no
measured family: the engine layers leave it unknown, never zero.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import msgspec

from capture_plan.schemas.errors import InputError
from capture_plan.schemas.fit import FitItem, Speculative

from .context import context_length, derived, rope_types
from .model import FitModel, kv_bytes_per_token, load_model, weight_bytes
from .refusal import Refusal
from .rope import rotary_cache
from .tables import SpecRule, spec_rule, spec_rules

if TYPE_CHECKING:
    from .inputs import FitInputs

__all__ = ["Draft", "draft_of", "speculative", "SGLANG_FLAGS"]

#: SGLang's flags of speculative decoding besides the algorithm
SGLANG_FLAGS = (
    "speculative-draft-model-path",
    "speculative-num-steps",
    "speculative-eagle-topk",
    "speculative-num-draft-tokens",
)
#: the keys of vLLM's --speculative-config fit reads
_VLLM_KEYS = ("method", "model", "num_speculative_tokens", "draft_tensor_parallel_size")
#: an n-gram config that works, for the fixes of a refused draft
_NGRAM = '{"method":"ngram","num_speculative_tokens":3,"prompt_lookup_max":5}'


class Draft(msgspec.Struct, frozen=True):
    """A speculative draft resolved: its method, weights and KV on one rank."""

    rule_name: str
    #: the engine's method, resolved (SGLang's NEXTN is EAGLE)
    method: str
    #: how its weights are counted: "none", "whole", "eagle", "eagle3"
    counted: str
    #: tokens a step proposes (vLLM num_speculative_tokens, SGLang num_draft_tokens)
    tokens: int
    #: the engine's settings the method resolves, by the engine's flag names
    settings: dict
    #: the draft model as given ("" for none)
    given: str
    #: the draft's attention layers in the KV cache (0: none)
    layers: int
    #: the draft's KV bytes per token on one rank, all its layers (0: none)
    kv_per_token: int
    weights: FitItem
    source: str
    #: the max-model-len the release lowers the target's to, the draft's own (0: none; vLLM's
    #: VllmConfig._limit_max_model_len_to_draft: :func:`_limit`), and the warning it logs then
    max_model_len: int = 0
    limit_log: str = ""
    #: the draft model's config as loaded (None: no draft model)
    model: FitModel | None = None


def speculative(d: Draft, tokens_without: int, concurrency_without: float) -> Speculative:
    """The result's record of ``d``, with the KV tokens and concurrency the same settings give without it."""
    return Speculative(
        method=d.method,
        draft=d.given,
        tokens=d.tokens,
        draft_layers=d.layers,
        draft_kv_bytes_per_token=d.kv_per_token,
        kv_tokens_without=tokens_without,
        max_concurrency_without=round(concurrency_without, 2),
        source=d.source,
    )


def draft_of(inp: FitInputs) -> Draft | None:
    """The request's draft (None: no speculative decoding), or a refusal naming the flag."""
    if inp.engine == "vllm":
        if "speculative-config" not in inp.flags:
            return None
        found = _rule(inp, "speculative-config")
        return _vllm(inp, *found)
    if "speculative-algorithm" not in inp.flags:  # speculative_hook reads the others only for one
        return None
    return _sglang(inp, *_rule(inp, "speculative-algorithm"))


def _rule(inp: FitInputs, flag: str) -> tuple[str, SpecRule]:
    found = spec_rule(inp.engine, inp.version)
    if found is not None:
        return found
    read = [f"{r.engine}=={v}" for r in spec_rules().values() if r.engine == inp.engine for v in r.releases]
    raise Refusal(
        f"{inp.engine} {inp.version}'s speculative decoding was not read from its wheel "
        f"(fit_rules.toml [speculative] covers {', '.join(read)})",
        where=f"--{flag}",
        hint=f"the nearest release read for it, {read[0]} (or leave --{flag} out)",
        changes={"engine": read[0]},
    )


def _refuse(flag: str, what: str, hint: str, value: object) -> Refusal:
    return Refusal(what, where=f"--{flag}", hint=hint, changes={flag: value})


def _vllm(inp: FitInputs, rule_name: str, rule: SpecRule) -> Draft:
    flag = rule.flag
    raw: dict = msgspec.json.decode(inp.flags[flag])
    for k in raw:
        if k not in _VLLM_KEYS and not (k.startswith("prompt_lookup_") and raw.get("method") == "ngram"):
            rest = msgspec.json.encode({a: b for a, b in raw.items() if a != k}).decode()
            reads = f"fit reads {', '.join(_VLLM_KEYS)}"
            raise _refuse(flag, f"--{flag} key {k!r:.40} is not one fit reads", reads, rest)
    method, model = raw.get("method"), raw.get("model")
    if method is None and model in ("ngram", "[ngram]") or method == "[ngram]":  # SpeculativeConfig.__post_init__
        method = "ngram"
    if not isinstance(method, str):
        fixed = msgspec.json.encode({"method": "draft_model", **raw}).decode()
        raise _refuse(flag, f"--{flag} gives no method", f"name it ({', '.join(rule.methods)})", fixed)
    if method.endswith("_mtp"):  # __post_init__: the MTP model types are "mtp"
        method = "mtp"
    _unmodelled(rule, method)
    counted = rule.methods[method]
    n = raw.get("num_speculative_tokens")
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= 64:
        fixed = msgspec.json.encode({**raw, "num_speculative_tokens": 3}).decode()
        raise _refuse(flag, f"num_speculative_tokens must be an integer from 1 to 64, got {n!r:.30}", "3", fixed)
    draft_tp = raw.get("draft_tensor_parallel_size", inp.tp)
    if draft_tp not in (1, inp.tp) or isinstance(draft_tp, bool):  # _verify_and_get_draft_tp
        fixed = msgspec.json.encode({**raw, "draft_tensor_parallel_size": inp.tp}).decode()
        raise _refuse(
            flag,
            f"draft_tensor_parallel_size must be 1 or --tp {inp.tp}, got {draft_tp!r:.30}",
            f"--tp {inp.tp}",
            fixed,
        )
    settings = {"speculative method": method, "num_speculative_tokens": n}
    if counted == "none":  # no draft KV beside the target's: its attention is priced as without
        return _none(rule_name, method, n, settings)
    _check_attention(flag, inp.model, "the target")
    d = _draft_model(flag, model, {flag: _NGRAM})
    if counted == "whole" and d.vocab != inp.model.vocab:  # verify_equal_vocab_size_if_draft_model
        raise _refuse(
            flag, f"the draft's vocabulary ({d.vocab}) is not the target's ({inp.model.vocab})", "n-gram", _NGRAM
        )
    if counted == "eagle3":
        _check_draft_vocab(inp, d, {flag: _NGRAM})
    _check_head_width(inp, d, counted, {flag: _NGRAM})
    _check_attention(flag, d, "the draft")
    w = _weights(inp, d, method, draft_tp)
    per = _kv_per_token(inp, rule, d, draft_tp)
    length, log = _limit(inp, rule, d, method)
    return Draft(rule_name, method, counted, n, settings, str(model), d.layers, per, w, _src(rule_name), length, log, d)


def _shares_positions(rule: SpecRule, d: FitModel, method: str) -> bool:
    """Whether the release raises the draft's max_position_embeddings to the target's
    max-model-len (a method of ``raise_methods`` whose rope types are all
    ``cache_only_rope_types``: vLLM's _maybe_override_draft_max_position_embeddings), so the
    draft's length never limits the target's."""
    return method in rule.raise_methods and all(t in rule.cache_only_rope_types for t in rope_types(d.context))


def _limit(inp: FitInputs, rule: SpecRule, d: FitModel, method: str) -> tuple[int, str]:
    """(the max-model-len the release lowers the target's to, the warning it logs), else (0, ""):
    vLLM's VllmConfig._limit_max_model_len_to_draft (the rule's ``limit_to_draft``, by release)
    where the draft does not share the target's positions (:func:`_shares_positions`) and its
    own max_model_len, the default its config derives (none given: the target's), is smaller."""
    log = rule.limit_to_draft.get(inp.version)
    if log is None or _shares_positions(rule, d, method):
        return 0, ""
    own = derived(d, inp.engine, inp.version)[1]
    target = inp.context.value
    if own is None or own >= target:
        return 0, ""
    return own, log % (own, target, own)


def _none(rule_name: str, method: str, n: int, settings: dict) -> Draft:
    src = _src(rule_name)
    item = FitItem("draft weights", 0, 0, "exact", f"{method}: no draft model, no draft KV ({src})")
    return Draft(rule_name, method, "none", n, settings, "", 0, 0, item, src)


def _src(rule_name: str) -> str:
    return f"fit_rules.toml [speculative.{rule_name}]"


def _unmodelled(rule: SpecRule, method: str) -> None:
    """Refuse a method fit does not price."""
    if method in rule.methods:
        return
    what = rule.unmodelled.get(method, "not one of the engine's methods fit knows")
    fixed = _NGRAM if rule.engine == "vllm" else "NGRAM"
    raise _refuse(rule.flag, f"speculative method {method!r:.30} is not modelled: {what}", "n-gram", fixed)


def _draft_model(flag: str, model: object, ngram: dict[str, object]) -> FitModel:
    """The draft's config loaded as --model loads one, its errors located at ``flag``; the
    fix: ``ngram``'s changes (n-gram, which needs no draft model)."""
    hint = "a config.json, a spec TOML or a preset for the draft; or n-gram, which needs none"
    if not isinstance(model, str) or not model.strip():
        raise Refusal("the draft model is not given", where=f"--{flag}", hint=hint, changes=ngram)
    try:
        return load_model(model)
    except InputError as err:  # its JSON path kept (the file is the model named)
        at = " $" + err.where.split(": $", 1)[1] if err.where and ": $" in err.where else ""
        what = f"draft model {model!r:.60}{at}: {err.what}"
        raise Refusal(what, where=f"--{flag}", hint=hint, changes=ngram) from None


def _check_draft_vocab(inp: FitInputs, d: FitModel, ngram: dict[str, object]) -> None:
    """An EAGLE3 head's vocabulary (draft_vocab_size, else vocab_size: llama_eagle3.py) no
    larger than the target's: both engines scatter its ids into the target's logits
    (draft_id_to_target_id, SGLang's hot_token_id), which a larger one overruns at its first
    step."""
    dv = d.draft_vocab or d.vocab
    if dv > inp.model.vocab:
        key = "draft_vocab_size" if d.draft_vocab else "vocab_size"
        raise Refusal(
            f"the EAGLE3 head's vocabulary ({dv}, its {key}) is larger than the target's ({inp.model.vocab}): "
            "the engine maps its tokens into the target's",
            where=f"{d.source}: $.{key}",
            hint="the head trained for this target; or n-gram, which needs no draft",
            changes=ngram,
        )


def _check_head_width(inp: FitInputs, d: FitModel, counted: str, ngram: dict[str, object]) -> None:
    """An EAGLE head reads the target's hidden states, so it is made for the target's width:
    EAGLE's fc takes its hidden_size x 2 (the token's embedding beside the target's state:
    llama_eagle.py), EAGLE3's its target_hidden_size (else hidden_size) x 3 (llama_eagle3.py),
    in vLLM and SGLang alike. A head made for another target cannot load its fc."""
    if counted not in ("eagle", "eagle3"):
        return
    own = counted == "eagle3" and d.target_hidden > 0
    width, key = (d.target_hidden, "target_hidden_size") if own else (d.hidden, "hidden_size")
    if width != inp.model.hidden:
        raise Refusal(
            f"the {counted.upper()} head reads hidden states {width} wide (its {key}); the target's are "
            f"{inp.model.hidden}: it was made for another target",
            where=f"{d.source}: $.{key}",
            hint="the head trained for this target; or n-gram, which needs no draft",
            changes=ngram,
        )


def _check_attention(flag: str, d: FitModel, who: str) -> None:
    """fit prices a draft of full attention that is not MLA (vLLM's one full-attention group)."""
    if d.sliding_layers or d.mla:
        kind = "sliding-window" if d.sliding_layers else "MLA"
        raise _refuse(
            flag,
            f"{who}'s {kind} attention with speculative decoding is not modelled (fit prices full-attention drafts)",
            "leave speculative decoding out",
            None,
        )


def _kv_per_token(inp: FitInputs, rule: SpecRule, d: FitModel, tp: int) -> int:
    """The draft's KV bytes a token on one rank, all its layers, by the rule's ``kv``: "layers"
    (vLLM: each draft layer at its own bytes per token, in the KV cache dtype), "target-share"
    (SGLang's DefaultPoolConfigurator: int(cell x draft layers / target layers), the cell the
    target's every layer)."""
    if rule.kv == "layers":
        return kv_bytes_per_token(d, tp, inp.kv_dtype_bytes) * d.layers
    cell = inp.per_layer * inp.model.layers
    return int(cell * d.layers / inp.model.layers)


def _rotary(inp: FitInputs, rule: SpecRule, d: FitModel, method: str) -> tuple[int, str]:
    """The draft's own rotary cos/sin cache bytes on every rank, and what they are: its rows as
    the release sizes them (the rule's ``draft_positions``), none where its cache has the
    target's key (head size, rotary dim, rows, rope settings, dtype: one cache per key)."""
    m, rows = inp.model, d.max_positions
    if not rows:
        return 0, "no rotary cache (its config gives no max_position_embeddings)"
    how = f"its max_position_embeddings {rows:,}"
    if rule.draft_positions == "raise":
        if _shares_positions(rule, d, method) and rows < inp.context.value:
            rows, how = inp.context.value, f"raised from {rows:,} to the target's --max-model-len"
    else:  # the draft runs at the target's context length (as the target's own is checked)
        try:
            length = context_length(d, inp.engine, inp.version, inp.context.value)
        except Refusal as err:
            raise Refusal(
                f"SGLang {inp.version} runs the draft at the target's context length: {err.what}",
                where=f"--{SGLANG_FLAGS[0]}",
                hint=f"{err.hint}, which the draft takes",
                changes=err.changes,
            ) from None
        if length.allowed_by:  # the engine sets the draft's max_position_embeddings to it
            rows, how = length.value, f"{length.allowed_by} set: raised from {rows:,} to the target's context length"
    dtype = m.dtype if rule.draft_dtype == "target" else d.dtype
    key = (d.head_dim, d.rotary_dim, rows, d.rope, dtype)
    if m.max_positions and key == (m.head_dim, m.rotary_dim, m.max_positions, m.rope, m.dtype):
        return 0, f"its rotary cache is the target's ({rows:,} rows, the same rope settings and dtype: one cache)"
    element = m.dtype_bytes if rule.draft_dtype == "target" else d.dtype_bytes
    rot = rotary_cache(d, inp.engine, inp.version, max_position=rows, dtype_bytes=element)
    return rot.bytes, f"its own rotary cache at {rows:,} positions ({how}): {rot.how}"


def _weights(inp: FitInputs, d: FitModel, method: str, tp: int) -> FitItem:
    """The draft's weight bytes on one rank by the method (the module's docstring), with its
    rotary cache (:func:`_rotary`)."""
    found = spec_rule(inp.engine, inp.version)
    assert found is not None  # draft_of resolved the rule
    rule = found[1]
    counted, fc_bias = rule.methods[method], rule.eagle_fc_bias
    rot, rot_what = _rotary(inp, rule, d, method)
    b = weight_bytes(d, tp, rot)
    if counted == "whole":
        src = f"the whole draft, counted from {d.source}; {rot_what}"
        return FitItem("draft weights", b, int(0.005 * b), "estimated", src)
    h, dt = d.hidden, d.dtype_bytes
    heads = msgspec.structs.replace(d, vocab=0)  # no embedding, no lm_head: the target's are shared
    b = weight_bytes(heads, tp, rot)
    shared = d.vocab * h * dt * (1 if d.tie_embeddings else 2) // tp
    if counted == "eagle":
        b += 2 * h * h * dt + (h * dt if fc_bias else 0)  # fc, replicated
        # both engines' llama_eagle.py delete the first layer's input norm and build no final norm
        b -= 2 * h * dt
        what = (
            "its layers (the first without its input norm) and fc (2 x hidden), no final norm, the target's "
            "embedding and lm_head shared"
        )
    else:
        dv = d.draft_vocab or d.vocab  # llama_eagle3.py: its draft_vocab_size, else its vocab_size
        qkv = (d.heads + 2 * d.kv_heads) * d.head_dim
        b += d.layers * h * qkv * dt // tp  # qkv takes 2 x hidden
        b += 3 * inp.model.hidden * h * dt  # fc of the target's three aux hidden states, replicated
        shared = d.vocab * h * dt // tp
        if rule.eagle3_head_from_target and (d.tie_embeddings or not d.draft_vocab):
            what = "its layers (qkv of 2 x hidden), fc (3 x hidden); the embedding and the lm_head the target's"
        else:
            b += dv * h * dt // tp + (dv * 8 if dv != inp.model.vocab else 0)  # own lm_head; draft-to-target map
            what = f"its layers (qkv of 2 x hidden), fc (3 x hidden), its lm_head of {dv} rows; the embedding shared"
    bar = "error bar: the shared copy (a draft's own differing one stays)"
    src = f"EAGLE head counted from {d.source}: {what}; {rot_what}; {bar}"
    return FitItem("draft weights", b, shared + int(0.005 * b), "estimated", src)


def _sglang(inp: FitInputs, rule_name: str, rule: SpecRule) -> Draft:
    flag = rule.flag
    given = str(inp.flags[flag])
    alg = rule.aliases.get(given, given)
    _unmodelled(rule, alg)
    counted = rule.methods[alg]
    settings: dict = {"max-running-requests": inp.flag("max-running-requests", 48)}
    steps, topk, ntok = (inp.flags.get(f"speculative-{k}") for k in ("num-steps", "eagle-topk", "num-draft-tokens"))
    if counted == "none":
        settings["speculative-num-draft-tokens"] = ntok or 12  # _handle_ngram
        return _none(rule_name, alg, settings["speculative-num-draft-tokens"], settings)
    if steps is None and (topk is not None or ntok is not None):  # _handle_eagle_family asserts
        raise Refusal(
            "--speculative-eagle-topk and --speculative-num-draft-tokens need --speculative-num-steps",
            where="--speculative-num-steps",
            hint="leave them out (SGLang chooses all three)",
            changes={"speculative-eagle-topk": None, "speculative-num-draft-tokens": None},
        )
    if steps is not None and topk is None:  # SGLang compares the topk with 1
        raise _refuse("speculative-eagle-topk", "--speculative-num-steps needs --speculative-eagle-topk", "1", 1)
    if steps is None:  # _auto_choose_speculative_params: by method, then the target's architectures[0]
        arch = inp.model.architectures[0] if inp.model.architectures else ""
        by_arch = rule.auto_steps_by_architecture.get(arch, rule.auto_steps)
        steps, topk, ntok = rule.auto_steps_by_method.get(alg, by_arch)
    if topk == 1 or ntok is None:
        ntok = steps + 1
    settings.update({"speculative-num-steps": steps, "speculative-eagle-topk": topk})
    settings["speculative-num-draft-tokens"] = ntok
    path = inp.flags.get("speculative-draft-model-path")
    if path is None:
        raise Refusal(
            f"{alg} needs --speculative-draft-model-path (fit does not read the MTP layers of a target's checkpoint)",
            where="--speculative-draft-model-path",
            hint="leave speculative decoding out",
            changes={flag: None, **{f: None for f in SGLANG_FLAGS}},
        )
    ngram = {flag: "NGRAM", **{f: None for f in SGLANG_FLAGS}}
    d = _draft_model("speculative-draft-model-path", path, ngram)
    if counted == "eagle3":
        _check_draft_vocab(inp, d, ngram)
    _check_head_width(inp, d, counted, ngram)
    if d.nextn_layers:  # _resolve_eagle_aux_hidden_state: the draft's layers are these (a NextN
        # checkpoint keeps the target's num_hidden_layers; its MTP layers sit past the dense ones)
        d = msgspec.structs.replace(d, layers=d.nextn_layers, dense_layers=0)
    per = _kv_per_token(inp, rule, d, inp.tp)
    w = _weights(inp, d, alg, inp.tp)
    return Draft(rule_name, alg, counted, ntok, settings, path, d.layers, per, w, _src(rule_name))
