"""fit's data tables, typed: devices, release rules, estimates (planner/data/fit_*.toml).

A malformed table is a broken package (RuntimeError); a name not in a table is the
user's input (a :class:`.refusal.Refusal` listing what is known, its change the nearest).
"""

from __future__ import annotations

import difflib
import functools
from typing import Any, Literal, NamedTuple

import msgspec
from packaging.version import InvalidVersion, Version

from capture_plan.planner.inputs.resources import data, typed

from .refusal import Refusal

__all__ = [
    "Device",
    "Rule",
    "ContextRule",
    "SwaRule",
    "SpecRule",
    "SamplerRule",
    "SamplerRow",
    "BufferTensor",
    "BufferRule",
    "buffer_rule",
    "buffer_rules",
    "sampler_rule",
    "sampler_rules",
    "spec_rule",
    "spec_rules",
    "context_rule",
    "swa_rule",
    "context_rules",
    "device",
    "rule_for",
    "estimates",
    "wheels",
    "rules",
    "devices",
    "releases",
    "typed",
]

GiB = 1 << 30
MiB = 1 << 20
#: nvidia-smi's total less torch's on the H100 (planner/data/fit_devices.toml: 81559 MiB less
#: 79.19 GiB, 81090.6 MiB)
_SMI_OVER_TORCH = 468 * MiB
_SMI_OVER_TORCH_ERROR = 300 * MiB


class Device(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    sm: str
    smi_total_mib: int
    smi_source: str
    #: streaming multiprocessors (multi_processor_count), and where the figure was read
    sms: int
    sms_source: str
    torch_total_gib: float | None = None
    torch_source: str | None = None

    @property
    def torch_total(self) -> int:
        """torch's total in bytes (derived from nvidia-smi's where no source gives it)."""
        if self.torch_total_gib is not None:
            return int(round(self.torch_total_gib * GiB))
        return self.smi_total_mib * MiB - _SMI_OVER_TORCH

    @property
    def torch_total_error(self) -> int:
        # a figure printed to two decimals of a GiB is within 5.12 MiB
        return int(0.005 * GiB) if self.torch_total_gib is not None else _SMI_OVER_TORCH_ERROR


class Rule(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    engine: str
    releases: list[str]
    kind: str
    steps: list[str]
    default_utilization: float = 0.0
    margin_floor_bytes: int = 0
    margin_fraction: float = 0.0
    #: vLLM before capture: "deducted" (the graph estimate is taken from the budget) or
    #: "logged" (profiled and logged, VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS off by default)
    graph_estimate: str = "deducted"
    #: how the logged KV tokens are counted: "concurrency" (int(max concurrency x
    #: max_model_len)) or "blocks" (num_blocks // groups x block size)
    kv_tokens: str = "concurrency"
    #: what _set_cudagraph_sizes appends to the default grid when it fits under the largest
    #: size: "max-num-batched-tokens", "max-num-seqs" (the uniform decode size)
    capture_appends: list[str] = []
    #: get_batch_defaults has the >= 160 GiB tier (16384 batched tokens for the API server)
    batch_tier_160: bool = True
    #: batches a sliding-window request's blocks must hold beyond its window: 1 (the
    #: releases that count max_num_batched_tokens) or 2 (VllmConfig.max_in_flight_tokens
    #: under async scheduling)
    in_flight_batches: int = 2
    #: where the release's start-up creates the process's first torch stream, whose creation
    #: makes torch's stream pools at once (planner/data/devices.toml [first_torch_stream]):
    #: "profile" (after its first free-memory reading, before its KV sizing reads: fit adds the
    #: pools to the non-torch item) or "before" (before that reading: in the CUDA context's
    #: span, nothing to add); None: not read for the rule's releases (within non-torch's bar)
    first_stream: Literal["before", "profile"] | None = None
    #: the model graph manager allocates its persistent output buffers (hidden states, and
    #: EAGLE-3's auxiliary hidden states, max capture tokens wide) at its first warm-up, inside
    #: the window the release measures its capture by, on the capture stream where no cached
    #: block is free: a segment of their own in the graph figure (planner/fit/vllm.py)
    capture_outputs: bool = False


class ContextRule(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """How releases derive the longest context a model takes and refuse a longer one
    (fit_rules.toml [context.NAME]; followed by planner/fit/context.py, each field's source in
    ``sources``)."""

    engine: str
    releases: list[str]
    #: the engine's flag of the context length (max-model-len, context-length)
    flag: str
    #: the config keys that give the length, in the engine's order
    keys: list[str]
    #: "smallest" (vLLM: the smallest key given) or "first" (SGLang: the first key given)
    pick: Literal["smallest", "first"]
    allow_env: list[str]
    #: the values of an ``allow_env`` variable that mean true (lower-cased; ``env_strip``: stripped)
    env_true: list[str]
    env_strip: bool
    sources: list[str]
    #: a key whose value replaces the pick where given (vLLM: Command-R's model_max_length)
    override_key: str = ""
    #: the releases whose transformers pin is 4 (rope_scaling alone; the others read it as 5 does)
    transformers_4: list[str] = []
    #: rope types whose factor does not scale the length
    unscaled_rope_types: list[str] = []
    #: a yarn row sets the length to its original_max_position_embeddings (before the factor)
    yarn_from_original: bool = False
    #: a row holding original_max_position_embeddings is not scaled (SGLang)
    original_unscaled: bool = False
    #: rope rows nested by layer type scale nothing (SGLang reads the top-level dict's factor)
    nested_unscaled: bool = False
    #: a null factor ends the engine's start (SGLang: int(None * length)); else it is 1.0
    null_factor_fails: bool = False
    #: model types (a part of the text config's) whose length is not scaled
    unscaled_model_types: list[str] = []
    #: legacy rope type names the release renames
    legacy_rope_types: dict[str, str] = {}
    #: no flag given under longrope: the config's original_max_position_embeddings
    longrope_default_original: bool = False
    #: a value above the length is taken up to the config's model_max_length (vLLM)
    model_max_length_allows: bool = False
    #: the length is int(factor x length) (SGLang); else the product, compared as it is (vLLM)
    int_length: bool = False


class SwaRule(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Which models a release keeps in a hybrid sliding-window KV pool and how it splits the
    pool (fit_rules.toml [swa.NAME]; followed by planner/fit/swa.py, each field's source in
    ``sources``)."""

    engine: str
    releases: list[str]
    #: a config naming one of these architectures is hybrid
    architectures: list[str]
    #: of ``architectures``, those hybrid only where the model has sliding-window layers
    needs_sliding_layers: list[str]
    #: a text config key that makes any model hybrid where it is set
    opt_in_key: str
    #: first architectures an override keeps in one pool, each with the config key that must be
    #: given for it ("": always)
    disabled_for: dict[str, str]
    #: architectures whose layer split the release reads from the config's layer_types
    layer_types_architectures: list[str]
    #: text config keys that give the sliding-window layers their own geometry
    geometry_keys: list[str]
    #: architectures whose split is by position: layer i full where (i + 1) % N == 0, else
    #: sliding (chunked attention, the window its attention_chunk_size)
    full_every: dict[str, int]
    #: architectures whose model class checks the window as the config's sliding_window - 1
    exclusive_window: list[str]
    #: architectures whose model class checks a window of its own
    fixed_window: dict[str, int]
    #: the default sliding-window tokens per full-side token
    ratio: float
    sources: list[str]


class Wheel(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    file: str
    sha256: str


class _Devices(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    devices: dict[str, Device]


class SpecRule(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """How releases load a speculative draft and size its KV (fit_rules.toml [speculative.NAME];
    followed by planner/fit/draft.py, each step's source in ``sources``)."""

    engine: str
    releases: list[str]
    #: the engine's flag that names the method
    flag: str
    #: "layers" (vLLM: the draft's layers join the KV group) or "target-share" (SGLang)
    kv: Literal["layers", "target-share"]
    #: each priced method and how its draft's weights are counted
    methods: dict[str, Literal["none", "whole", "eagle", "eagle3"]]
    #: methods the engine has that fit does not price, and why
    unmodelled: dict[str, str]
    sources: list[str]
    #: a method's other names (SGLang's NEXTN is EAGLE)
    aliases: dict[str, str] = {}
    #: an EAGLE head's fc has a bias (SGLang's torch.nn.Linear)
    eagle_fc_bias: bool = False
    #: an EAGLE3 head that gives no draft_vocab_size, or ties its embeddings, takes the
    #: target's lm_head (SGLang: load_lm_head_from_target); else (vLLM) it builds its own of
    #: its vocab_size rows
    eagle3_head_from_target: bool = False
    #: the rows of a draft's rotary cache: "raise" (vLLM: a draft of ``raise_methods`` whose
    #: rope types are all ``cache_only_rope_types`` takes the target's max-model-len where its
    #: max_position_embeddings is smaller) or "context" (SGLang: the draft runs at the target's
    #: context length, refused past what its config derives unless the environment allows it,
    #: which then is its max_position_embeddings)
    draft_positions: Literal["raise", "context"] = "raise"
    raise_methods: list[str] = []
    cache_only_rope_types: list[str] = []
    #: the dtype a draft's rotary cache is keyed by: "target" (vLLM: the draft's ModelConfig
    #: takes the target's) or "own" (SGLang: the draft config's, --dtype auto)
    draft_dtype: Literal["target", "own"] = "target"
    #: the releases that lower max-model-len to the draft's own where the draft does not share
    #: the target's positions (vLLM's VllmConfig._limit_max_model_len_to_draft), each with the
    #: warning it logs then (a printf template: the draft's, the target's, the new length)
    limit_to_draft: dict[str, str] = {}
    #: SGLang's (steps, topk, draft tokens) where none is given: by method first, then by the
    #: target's architectures[0], else ``auto_steps``
    auto_steps_by_method: dict[str, list[int]] = {}
    auto_steps_by_architecture: dict[str, list[int]] = {}
    auto_steps: list[int] = []


#: a rotary cache's rows, by the max_position the model passes get_rope (its
#: max_position_embeddings), the rope's factor and its original_max_position_embeddings
RopeRows = Literal["max", "max_x_factor", "original_x_factor", "original_plus_max", "twice_original_plus_max"]


class RopeRule(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """The rotary cos/sin cache releases keep for each rope type (fit_rules.toml [rope.NAME];
    followed by planner/fit/rope.py, each class's file in ``sources``)."""

    engine: str
    #: the releases whose rotary_embedding code was read (others of the engine: the nearest
    #: read, so named in the weights' source)
    releases: list[str]
    #: each modelled rope type's rows (another type is refused)
    rows: dict[str, RopeRows]
    #: each modelled rope type's element: the model's dtype, or float32
    element: dict[str, Literal["model", "float32"]]
    sources: list[str]
    #: a rope factor the release takes where a row gives none (0: it reads the key: refused)
    factor_default: float = 0.0
    #: the release takes max_position for a missing original_max_position_embeddings (else refused)
    original_default_max: bool = False
    #: model types whose code passes any rope but the default as ``deepseek_type``
    deepseek_model_types: list[str] = []
    deepseek_type: str = "deepseek_yarn"
    #: what the element of a rope type may be besides its ``element`` (the error bar), and why
    element_bar: dict[str, str] = {}
    #: rope keys whose class fit does not model (its rows are the model code's), and why
    refused_keys: dict[str, str] = {}


class SamplerRule(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """The profiling run's dummy sampler as releases allocate it (fit_rules.toml [sampler.NAME];
    followed by planner/fit/estimate.py sampler_phase, each step's file and function in
    ``sources``). Its rows x vocabulary tensors and what it holds beside them; where FlashInfer's
    sampler runs, ``flashinfer_fp32_copies`` float32 copies instead (None: not read)."""

    engine: str
    releases: list[str]
    #: rows x hidden tensors held beside the forward's hidden states (the gathered rows, copies)
    sampled_hidden_copies: int
    #: the logits' vocabulary is padded up to this (1: unpadded)
    vocab_padding: int
    #: rows x vocab float32 tensors live at the second pass's peak, besides the model-dtype logits
    fp32_copies: int
    sources: list[str]
    #: tp > 1: rows x padded-vocab tensors the all-gather makes beside the shard (0: not counted)
    gather_copies: int = 0
    #: Gumbel-max's vocabulary block: an int64 and a float32 per block and row (0: none)
    sample_block: int = 0
    flashinfer_fp32_copies: int | None = None
    #: the row's releases whose stock install runs FlashInfer's sampler (flashinfer-python is a
    #: requirement and nothing else gates it): their central figure is FlashInfer's branch, the
    #: other branch's in the error bar (the rest: the Triton branch central)
    flashinfer_default: list[str] = []

    def padded_vocab(self, vocab: int) -> int:
        """The logits' width: ``vocab`` padded up to ``vocab_padding``."""
        return -(-vocab // self.vocab_padding) * self.vocab_padding

    def sample_blocks(self, vocab: int) -> int:
        """Gumbel-max's vocabulary blocks per row (0: no Gumbel scratch)."""
        return -(-vocab // self.sample_block) if self.sample_block else 0

    def branch(self, version: str) -> str:
        """The sampler branch a stock install of ``version`` runs: "flashinfer" or "triton"."""
        return "flashinfer" if version in self.flashinfer_default and self.flashinfer_fp32_copies else "triton"


#: a buffer's dimension by name (fit_rules.toml [buffers]'s comment defines each)
BufferDim = Literal[
    "max_num_seqs",
    "max_num_seqs_plus_one",
    "max_num_batched_tokens",
    "max_model_len",
    "vocab",
    "vocab_words",
    "speculative_tokens",
    "decode_query_len",
    "topk_programs",
    "kv_groups",
    "block_table_width",
]


class BufferTensor(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One persistent device tensor of a release's runner (fit_rules.toml [[buffers.NAME.tensors]])."""

    #: the release's class and attribute (or cache)
    name: str
    #: dimensions by name, or constants
    shape: list[int | BufferDim]
    dtype: Literal["bool", "uint8", "int32", "int64", "float32"]
    #: when the start-up makes it: GPUModelRunner.__init__, load_model, profile_run (kept),
    #: initialize_kv_cache
    at: Literal["init", "load", "profile", "kv-init"]
    source: str
    #: "triton": made where FlashInfer's sampler does not run; "flashinfer": where it does (fit
    #: counts the branch the release's stock install runs: SamplerRule.branch)
    sampler: Literal["any", "triton", "flashinfer"] = "any"
    #: made only under these speculative methods (empty: always)
    methods: list[str] = []


class BufferRule(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """The persistent device buffers releases' runners make between the worker's first free-memory
    reading and the KV cache's sizing (fit_rules.toml [buffers.NAME]; followed by
    planner/fit/buffers.py), in the order the start-up makes them."""

    engine: str
    releases: list[str]
    tensors: list[BufferTensor]
    sources: list[str]


class SamplerRow(NamedTuple):
    """The sampler rule fit takes for a release: its name, the rule, the release asked and
    whether that release was read for it."""

    name: str
    rule: SamplerRule
    version: str
    read: bool


class _Rules(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    wheels: dict[str, Wheel]
    rules: dict[str, Rule]
    context: dict[str, ContextRule]
    swa: dict[str, SwaRule]
    speculative: dict[str, SpecRule] = {}
    rope: dict[str, RopeRule] = {}
    sampler: dict[str, SamplerRule] = {}
    buffers: dict[str, BufferRule] = {}


@functools.cache
def devices() -> dict[str, Device]:
    return typed("fit_devices.toml", _Devices).devices


@functools.cache
def _rules() -> _Rules:
    return typed("fit_rules.toml", _Rules)


@functools.cache
def rules() -> dict[str, Rule]:
    """fit_rules.toml's rules, each rule's ``releases`` with every release file that names it
    (``fit_rule``, planner/data/releases/): a release file is found by fit with no other edit."""
    from capture_plan.planner.inputs.releases import releases as release_files

    out = dict(_rules().rules)
    for f in release_files():
        if f.fit_rule not in out:
            raise RuntimeError(f"planner/data/releases/{f.engine}-{f.version}.toml: no fit rule {f.fit_rule!r}")
        r = out[f.fit_rule]
        if f.version not in r.releases:
            out[f.fit_rule] = msgspec.structs.replace(r, releases=[*r.releases, f.version])
    return out


def context_rules() -> dict[str, ContextRule]:
    return _rules().context


def context_rule(engine: str, version: str) -> tuple[str, ContextRule]:
    """The context-length rule of a modelled release (every one has one: tests/test_fit_context.py)."""
    for name, r in context_rules().items():
        if r.engine == engine and version in r.releases:
            return name, r
    raise RuntimeError(f"planner/data/fit_rules.toml: no [context] rule for {engine}=={version}")


def _listed(rows: dict, engine: str, version: str) -> tuple[str, Any] | None:
    """(name, rule) of ``engine``'s row that lists ``version`` (None: no row does)."""
    return next(((n, r) for n, r in rows.items() if r.engine == engine and version in r.releases), None)


def _nearest(rows: dict, engine: str, version: str) -> tuple[str, Any, bool]:
    """(name, rule, read) of ``engine``'s rows for ``version``: the row listing it, else the
    nearest read release's (the newest at or below it, else the oldest)."""
    if (listed := _listed(rows, engine, version)) is not None:
        return *listed, True
    own = [(n, r) for n, r in rows.items() if r.engine == engine]
    want = Version(version)
    below = [(Version(v), n, r) for n, r in own for v in r.releases if Version(v) <= want]
    everything = sorted(((Version(v), n, r) for n, r in own for v in r.releases), key=lambda x: x[0])
    _, n, r = max(below, key=lambda x: x[0]) if below else everything[0]
    return n, r, False


def rope_rule(engine: str, version: str) -> tuple[str, RopeRule, bool]:
    """The rotary-cache rule of ``engine``'s release: (its name, the rule, whether the release
    was read for it); a release not read takes the engine's nearest read (the newest at or
    below it, else the oldest)."""
    return _nearest(_rules().rope, engine, version)


def sampler_rules() -> dict[str, SamplerRule]:
    return dict(_rules().sampler)


def sampler_rule(engine: str, version: str) -> SamplerRow:
    """The dummy-sampler rule of ``engine``'s release (fit_rules.toml [sampler]); a release not
    read for it takes the nearest read release's row, as :func:`rope_rule`."""
    name, rule, read = _nearest(_rules().sampler, engine, version)
    return SamplerRow(name, rule, version, read)


def buffer_rules() -> dict[str, BufferRule]:
    return dict(_rules().buffers)


def buffer_rule(engine: str, version: str) -> tuple[str, BufferRule] | None:
    """The persistent-buffer rule of a release (None: the release was not read for it)."""
    return _listed(_rules().buffers, engine, version)


def spec_rule(engine: str, version: str) -> tuple[str, SpecRule] | None:
    """The speculative-decoding rule of a release (None: the release was not read for it)."""
    return _listed(_rules().speculative, engine, version)


def spec_rules() -> dict[str, SpecRule]:
    return dict(_rules().speculative)


def swa_rule(engine: str, version: str) -> SwaRule | None:
    """The hybrid sliding-window pool rule of a release (None: the engine has none, vLLM)."""
    return next((r for r in _rules().swa.values() if r.engine == engine and version in r.releases), None)


@functools.cache
def wheels() -> dict[str, Wheel]:
    """Every modelled release's wheel (fit_rules.toml's and the release files'), rule by rule."""
    from capture_plan.planner.inputs.releases import releases as release_files

    known = dict(_rules().wheels)
    known.update({f"{f.engine}=={f.version}": Wheel(f.wheel.file, f.wheel.sha256) for f in release_files()})
    order = [f"{r.engine}=={v}" for r in rules().values() for v in r.releases]
    return {k: known[k] for k in order + sorted(set(known) - set(order)) if k in known}


@functools.cache
def estimates() -> dict:
    return data("fit_estimates.toml")


def releases() -> list[str]:
    """Every modelled release as ``ENGINE==VERSION``, each engine's newest first."""
    out = [(r.engine, Version(v)) for r in rules().values() for v in r.releases]
    return [f"{e}=={v}" for e, v in sorted(out, key=lambda x: (x[0] != "vllm", x[0], [-p for p in x[1].release]))]


def device(name: str) -> tuple[str, Device]:
    """The device ``name`` names, as every command reads ``--device``
    (:func:`capture_plan.planner.inputs.devices.device_name`: torch's name, or words of exactly
    one), with its memory total: another is a :class:`.refusal.Refusal` naming the candidates,
    its change the nearest device with one."""
    from capture_plan.planner.inputs.devices import DeviceRefused, device_name

    try:
        key = device_name(name, ("memory",))
    except DeviceRefused as err:
        raise Refusal(err.what, where=err.where or "--device", hint=err.hint, changes={"device": err.near}) from None
    return key, devices()[key]


def rule_for(engine: str) -> tuple[str, str, str, Rule]:
    """``ENGINE==VERSION`` -> (engine, version, rule name, rule). A version no rule covers is
    refused naming the nearest modelled release of that engine."""
    name, sep, version = (p.strip() for p in engine.partition("=="))
    name = name.strip().lower()
    known = {n: r for n, r in rules().items() if r.engine == name}
    if not sep or not known:
        engines = sorted({r.engine for r in rules().values()})
        # a known engine without its version: its newest modelled release; else the newest of all
        own = [r for r in releases() if r.startswith(f"{name}==")]
        raise Refusal(
            f"unknown engine {engine!r}",
            where="--engine",
            hint=f"ENGINE==VERSION with ENGINE one of {', '.join(engines)}",
            changes={"engine": (own or releases())[0]},
        )
    for rname, r in known.items():
        if version in r.releases:
            return name, version, rname, r
    modelled = sorted((v for r in known.values() for v in r.releases), key=Version)
    try:
        want = Version(version)
        # the newest modelled release at or below the one asked (its rule is the latest that can
        # have carried over), else the oldest: vllm==9.9 -> 0.34.0, vllm==0.18.0 -> 0.19.0
        below = [v for v in modelled if Version(v) <= want]
        nearest = below[-1] if below else modelled[0]
    except InvalidVersion:
        nearest = (difflib.get_close_matches(version, modelled, n=1, cutoff=0) or modelled)[-1]
    raise Refusal(
        f"{name} {version} has no modelled sizing rule (modelled: {', '.join(modelled)})",
        where="--engine",
        hint=f"the nearest modelled release is {name}=={nearest}",
        changes={"engine": f"{name}=={nearest}"},
    )
