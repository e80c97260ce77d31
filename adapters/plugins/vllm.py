"""The vLLM plugin: a ``vllm.general_plugins`` entry point (pyproject.toml) that routes
what the V2 GPU model runner captures through a capture plan, and answers its
graph-memory estimate from the plan.

Enabled by ``CAPTURE_PLAN_PLAN`` (:mod:`.core`); unset, :func:`register` returns without
touching vLLM. vLLM calls general plugins in every process and lets their exceptions
stop it: a refusal is :class:`SystemExit` with the one line. Its hook points are rows of
:mod:`.hooks` per release (0.33.0 and 0.34.0, one plan file format for both), checked live
on the imported vLLM at registration (:data:`LIVE`, ``live.live_release``): an unknown
release whose objects are a known release's is captured by the plan with that release's
shape (:func:`shape_of`), one whose objects moved captures as vLLM does after one warning
(``CAPTURE_PLAN_STRICT=1``: stopped). What it wraps, on the classes:

* ``GPUModelRunner.capture_model``: the first capture of the process lists every graph
  the runner's managers will capture (the model's ``ModelCudaGraphManager`` and every
  ``CudaGraphManager`` of the speculator, as vLLM's own profiling pass finds them), names
  each in the plan's terms (:func:`engine_keys`) and checks them against the plan's graph
  keys, one for one and in an order vLLM can follow (``core.match_keys``), before the
  first graph; then the whole capture is one part of the plan's loop, which must be
  complete when it returns. ``profile_only`` captures (vLLM's own estimate, where the
  operator chose it) and captures after the loop closed (elastic EP's re-capture) are
  vLLM's own, with a warning for the latter;
* ``CudaGraphManager.capture`` (every manager: the model's, the speculator's
  ``SpeculatorCudaGraphManager``): its descriptors iterated in the plan's order within
  each mode (vLLM records PIECEWISE, then FULL), each descriptor one plan step taken at
  its warm-up build (``create_forward_fn(desc, warmup=True)``), its warm-up run inside
  ``step.warmup()`` where the plan declares what it keeps (the persistent hidden-state
  buffer), a FULL graph recorded into the step's pool (``self.pool``) and handed to the
  step with what it returns through (the model's hidden states; a speculator's graph
  writes into its own buffers: None); ``hold(graph=)`` checks the pool. vLLM 0.33.0 sizes
  the persistent hidden states from its first warm-up: a plan that does not start at the
  largest descriptor gets one warm-up at the largest first, inside the first step's
  warm-up block, so what it keeps is measured against what the plan declares (0.34.0
  sizes them up front for the widest descriptor: nothing added). 0.34.0's ``capture``
  takes ``stream``: passed through;
* ``CUDAGraphWrapper.__call__`` (a compiled piece): while a PIECEWISE step's forward
  runs, each piece records into the step's pool and is held as the step's next piece, in
  the order the pieces run; the plan's piece count is checked by the loop;
* ``GPUModelRunner.profile_cudagraph_memory``: where vLLM sizes its KV cache before
  capture (0.33.0; 0.34.0 with the extensible KV cache off), the plan's figure for the
  whole capture (``capture_plan.adapters.profiling``) instead of a profiling capture; a
  plan without a complete figure (not calibrated for a device) is refused (or, with
  ``CAPTURE_PLAN_FALLBACK=engine``, vLLM profiles as it does). vLLM then sizes its KV
  cache with that figure: where the capture that follows falls back to vLLM's own
  (``CAPTURE_PLAN_FALLBACK=engine`` after a refusal), the warning says so. Where vLLM
  sizes its KV cache after capture (0.34.0's extensible KV cache, on by default on CUDA:
  :func:`sizes_kv_cache_after_capture`), vLLM's own answer (0): the plan's figure there
  would be counted twice (it lands in ``reserved_headroom_bytes``). Either way the plan's
  figure is checked against what ``capture_model`` measured (:func:`check_capture`).

With ``CAPTURE_PLAN_GRAPHS=FILE`` (:mod:`.restoring`, :mod:`.vllm_restore`): where FILE is
there, ``capture_model`` restores the plan's graphs from it instead of capturing (each
manager's keys collected, the graphs restored in the last manager's capture and handed to
their managers; refused, one WARNING and every manager's capture through the plan); where it
is not, the capture keeps vLLM's graphs readable and FILE is written once the loop closes.
The restored start-up's prediction is checked as a capture's (:func:`check_capture`, against
what ``capture_model`` measured).

The plan's phases for vLLM's descriptors (:func:`phase_of`): ``piecewise``,
``full_decode`` (uniform-decode or varlen-decode FULL graphs: ``tokens_per_request`` is
the manager's query length), ``full_mixed``, each with ``_ubatch`` for a micro-batch twin
(the phase's ``micro_batches``; a twin is named for the descriptor it is the twin of, so
a mixed FULL graph's twin is ``full_mixed_ubatch`` although ``_maybe_ubatch_twin`` sets
its ``uniform_token_count``), the speculator's prefixed ``draft_<manager>_``
(``draft_prefill_``, ``draft_decode_``); a descriptor's LoRA count is label ``loras``
(``"0"``, ``"1"``...: the planner's axis for vLLM's kinds), where the phase declares it.

Not routed, refused before the first graph (or vLLM's own capture, with a warning, where
the operator chose ``CAPTURE_PLAN_FALLBACK=engine``): breakable PIECEWISE graphs
(``VLLM_USE_BREAKABLE_CUDAGRAPH``), sleep mode's cuMem graph pool, pipeline parallelism
(a rank before the last returns intermediate tensors, not hidden states), and dynamic
speculative decoding (the speculator's draft decode manager makes a graph per speculative
token count inside its own capture, after the plugin checked the keys). A graph a
manager adds after ``capture_model`` listed them by a path the plugin does not know stops
the capture when it happens (the loop releases everything; no fallback is offered then).
Not routed, left to vLLM: encoder graphs and a model state's inner graphs (they record
outside the plan's keys).
"""

from __future__ import annotations

import contextlib
import sys
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from capture_plan.adapters.plugins import core, restoring, vllm_restore
from capture_plan.adapters.plugins.hooks import hook
from capture_plan.adapters.plugins.vllm_keys import (
    ENGINE,
    ORDER,
    _name,
    _unroutable,
    engine_keys,
    facts_of,
    labels_of,
    managers,
    phase_of,
    twin_parents,
)

if TYPE_CHECKING:
    from capture_plan.planner.inputs.releases import ReleaseFacts

__all__ = [
    "ENGINE",
    "ORDER",
    "LIVE",
    "shape_of",
    "register",
    "install",
    "phase_of",
    "twin_parents",
    "labels_of",
    "managers",
    "engine_keys",
    "facts_of",
    "plan_total",
    "sizes_kv_cache_after_capture",
    "check_capture",
]

#: the adoption of this process (None until :func:`install`)
ADOPTION: core.Adoption | None = None
#: extra ``capture_loop`` keywords (the CPU tests pass ``device``)
LOOP_OPTIONS: dict[str, Any] = {}
#: the plan stream a micro-batch twin records on (the micro-batch runner's capture stream)
UBATCH_STREAM = "ubatch"


def register() -> None:
    """The entry point: nothing unless ``CAPTURE_PLAN_PLAN`` is set; then the release
    check, the plan loaded (a missing or invalid plan stops start-up here), the hooks."""
    core.register(ENGINE, install, LIVE)


_env_problems = core.env_problems


def shape_of(release: str) -> ReleaseFacts:
    """What vLLM ``release`` does differently: its release file's ``[facts]``
    (``planner/data/releases/vllm-VERSION.toml``, the one table of these facts: the plugin
    reads ``persistent_buffer``); a release of ``hooks.KNOWN["vllm"]`` each (tested)."""
    from capture_plan.planner.inputs.releases import release as release_file

    facts = release_file(ENGINE, release).facts
    if facts is None:
        raise KeyError(f"{ENGINE} {release}: its release file has no [facts]")
    return facts


#: the rows checked live at registration: every object :func:`install` resolves, replaces or calls
LIVE = (
    "CudaGraphManager",
    "CudaGraphManager.capture",
    "CudaGraphManager.release_graphs",
    "ModelCudaGraphManager",
    "CUDAGraphWrapper",
    "CUDAGraphWrapper.__call__",
    "CUDAGraphWrapper.clear_all_graphs",
    "GPUModelRunner",
    "GPUModelRunner.capture_model",
    "GPUModelRunner.profile_cudagraph_memory",
)

#: how far the measured capture may be from the plan's prediction (``core.GAP_SHARE``, ``core.GAP_FLOOR``)
GAP_SHARE, GAP_FLOOR = core.GAP_SHARE, core.GAP_FLOOR


@dataclass
class _Hooks:
    """One process's install: the settings, the release's shape, vLLM's classes and their
    original methods, and the state the routed methods share."""

    s: core.Settings
    version: str
    #: the release's facts (:func:`shape_of`)
    shape: ReleaseFacts
    adoption: core.Adoption
    manager_cls: Any
    model_manager_cls: Any
    wrapper_cls: Any
    runner_cls: Any
    capture: Any = None
    capture_model: Any = None
    profile: Any = None
    call: Any = None
    #: per manager (by id): descriptor -> the plan's graph key, while capture_model routes
    routes: dict = field(default_factory=dict)
    #: the PIECEWISE step whose pieces the wrappers record, while its forward runs
    piece: list = field(default_factory=list)
    #: the plan's figure, where vLLM's estimate was answered with it (the KV cache is sized from it)
    answered: int | None = None
    #: vLLM sizes its KV cache after capture (the extensible KV cache): the estimate was its own 0
    deferred: bool = False
    #: while vLLM's managers collect their keys for a restore (``vllm_restore.Collecting``)
    collecting: Any = None

    @property
    def where(self) -> str:
        return f"{core.ENV_PLAN}={self.s.plan}"

    def refusal(self, what: str, fix: str) -> core.PluginRefused:
        return core.PluginRefused(what, where=self.where, fix=fix)


def install(s: core.Settings, version: str) -> core.Adoption:
    """Wrap the hook points of vLLM ``version`` (a release of ``hooks.KNOWN``); idempotent.
    Returns the adoption."""
    global ADOPTION
    manager_cls = core.resolve(hook(ENGINE, version, "CudaGraphManager"))
    adoption, new = core.opening(ENGINE, s, manager_cls, core.loop_maker(lambda: LOOP_OPTIONS))
    if not new:
        return adoption
    ADOPTION = adoption
    h = _Hooks(
        s,
        version,
        shape_of(version),
        adoption,
        manager_cls,
        core.resolve(hook(ENGINE, version, "ModelCudaGraphManager")),
        core.resolve(hook(ENGINE, version, "CUDAGraphWrapper")),
        core.resolve(hook(ENGINE, version, "GPUModelRunner")),
    )
    h.capture, h.capture_model = manager_cls.capture, h.runner_cls.capture_model
    h.profile, h.call = h.runner_cls.profile_cudagraph_memory, h.wrapper_cls.__call__
    manager_cls.capture = core.wrap(h.capture, capture_routed, h)
    h.runner_cls.capture_model = core.wrap(h.capture_model, capture_model_routed, h)
    h.runner_cls.profile_cudagraph_memory = core.wrap(h.profile, profile_routed, h)
    h.wrapper_cls.__call__ = core.wrap(h.call, call_routed, h)
    return adoption


def _streams(runner):
    """``capture_loop``'s streams for ``runner``: the plan's stream ``ubatch`` is the
    micro-batch runner's capture stream, where the plan declares it."""

    def options(plan) -> dict:
        declared = {st.stream for st in plan.steps if st.op == "capture"} - {"capture"}
        ubatch = getattr(getattr(runner, "ubatch_runner", None), "capture_stream", None)
        return {"streams": {UBATCH_STREAM: ubatch}} if UBATCH_STREAM in declared and ubatch is not None else {}

    return options


def _fall_back(h: _Hooks, runner, err: core.PluginRefused):
    """vLLM's own capture where the operator chose it, else the refusal; before the first graph."""
    if h.s.fallback != "engine":
        raise err
    sized = ""
    if h.answered is not None:  # vLLM sized its KV cache with the plan's figure, not with its own estimate
        sized = (
            f"; its KV cache was sized with the plan's figure for graph memory ({h.answered} B), not vLLM's "
            "own estimate, and vLLM's capture may take more: rebuild the plan for this engine, or leave "
            f"{core.ENV_PLAN} unset so that vLLM estimates its own"
        )
    core.log.warning("capture-plan: %s; capturing as vLLM does (%s=engine)%s", err, core.ENV_FALLBACK, sized)
    return h.capture_model(runner, profile_only=False)


def capture_model_routed(h: _Hooks, runner, *, profile_only=False):
    """``GPUModelRunner.capture_model``: every graph listed and checked against the plan
    before the first, then the whole capture one part of the plan's loop, then the plan's
    prediction checked against what vLLM measured (:func:`check_capture`)."""
    adoption = h.adoption
    if profile_only:  # vLLM's own estimate (the operator chose it): its throwaway capture
        return h.capture_model(runner, profile_only=profile_only)
    if adoption.loop is not None and (adoption.loop.complete or (adoption.graphs and adoption.graphs.restored)):
        core.log.warning("capture-plan: vLLM captures again after the plan's capture; its own capture records it")
        return h.capture_model(runner, profile_only=profile_only)
    why = _unroutable(runner, h.manager_cls)
    if why is not None:
        err = h.refusal(f"{why}; the plugin does not route it", f"turn it off, or {core.ENV_FALLBACK}=engine")
        return _fall_back(h, runner, err)
    facts = facts_of(runner.vllm_config, engine_keys(runner, h.manager_cls))
    loop = adoption.begin(facts, env_problems=_env_problems, options=_streams(runner))
    if loop is None:
        return h.capture_model(runner, profile_only=profile_only)
    matched, problems = core.match_keys(adoption.plan, facts)
    # the keys' problems where the estimate made the loop (begin() refused them otherwise), or
    # the plan's phases against vLLM's modes: the loop is made, nothing is captured yet
    problems = problems or _mode_problems(adoption.plan, matched)
    if problems:
        err = h.refusal(
            f"the plan is not this engine's: {'; '.join(problems)}",
            f"build the plan for vLLM's graphs (planner build ... -o {h.s.plan}), or {core.ENV_FALLBACK}=engine",
        )
        return _fall_back(h, runner, err)
    h.routes.clear()
    for e, k in matched.items():
        manager, desc = e.native
        h.routes.setdefault(id(manager), {})[desc] = k
    holder = _Holder(runner, h.manager_cls, h.wrapper_cls)
    if holder not in adoption.holders:
        adoption.holders.append(holder)
    start = restoring.start(adoption)
    try:
        if start is not None and start.collecting:  # the graph file is there: restored, else captured in it
            out = vllm_restore.capture_model(h, runner, loop, start, capture_routed)
        else:
            with loop.part():
                out = h.capture_model(runner, profile_only=profile_only)
        if not loop.complete and not (start is not None and start.restored):
            loop.close()  # names the plan's first step vLLM did not capture, everything released
    finally:
        h.routes.clear()
    check_capture(h, out)
    if start is not None and not start.restore and start.outcome is None:  # the file was not there: written now
        tensors = restoring.engine_tensors([("runner", runner)], loop.device)
        engine = vllm_restore.engine_memory(runner)
        restoring.save(start, adoption.plan, loop.graphs, tensors=tensors, engine=engine, who="vLLM")
    return out


def _mode_problems(plan, matched: dict) -> list[str]:
    """vLLM records a PIECEWISE descriptor as pieces (its wrappers, between eager attention
    ops) and a FULL one whole: the plan's phase of each must say the same, as the plan records
    its kind's property (``PlanIndex.piecewise``, the executor's question too), or its steps
    would wait for graphs vLLM records otherwise. The first descriptor that differs; none: []."""
    from capture_plan.schemas.keys import PlanIndex

    index = PlanIndex.of(plan)
    for e, k in matched.items():
        pieces = _name(e.native[1].cg_mode) == "PIECEWISE"
        if index.piecewise(k.phase) != pieces:
            kind = index.kinds[k.phase]
            return [
                f"vLLM records {k.id} as {'PIECEWISE pieces' if pieces else 'one FULL graph'}, and the plan's "
                f"phase {k.phase!r} (kind {kind!r}) is {'not ' if pieces else ''}piecewise"
            ]
    return []


def check_capture(h: _Hooks, measured) -> int | None:
    """The plan's prediction against what vLLM measured its capture took (``capture_model``'s
    free-memory drop): ``core.check_capture``, the figure recorded in the capture report."""
    sized = (
        "vLLM sized its KV cache after capture, from what it took"
        if h.deferred
        else f"vLLM sized its KV cache before capture with the plan's figure ({h.answered} B)"
        if h.answered is not None
        else "vLLM sized its KV cache with its own estimate"
    )
    return core.check_capture(h.adoption, measured, "vLLM", sized, record=True)


def capture_routed(h: _Hooks, manager, create_forward_fn, *args, **kwargs):
    """``CudaGraphManager.capture`` (every manager): the descriptors in the plan's order
    within each mode, each one plan step taken at its warm-up build (:class:`_Routed`)."""
    route = h.routes.get(id(manager))
    if route is None:
        return h.capture(manager, create_forward_fn, *args, **kwargs)
    index = {st.id: st.index for st in h.adoption.plan.steps if st.op == "capture"}
    order = {d: index[k.id] for d, k in route.items()}  # the plan's position of each descriptor
    unknown = [d for ds in manager._capture_descs.values() for d in ds if d not in order]
    if unknown:  # made after capture_model listed them: what _unroutable knows of is refused before
        raise h.refusal(
            f"vLLM's {type(manager).__name__} captures {len(unknown)} graphs it did not list before the first "
            f"capture (such as {unknown[0]}); the plugin routes only graphs it checked against the plan, and "
            "the graphs captured so far are released",
            f"unset {core.ENV_PLAN} to capture as vLLM {h.version} does with these settings "
            "(the plugin does not know what adds them)",
        )
    if h.collecting is not None:  # the graph file is there: this manager's keys collected, nothing captured
        return vllm_restore.collect(h, manager, route, create_forward_fn, args, kwargs)
    saved = {mode: list(descs) for mode, descs in manager._capture_descs.items()}, manager.pool
    for descs in manager._capture_descs.values():
        descs.sort(key=order.__getitem__)
    start = h.adoption.graphs
    keep = start is not None and start.saving  # the graph file is written from these graphs: readable
    routed = _Routed(h, manager, route, order, create_forward_fn, keep)
    try:
        with vllm_restore.kept_graphs() if keep else contextlib.nullcontext():
            h.capture(manager, routed.create, *args, **kwargs)
        routed.hold_pending()
    except BaseException:
        routed.abandon()
        raise
    finally:
        manager._capture_descs.update(saved[0])
        manager.pool = saved[1]


class _Routed:
    """One manager's capture through the plan: ``create`` stands in for vLLM's
    ``create_forward_fn``. A warm-up build takes the descriptor's plan step (its warm-up
    inside ``step.warmup()`` where the plan declares what it keeps), a recording build
    records into the step's pool, and a FULL graph is handed to its step with what it
    returns through (the model's hidden states; a speculator's graph writes into its own
    buffers: None) at the next build or when the capture ends.

    vLLM 0.33.0 sizes the persistent hidden states from its first warm-up (its largest
    descriptor's): a plan that starts smaller gets one warm-up at the largest first,
    inside the first step's warm-up block, so what it keeps is measured against what the
    plan declares. vLLM 0.34.0 sizes them up front for the widest: no extra warm-up."""

    def __init__(self, h: _Hooks, manager, route: dict, order: dict, create_forward_fn, keep: bool = False):
        self.h, self.manager, self.route, self.create_forward_fn = h, manager, route, create_forward_fn
        #: graphs made with keep_graph=True (``vllm_restore.kept_graphs``): instantiated once recorded
        self.keep = keep
        self.model = isinstance(manager, h.model_manager_cls)
        self.pending: list = []
        #: the first step's warm-up block, opened before the pre-warm, closed after its own warm-up
        self.opened: list[contextlib.ExitStack] = []
        descs = sorted((d for ds in manager._capture_descs.values() for d in ds), key=order.__getitem__)
        largest = max(descs, key=lambda d: d.num_tokens) if descs else None
        first_warmup = h.shape.persistent_buffer == "first-warmup"
        self.prewarm = [largest] if first_warmup and self.model and manager.hidden_states is None else []
        if self.prewarm and largest is descs[0]:
            self.prewarm.clear()

    def hold_pending(self) -> None:
        if self.pending:
            desc, step = self.pending.pop()
            out = self.manager.hidden_states[: desc.num_tokens] if self.model else None
            graph = self.manager.graphs[desc]
            if self.keep:
                graph.instantiate()  # as torch does at the end of a capture without keep_graph
            step.hold(out, graph=graph)

    @staticmethod
    def block(step):
        return step.warmup() if step.keeps is not None else contextlib.nullcontext()

    def create(self, desc, warmup):
        self.hold_pending()
        adoption = self.h.adoption
        if not warmup:  # the recording's build: into the step's pool
            step = adoption.current
            self.manager.pool = step.pool
            if self.keep:  # vLLM records on a stream of its own (current here): the file names its workspace
                restoring.name_recording_stream()
            if _name(desc.cg_mode) == "FULL":
                self.pending.append((desc, step))
            return self.create_forward_fn(desc, warmup)
        k = self.route[desc]
        step = adoption.step(k.phase, k.bs, dict(k.labels))
        if self.prewarm:  # built and run before this descriptor's build: each build sets vLLM's inputs
            first = contextlib.ExitStack()
            first.enter_context(self.block(step))
            self.opened.append(first)
            self.create_forward_fn(self.prewarm[0], True)(type(desc.cg_mode).NONE)  # vLLM's CUDAGraphMode.NONE
            self.prewarm.clear()
        forward_fn = self.create_forward_fn(desc, warmup)
        piece, opened = self.h.piece, self.opened

        def routed(cg_mode):
            if _name(cg_mode) == "PIECEWISE":
                piece.append(step)
                try:
                    return forward_fn(cg_mode)
                finally:
                    piece.clear()
            with opened.pop() if opened else self.block(step):
                return forward_fn(cg_mode)

        return routed

    def abandon(self) -> None:
        if self.opened:  # the first warm-up block never reached its own warm-up
            self.opened.pop().__exit__(*sys.exc_info())


def call_routed(h: _Hooks, wrapper, *args, **kwargs):
    """``CUDAGraphWrapper.__call__``: while a PIECEWISE step's forward runs, the piece
    records into the step's pool and is held as the step's next piece."""
    if not h.piece:
        return h.call(wrapper, *args, **kwargs)
    step = h.piece[0]
    before = {k for k, e in wrapper.concrete_cudagraph_entries.items() if e.cudagraph is not None}
    saved, wrapper.graph_pool = wrapper.graph_pool, step.pool
    try:
        out = h.call(wrapper, *args, **kwargs)
    finally:
        wrapper.graph_pool = saved
    for k, e in wrapper.concrete_cudagraph_entries.items():
        if k not in before and e.cudagraph is not None:  # this call recorded the piece
            step.hold(e.output, graph=e.cudagraph, ragged=True)
    return out


def sizes_kv_cache_after_capture(runner) -> bool:
    """Whether vLLM sizes this runner's KV cache after capture: vLLM 0.34's extensible KV
    cache (``cache_config.enable_extensible_kv_cache``, resolved on by default on CUDA).
    Its estimate is then 0 and what capture takes is measured before the KV cache is backed:
    answering with the plan's figure would count graph memory twice."""
    return bool(getattr(getattr(runner, "cache_config", None), "enable_extensible_kv_cache", False))


def profile_routed(h: _Hooks, runner):
    """``GPUModelRunner.profile_cudagraph_memory``: the plan checked and its loop made; the
    answer vLLM's own where it sizes its KV cache after capture (0: the plan's figure is
    checked against the capture instead, :func:`check_capture`), else the plan's figure."""
    adoption = h.adoption
    loop = adoption.begin(facts_of(runner.vllm_config), env_problems=_env_problems, options=_streams(runner))
    if loop is None:
        return h.profile(runner)
    from capture_plan.adapters.profiling import profile_cudagraph_memory

    if sizes_kv_cache_after_capture(runner):
        h.deferred = True
        answer = h.profile(runner)
        core.log.info(
            "capture-plan: vLLM sizes its KV cache after capture (extensible KV cache): its estimate stands "
            "(%s B); the plan's figure (%s B) is checked against what the capture takes",
            answer,
            plan_total(adoption.plan),
        )
        return answer
    if plan_total(adoption.plan) is None:
        err = h.refusal(
            "the plan does not say what capture takes from the device (reserve for capture: unknown)",
            "calibrate it from a capture report of this device (planner build ... --calibration REPORT)",
        )
        if h.s.fallback != "engine":
            raise err
        core.log.warning("capture-plan: %s; vLLM profiles as it does", err)
        return h.profile(runner)
    figure = profile_cudagraph_memory(plan=adoption.plan)
    h.answered = int(figure)
    return figure


def plan_total(plan) -> int | None:
    """What capture takes from the device by the plan (``schemas.keys.capture_memory``);
    None while an item is unknown (a plan not calibrated for a device)."""
    from capture_plan.schemas.keys import capture_memory

    memory = capture_memory(plan)
    return int(memory.bytes) if memory.complete else None


class _Holder:
    """A runner as the adoption's holder: a failed loop drops every manager's graphs
    (vLLM's own ``release_graphs``) and the pieces (``CUDAGraphWrapper.clear_all_graphs``)."""

    def __init__(self, runner, manager_cls, wrapper_cls):
        self.runner, self.manager_cls, self.wrapper_cls = runner, manager_cls, wrapper_cls

    def __eq__(self, other):
        return isinstance(other, _Holder) and other.runner is self.runner

    def cleanup(self) -> None:
        for _, manager in managers(self.runner, self.manager_cls):
            manager.release_graphs()
        self.wrapper_cls.clear_all_graphs()
