"""fit's request and its inputs resolved once. A :class:`FitRequest` is what a caller asks
(the model, the device as named, ``ENGINE==VERSION``, tp, the engine's flags, the optional
plan and measured graph figure), made once by the CLI, a build's pricer or a bench and
passed whole; :func:`resolve` turns it into :class:`FitInputs`: the device row, the
release's rule and wheel, the checked flags, the context length, the KV layer types and
their bytes per token. Every engine layer reads this one frozen value.
"""

from __future__ import annotations

import msgspec

from capture_plan.schemas.fit import FitItem, KvLayerType

from . import flags as engine_flags
from .context import Length, context_length
from .draft import Draft, draft_of
from .model import KV_DTYPES, FitModel, kv_bytes_per_token
from .refusal import INPUTS, Refusal
from .tables import Device, Rule, context_rule, device, rule_for, wheels

__all__ = ["PlanGraphs", "FitRequest", "FitInputs", "resolve"]


class PlanGraphs(msgspec.Struct, frozen=True):
    """A capture-plan plan's graphs as fit prices them (:func:`.measured.plan_graphs`)."""

    name: str
    #: every phase's capture sizes, sorted, deduplicated
    sizes: list[int]
    #: graphs the plan captures (its capture steps: one per size, phase and variant)
    graphs: int
    #: the plan's predicted pool and hoisted workspaces: the pool part of the graph figure
    pool_bytes: int
    source: str
    #: the plan's attention backend (planner/data/backends.toml): an engine's kernel temporaries
    #: that the plan's simulation does not hold are added to its pool only for the backend whose
    #: kernels allocate them (vLLM's FA3 split-KV accumulators: "fa3")
    backend: str = ""
    #: the plan has speculative phases (its own draft graphs, which stand for the engine's:
    #: fit adds no draft graphs of its own beside its figure)
    speculative: bool = False


class FitRequest(msgspec.Struct, frozen=True):
    """One fit request as given, made once by its caller and passed whole (:func:`.fit.fit`,
    :func:`resolve`, planner/fit/kv_price.py ``KvPricer``): nothing in it is checked until it
    is resolved."""

    model: FitModel
    #: the device as named (exactly, or uniquely by a part: ``H100``)
    device: str
    #: ``ENGINE==VERSION``
    engine: str
    tp: int = 1
    #: the engine's flags by fit's name (planner/data/fit_flags.toml); None or absent: the
    #: release's default
    flags: dict = {}
    #: a graph figure measured on the device (a calibration, or the engine's own logged
    #: estimate) in place of fit's estimate of the graphs captured
    measured_graph: FitItem | None = None
    #: a plan whose sizes and phases replace the engine default's
    plan: PlanGraphs | None = None
    #: ``measured_graph`` was measured of a plan with speculative phases (its verify and draft
    #: graphs: planner/inputs/specs.py speculative_kinds); without it, under speculative
    #: decoding the measured figure holds none of the draft's graphs (:attr:`FitInputs.graph_measured`)
    measured_speculative: bool = False
    #: the capture sizes ``measured_graph`` is of (every phase's: a build's plan, a size list),
    #: at which the engine's speculator captures a draft's graphs beside it; () its figure is
    #: of no graphs at all (the draft's none either); None not given (the engine default's)
    figure_sizes: tuple[int, ...] | None = None
    #: ``measured_graph`` is of a plan with speculative phases, measured or not: it holds the
    #: draft's graphs itself (fit adds none beside it; uncalibrated, it is no figure of them)
    figure_speculative: bool = False
    #: more capture-size lists to price as the engine default's is, by name (their rows follow the
    #: engine default's and the plan's): a traffic's front (planner/sizes/fit_traffic.py)
    lists: dict[str, list[int]] = {}

    def changed(self, changes: dict[str, object]) -> FitRequest:
        """This request with a refusal's or a fix's ``changes`` (planner/fit/refusal.py: an
        engine flag by fit's name, None: left out; ``tp``, ``engine``, ``device``) applied. A
        new engine keeps only the flags it has (SGLang's are no vLLM flags)."""
        flags = {k: v for k, v in self.flags.items() if v is not None}
        for name, value in changes.items():
            if name not in INPUTS:
                flags.pop(name, None)
                if value is not None:
                    flags[name] = value
        engine = str(changes.get("engine", self.engine))
        if "engine" in changes:
            have = set(engine_flags.flags_of(engine.split("==")[0].strip().lower()))
            flags = {k: v for k, v in flags.items() if k in have}
        return msgspec.structs.replace(
            self,
            device=str(changes.get("device", self.device)),
            engine=engine,
            tp=int(str(changes["tp"])) if "tp" in changes else self.tp,
            flags=flags,
        )


class FitInputs(msgspec.Struct, frozen=True):
    """What fit sizes, resolved once by :func:`resolve` from ``request``."""

    request: FitRequest
    device_name: str
    device: Device
    engine: str
    version: str
    rule_name: str
    rule: Rule
    wheel_sha256: str
    #: the request's tp, checked (1 to 64, dividing the attention heads)
    tp: int
    #: the engine's flags as given, checked (:func:`.flags.check`); absent: the release's default
    flags: dict
    #: KV bytes one token takes in one layer on one rank, in the KV cache dtype
    per_layer: int
    kv_layers: list[KvLayerType]
    #: the engine's context length (max-model-len, context-length): given or the release's
    #: default, checked against what the release takes (:func:`.context.context_length`)
    context: Length
    #: speculative decoding's draft (None: none), resolved once by :func:`.draft.draft_of`
    draft: Draft | None = None

    @property
    def model(self) -> FitModel:
        """The request's model (every engine layer reads it)."""
        return self.request.model

    def context_notes(self) -> list[str]:
        """What fit says of the context length: one past the model's that the engine's variable let
        through; one the release lowered to the speculative draft's."""
        c, d = self.context, self.draft
        notes = []
        if c.allowed_by and c.limit is not None:
            notes.append(
                f"{c.allowed_by} is set: the engine takes {c.value:,} tokens, past the {c.shown} it derives "
                f"({c.how}), and warns that positions past it give NaN or out-of-bounds reads"
            )
        if d is not None and d.limit_log:
            notes.append(
                f"{self.engine} {self.version} lowers max-model-len to the draft's {d.max_model_len:,} "
                f"(vllm/config/vllm.py: VllmConfig._limit_max_model_len_to_draft), logging: {d.limit_log}"
            )
        return notes

    @property
    def speculative_graphs(self) -> bool:
        """Speculative decoding captures graphs fit has no measured figure near
        (:func:`.result.draft_graphs`): a draft model's (vLLM; n-gram has none), or any method's
        at the target's verify widths (SGLang)."""
        d = self.draft
        return d is not None and (d.counted != "none" or self.engine == "sglang")

    @property
    def graph_measured(self) -> FitItem | None:
        """The request's measured graph figure where it holds every graph the engine captures:
        under :attr:`speculative_graphs`, only one measured of a plan with speculative phases
        (``measured_speculative``); else None, and the graph memory is unknown (never the
        target's graphs alone, the draft's priced as 0)."""
        req = self.request
        return req.measured_graph if not self.speculative_graphs or req.measured_speculative else None

    @property
    def measured_without_drafts(self) -> FitItem | None:
        """The request's measured graph figure where :attr:`graph_measured` does not take it (a
        plan without speculative phases: it holds none of their graphs), for the unknown item to
        say so; else None."""
        return self.request.measured_graph if self.graph_measured is None else None

    @property
    def kv_dtype_bytes(self) -> int:
        return self.kv_layers[0].dtype_bytes if self.kv_layers else 0

    def flag(self, name: str, default):
        """The flag's value as given, else ``default`` (the release's)."""
        v = self.flags.get(name)
        return default if v is None else v


def resolve(req: FitRequest) -> FitInputs:
    """``req`` resolved: an unknown device, release or flag, or a value out of its bounds, is refused."""
    model, tp = req.model, req.tp
    eng, version, rule_name, rule = rule_for(req.engine)
    dev_name, dev = device(req.device)
    if tp < 1 or tp > 64:
        raise Refusal(
            f"--tp must be 1 to 64, got {tp}",
            where="--tp",
            hint="the GPUs one model instance spans",
            changes={"tp": 1 if tp < 1 else max(n for n in range(1, 65) if model.heads % n == 0)},
        )
    if model.heads % tp:  # both engines refuse it (vllm/config/model.py: ModelConfig.verify_with_parallel_config;
        # sglang's models assert total_num_heads % tp_size == 0)
        works = [n for n in range(1, min(model.heads, 64) + 1) if model.heads % n == 0]
        raise Refusal(
            f"--tp {tp} does not divide {model.name}'s {model.heads} attention heads",
            where="--tp",
            hint=f"one of {', '.join(map(str, works))}",
            changes={"tp": max(n for n in works if n <= tp)},
        )
    checked = engine_flags.check(eng, req.flags)
    flag = context_rule(eng, version)[1].flag
    length = context_length(model, eng, version, checked.get(flag))
    kv_dtype = KV_DTYPES[checked.get("kv-cache-dtype", "auto")] or model.dtype_bytes
    per_layer = kv_bytes_per_token(model, tp, kv_dtype)
    kinds = []
    if model.full_layers:
        kinds.append(
            KvLayerType("MLA latent" if model.mla else "full attention", model.full_layers, per_layer, kv_dtype)
        )
    if model.sliding_layers:
        kinds.append(KvLayerType("sliding window", model.sliding_layers, per_layer, kv_dtype))
    inp = FitInputs(
        request=req,
        device_name=dev_name,
        device=dev,
        engine=eng,
        version=version,
        rule_name=rule_name,
        rule=rule,
        wheel_sha256=wheels()[f"{eng}=={version}"].sha256,
        tp=tp,
        flags=checked,
        per_layer=per_layer,
        kv_layers=kinds,
        context=length,
    )
    d = draft_of(inp)
    if d is not None and d.max_model_len:  # the release lowers max-model-len to the draft's (.draft._limit)
        length = length._replace(value=d.max_model_len)
    return msgspec.structs.replace(inp, draft=d, context=length)
