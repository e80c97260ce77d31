"""What the engine plugins share, engine-neutral: the setting that enables them, the
release check, the plan checked against the engine, and one process's adoption (the
loop made at the first capture, or the engine's own capture where the operator chose
to fall back).

Enabled by one setting: ``CAPTURE_PLAN_PLAN=plans/my-model.json`` (the plan file).
Unset, the plugins return at once and change nothing. ``CAPTURE_PLAN_FALLBACK=engine``
makes a refusal (a missing, invalid or mismatched plan, an engine that does not import) a
logged warning after which the engine captures as it always does; the default, ``refuse``,
stops the engine with the one line. An engine whose hook points moved is not a refusal: see
below. Never a half-adopted capture: the decision is made
before the first graph, and an error inside the loop releases everything it captured
(``CaptureLoop.part``).

What is checked against the engine (:func:`check_plan`): the plan decodes and fits this
machine (``capture_plan.executor.load``), its tensor-parallel size is the engine's, its
model config (where the plan names one) is the engine's file byte for byte, and it has a
phase for every runner that captures. Where the engine layer can list every graph it will
capture before the first (vLLM's descriptors: :class:`EngineKey`), :func:`match_keys`
checks them against the plan's graph keys one for one, and that the plan's order is one
the engine can follow (:attr:`EngineKey.rank`); otherwise the engine layer compares sizes
at the first capture of each phase (SGLang's runners).

Which release's hook points: at registration, after the plan is read (a wrong plan is
reported whatever the engine's state), the installed engine's objects are checked live
(:func:`capture_plan.adapters.plugins.live.live_release`: the rows the plugin resolves,
replaces or calls, by signature introspection of the imported engine), not only its version
string. A release whose objects match a known release's rows (its own, or for an unknown
release the newest that matches) is captured by the plan, with one INFO line naming the
release, the rows checked and the plan; where none match, the engine captures as it does,
with one WARNING naming the first mismatched row (``CAPTURE_PLAN_STRICT=1``: the start-up
stops with that line instead). An engine that is not installed, or whose modules fail to
import (a dependency missing), is a refusal naming what to install.

Importing this module imports neither torch nor an engine.
"""

from __future__ import annotations

import functools
import importlib
import importlib.metadata
import logging
import os
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from capture_plan.adapters.plugins.hook_point import HookPoint
from capture_plan.adapters.plugins.live import HooksMoved, checked, live_release
from capture_plan.adapters.plugins.refusal import ENV_PLAN, PluginRefused
from capture_plan.schemas.errors import CapturePlanError

if TYPE_CHECKING:
    from capture_plan.schemas.key_fields import KeyFields
    from capture_plan.schemas.keys import GraphKey
    from capture_plan.schemas.plan import Plan

#: "refuse" (default) or "engine": what a refusal does
ENV_FALLBACK = "CAPTURE_PLAN_FALLBACK"
#: "1": an engine whose hook points moved stops the start-up instead of capturing as it does
ENV_STRICT = "CAPTURE_PLAN_STRICT"
#: a graph file: the plan's graphs restored from it where it is there, written to it after the
#: capture where it is not (:mod:`.restoring`)
ENV_GRAPHS = "CAPTURE_PLAN_GRAPHS"
log = logging.getLogger("capture_plan.plugins")


@dataclass(frozen=True)
class Settings:
    """The plugins' setting, read from the environment (:func:`settings`)."""

    plan: Path
    fallback: Literal["refuse", "engine"] = "refuse"
    #: the graph file (``CAPTURE_PLAN_GRAPHS``), None where unset
    graphs: Path | None = None


def settings(environ: Mapping[str, str] = os.environ) -> Settings | None:
    """The setting, or None where ``CAPTURE_PLAN_PLAN`` is unset or empty (disabled; a graph
    file named without a plan is refused: it holds a plan's graphs)."""
    path = environ.get(ENV_PLAN, "").strip()
    graphs = environ.get(ENV_GRAPHS, "").strip()
    if not path:
        if graphs:
            raise PluginRefused(
                f"{ENV_GRAPHS}={graphs} is set without {ENV_PLAN}: a graph file holds the graphs of a plan",
                where="the environment",
                fix=f"export {ENV_PLAN}=plans/my-model.json (the plan the file was saved for), or unset {ENV_GRAPHS}",
            )
        return None
    fallback = environ.get(ENV_FALLBACK, "refuse").strip() or "refuse"
    if fallback not in ("refuse", "engine"):
        raise PluginRefused(
            f"{ENV_FALLBACK}={fallback!r} is neither 'refuse' nor 'engine'",
            where="the environment",
            fix=f"export {ENV_FALLBACK}=refuse (stop the engine) or {ENV_FALLBACK}=engine (capture as the engine does)",
        )
    return Settings(Path(path), fallback, Path(graphs) if graphs else None)  # type: ignore[arg-type]


def installed(dist: str) -> str:
    """The installed release of ``dist`` ("(not installed)" where it is not)."""
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "(not installed)"


def resolve(h: HookPoint) -> Any:
    """The object a hook point names, imported from the engine."""
    obj: Any = importlib.import_module(h.module)
    for part in h.name.split("."):
        obj = getattr(obj, part)
    return obj


@dataclass(frozen=True)
class EngineFacts:
    """What the engine says about itself at its first capture."""

    engine: str
    #: the tensor-parallel size
    tp: int = 1
    #: the model's config.json, where the engine has one on disk
    model_config: Path | None = None
    #: the phases of the runners that capture (plan phase names)
    phases: tuple[str, ...] = ()
    #: every graph the engine will capture, where it knows them before the first (else empty)
    keys: tuple[EngineKey, ...] = ()
    #: how the engine orders its captures, for the refusal of a plan it cannot follow
    order: str = ""


def _no_key_fields() -> KeyFields:
    from capture_plan.schemas.key_fields import KeyFields  # msgspec loads with the first key

    return KeyFields()


def key_fields_of(engine: str, native: object) -> KeyFields:
    """The key fields of ``engine``'s graph ``native`` (vLLM's descriptor), as schemas/key_fields.py reads them."""
    from capture_plan.schemas.key_fields import engine_fields

    return engine_fields(engine, native)


@dataclass(frozen=True)
class EngineKey:
    """One graph the engine will capture, in the plan's terms: the engine layer names
    the phase and labels (its own key, ``native``, kept for it), the plan's key is
    found by (phase, tokens, labels, key fields) (:func:`match_keys`)."""

    phase: str
    #: tokens the graph runs (the plan's bs x the phase's tokens per request)
    tokens: int
    #: (axis, label) pairs, any order
    labels: tuple[tuple[str, str], ...] = ()
    #: the graph-key fields (micro-batches, ...: :func:`key_fields_of`), UNSET at their unset value
    fields: KeyFields = field(default_factory=_no_key_fields)
    #: where the engine's loop puts it: a plan whose order decreases the rank cannot be followed
    rank: tuple[int, ...] = ()
    #: labels that mean "no variant" (vLLM's ``lora=0``): left out where the plan's phase
    #: has no such axis, so a plan without LoRA axes matches an engine without LoRA
    defaults: tuple[tuple[str, str], ...] = ()
    #: the engine's own key (a vLLM descriptor and its manager)
    native: Any = field(default=None, compare=False)

    def text(self) -> str:
        labels = ",".join(f"{a}={v}" for a, v in sorted(self.labels) if (a, v) not in self.defaults)
        from capture_plan.schemas.key_fields import shown  # loaded with the key's fields

        return f"{self.phase}/{self.tokens} tokens{'/' + labels if labels else ''}{shown(self.fields)}"


def load(s: Settings) -> Plan:
    """The plan file, decoded and validated (no environment check: that is
    :func:`check_plan`'s, at capture); :class:`PluginRefused` naming the file where it
    is missing or invalid."""
    from capture_plan.executor.load import load_plan

    if not s.plan.is_file():
        raise PluginRefused(
            "the plan file is not there",
            where=f"{ENV_PLAN}={s.plan}",
            fix=f"build it (planner build ... -o {s.plan}), or unset {ENV_PLAN}",
        )
    try:
        return load_plan(s.plan, check_env=False)
    except CapturePlanError as err:
        raise PluginRefused(
            f"the plan cannot be used: {err}",
            where=f"{ENV_PLAN}={s.plan}",
            fix=f"rebuild it with this planner (planner check {s.plan.parent}), or unset {ENV_PLAN}",
        ) from err


def _few(items: list[str], n: int = 3) -> str:
    more = f" and {len(items) - n} more" if len(items) > n else ""
    return ", ".join(items[:n]) + more


def match_keys(plan: Plan, facts: EngineFacts) -> tuple[dict[EngineKey, GraphKey], list[str]]:
    """The plan's graph key of each of ``facts.keys`` (by phase, tokens, labels and key fields, however the
    engine layer spells them), and the problems: engine graphs the plan does not hold, plan keys the engine
    does not capture, the first pair the plan orders against the engine's loop (``rank``). Engine-neutral."""
    from capture_plan.schemas.key_fields import key_fields
    from capture_plan.schemas.keys import phase_axes, step_key

    plan_keys = [step_key(plan, s) for s in plan.steps if s.op == "capture"]
    index = {(k.phase, k.tokens, frozenset(k.labels), k.fields): k for k in plan_keys}
    axes = {p.name: set(phase_axes(p)) for p in plan.phases}
    matched: dict[EngineKey, GraphKey] = {}
    extra, taken = [], set()
    for e in facts.keys:
        labels = frozenset(lv for lv in e.labels if lv[0] in axes.get(e.phase, ()) or lv not in e.defaults)
        k = index.get((e.phase, e.tokens, labels, key_fields(e.fields)))
        if k is None or k in taken:
            extra.append(e.text())
            continue
        taken.add(k)
        matched[e] = k
    missing = [k.id for k in plan_keys if k not in taken]
    problems = []
    if extra:
        problems.append(f"{facts.engine} captures {len(extra)} graphs the plan does not hold ({_few(extra)})")
    if missing:
        problems.append(f"the plan holds {len(missing)} graph keys {facts.engine} does not capture ({_few(missing)})")
    if not problems:
        rank = {k: e.rank for e, k in matched.items()}
        for a, b in zip(plan_keys, plan_keys[1:]):
            if rank[b] < rank[a]:
                problems.append(
                    f"the plan captures {a.id} before {b.id}, which {facts.engine} cannot follow ({facts.order})"
                )
                break
    return matched, problems


def check_plan(plan: Plan, path: Path, facts: EngineFacts, env_problems: Iterable[str] = ()) -> None:
    """:class:`PluginRefused`, one line naming the plan, where ``plan`` is not this
    engine's: the machine (``env_problems``, from ``capture_plan.executor.load``), the
    tensor-parallel size, the model config, a capturing runner's phase."""
    from capture_plan.schemas.codec import sha256

    where = f"{ENV_PLAN}={path}"
    problems = list(env_problems)
    if plan.requires.tp != facts.tp:
        problems.append(f"it is for TP {plan.requires.tp}, {facts.engine} runs TP {facts.tp}")
    digest = getattr(plan.inputs, "model_config_digest", None)
    if isinstance(digest, str) and facts.model_config is not None and facts.model_config.is_file():
        if sha256(facts.model_config.read_bytes()) != digest:
            problems.append(f"it was built for another model ({plan.inputs.model_config}, not {facts.model_config})")
    phases = {p.name for p in plan.phases}
    missing = [p for p in facts.phases if p not in phases]
    if missing:
        has = sorted(phases)
        problems.append(f"it has no phase {', '.join(missing)} ({facts.engine} captures it; the plan has {has})")
    if facts.keys and not missing:
        problems += match_keys(plan, facts)[1]
    if problems:
        raise PluginRefused(
            f"the plan is not this engine's: {'; '.join(problems)}",
            where=where,
            fix=f"build the plan for this model, device and TP size (planner build ... -o {path}), "
            f"or {ENV_FALLBACK}=engine to capture as {facts.engine} does",
        )


@dataclass
class Adoption:
    """One process's plan-routed capture, shared by every runner of the engine.

    :meth:`begin` decides once, at the first capture: the loop over the plan
    (``make_loop(plan, stream, on_failure)``), or None where the operator chose the
    engine's own capture after a refusal. The engine layer records the backends that
    hold graphs (:attr:`holders`: their ``cleanup`` is called when the loop fails) and
    the step in progress (:attr:`current`)."""

    settings: Settings
    engine: str
    make_loop: Callable[..., Any]
    plan: Any = None
    loop: Any = None
    fallback: bool = False
    current: Any = None
    holders: list = field(default_factory=list)
    #: the facts the loop was made for (their keys matched to the plan's by the engine layer)
    facts: EngineFacts | None = None
    #: the start-up from the graph file (``restoring.GraphStart``), made at the first capture
    graphs: Any = None

    def begin(
        self,
        facts: EngineFacts,
        *,
        stream=None,
        env_problems: Callable[[Any], list[str]] | None = None,
        options: Callable[[Any], dict] | None = None,
    ):
        """The loop, made at the first call; None when capture falls back to the engine's.
        ``options(plan)``: more ``capture_loop`` keywords (the engine's streams)."""
        if self.loop is not None or self.fallback:
            return self.loop
        try:
            plan = load(self.settings)
            check_plan(plan, self.settings.plan, facts, env_problems(plan) if env_problems else ())
        except PluginRefused as err:
            if self.settings.fallback != "engine":
                raise
            log.warning("capture-plan: %s; capturing as %s does (%s=engine)", err, self.engine, ENV_FALLBACK)
            self.fallback = True
            return None
        self.plan = plan
        self.facts = facts
        more = options(plan) if options is not None else {}
        self.loop = self.make_loop(plan, stream=stream, on_failure=self._dropped, **more)
        log.info("capture-plan: %s captures through %s", self.engine, self.settings.plan)
        return self.loop

    def _dropped(self) -> None:
        for holder in self.holders:
            holder.cleanup()

    def captured(self):
        """The loop's GraphSet once its capture closed; None before (and for a start-up
        restored from a graph file, whose loop never opens)."""
        try:
            return self.loop.graphs if self.loop is not None else None
        except CapturePlanError:  # the loop has not finished (an ExecutorError): it holds no set yet
            return None

    def step(self, phase: str, bs: int, labels: Mapping[str, str | None]):
        """Begin the plan's step for ``phase`` at ``bs`` (with variant ``labels``, where
        the loop takes them)."""
        labels = {k: v for k, v in labels.items() if v is not None}
        if labels:
            try:
                self.current = self.loop.step(phase, bs, **labels)
            except TypeError:
                raise PluginRefused(
                    f"{self.engine} captures variants {labels} of {phase}/{bs}; this executor's loop takes none",
                    where=f"{ENV_PLAN}={self.settings.plan}",
                    fix=f"capture without variants, or {ENV_FALLBACK}=engine",
                ) from None
        else:
            self.current = self.loop.step(phase, bs)
        return self.current


#: how far an engine's measured capture may be from the plan's prediction before the check
#: warns: the larger of this share of the prediction and :data:`GAP_FLOOR` (a free-memory
#: figure moves with the driver's own allocations, which the plan predicts as one item)
GAP_SHARE = 0.05
GAP_FLOOR = 16 << 20


def check_capture(adoption: Adoption, measured: Any, who: str, sized: str, *, record: bool) -> int | None:
    """The plan's whole-capture figure (``capture_memory``) against ``measured``, what the
    capture took (``who``'s measure): with ``record``, the figure into the loop's capture
    report (``engine_capture_bytes``: the engine's own measure), and one WARNING naming the
    gap where it is wider than :data:`GAP_SHARE` of the prediction (:data:`GAP_FLOOR` at
    least), ``sized`` saying how the engine sized its KV cache. Returns the gap (measured -
    predicted); None where the plan's figure is incomplete or nothing was measured."""
    import msgspec

    from capture_plan.schemas.keys import capture_memory

    if adoption.plan is None or not isinstance(measured, int):
        return None
    memory = capture_memory(adoption.plan)
    if not memory.complete:
        return None
    predicted = int(memory.bytes)
    gs = adoption.captured()
    if record and gs is not None and gs.report is not None:
        gs.report = msgspec.structs.replace(gs.report, engine_capture_bytes=measured)
    gap = measured - predicted
    if abs(gap) > max(GAP_FLOOR, int(GAP_SHARE * predicted)):
        log.warning(
            "capture-plan: %s's capture took %d B, the plan predicted %d B (%s by %d B; %s): recalibrate the "
            "plan from this device's capture report (planner build ... --calibration REPORT)",
            who,
            measured,
            predicted,
            "more" if gap > 0 else "less",
            abs(gap),
            sized,
        )
    return gap


def refuse_once(err: PluginRefused) -> SystemExit:
    """The one line an engine's start-up stops with (``capture-plan: <what>``): a
    SystemExit, because SGLang's plugin loader logs and ignores an Exception."""
    return SystemExit(f"capture-plan: {err}")


def fallback_or_exit(s: Settings, err: PluginRefused, engine: str) -> None:
    """At registration: log and return where the operator chose the engine's capture,
    else stop the process with the one line."""
    if s.fallback == "engine":
        log.warning("capture-plan: %s; capturing as %s does (%s=engine)", err, engine, ENV_FALLBACK)
        return
    raise refuse_once(err) from err


def strict(environ: Mapping[str, str] = os.environ) -> bool:
    """Whether ``CAPTURE_PLAN_STRICT=1``: an engine whose hook points moved stops the start-up."""
    return environ.get(ENV_STRICT, "").strip() == "1"


def register(engine: str, install: Callable[[Settings, str], object], live: tuple[str, ...]) -> None:
    """An engine plugin's entry point: nothing unless ``CAPTURE_PLAN_PLAN`` is set; then the
    plan loaded once (a missing or invalid plan stops start-up here, or falls back where the
    operator chose so, whatever the engine's state), the release check (``live``: the rows
    checked on the imported engine, ``live.live_release``: an engine that does not import is
    refused the same way), one INFO line, and ``install(settings, release)``, ``release`` the
    known release whose hook points the engine has.

    Hook points that moved never stop the engine unless the operator asked for it
    (``CAPTURE_PLAN_STRICT=1``): one WARNING naming the first mismatched row, and the
    engine captures as it does."""
    try:
        s = settings()
    except PluginRefused as err:
        raise refuse_once(err) from err
    if s is None:
        return
    try:
        load(s)
        version = installed(engine)
        release = live_release(engine, version, live)
    except HooksMoved as err:
        if strict():
            raise refuse_once(err) from err
        log.warning("capture-plan: %s; capturing as %s does (%s=1 stops instead)", err, engine, ENV_STRICT)
        return
    except PluginRefused as err:
        fallback_or_exit(s, err, engine)
        return
    log.info("capture-plan: %s: captured by the plan %s", checked(engine, version, release, live), s.plan)
    install(s, release)


# -- what every plugin's install opens with ----------------------------------------------------


def env_problems(plan) -> list[str]:
    """What this machine lacks of the plan's requirements (``capture_plan.executor.load``)."""
    from capture_plan.executor.load import check_environment, current_environment

    return check_environment(plan, current_environment(tuple(plan.requires.modules)))


def loop_maker(options: Callable[[], Mapping[str, Any]]) -> Callable[..., Any]:
    """``make_loop(plan, *, stream=None, on_failure=None, **more)`` for :class:`Adoption`:
    ``capture_loop`` with ``options()`` (read at the call: a plugin's ``LOOP_OPTIONS``,
    which the CPU tests set) and ``more``; ``stream`` only where given (else the loop's own)."""

    def make_loop(plan, *, stream=None, on_failure=None, **more):
        from capture_plan.executor import capture_loop

        given = {"stream": stream} if stream is not None else {}
        return capture_loop(plan, on_failure=on_failure, **given, **{**options(), **more})

    return make_loop


def opening(engine: str, s: Settings, anchor: type, make_loop: Callable[..., Any]) -> tuple[Adoption, bool]:
    """Every plugin's install opens here: the process's adoption, and whether it is new.
    ``anchor`` (the engine class the plugin installs on) carries it as ``__capture_plan__``:
    a second install in the process (another entry into the engine's plugin loader) finds it
    and installs nothing again."""
    found = getattr(anchor, "__capture_plan__", None)
    if found is not None:
        return found, False
    adoption = Adoption(s, engine, make_loop=make_loop)
    anchor.__capture_plan__ = adoption  # type: ignore[attr-defined]
    return adoption, True


def wrap(original: Callable[..., Any], routed: Callable[..., Any], *bound: Any) -> Callable[..., Any]:
    """A method that calls ``routed(*bound, self, *args, **kw)`` in place of ``original``, with
    its name, docstring and signature (``functools.wraps``: the live check reads through it)."""

    @functools.wraps(original)
    def method(self, *args, **kw):
        return routed(*bound, self, *args, **kw)

    return method
