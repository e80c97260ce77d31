"""The vLLM plugin: a ``vllm.general_plugins`` entry point (pyproject.toml) that routes
what the V2 GPU model runner captures through a capture plan, and answers its
graph-memory estimate from the plan.

Enabled by ``CAPTURE_PLAN_PLAN`` (:mod:`.core`); unset, :func:`register` returns without
touching vLLM. vLLM calls general plugins in every process and lets their exceptions
stop it: a refusal is :class:`SystemExit` with the one line. Its hook points are rows of
:mod:`.hooks` for the vLLM release installed (0.33.0); another release is refused,
naming the ones it knows. What it wraps, on the classes:

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
  writes into its own buffers: None); ``hold(graph=)`` checks the pool. vLLM sizes the
  persistent hidden states from its first warm-up: a plan that does not start at the
  largest descriptor gets one warm-up at the largest first, inside the first step's
  warm-up block, so what it keeps is measured against what the plan declares;
* ``CUDAGraphWrapper.__call__`` (a compiled piece): while a PIECEWISE step's forward
  runs, each piece records into the step's pool and is held as the step's next piece, in
  the order the pieces run; the plan's piece count is checked by the loop;
* ``GPUModelRunner.profile_cudagraph_memory``: the plan's figure for the whole capture
  (``capture_plan.adapters.profiling``) instead of a profiling capture; a plan without a
  complete figure (not calibrated for a device) is refused (or, with
  ``CAPTURE_PLAN_FALLBACK=engine``, vLLM profiles as it does). vLLM then sizes its KV
  cache with that figure: where the capture that follows falls back to vLLM's own
  (``CAPTURE_PLAN_FALLBACK=engine`` after a refusal), the warning says so.

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
from pathlib import Path
from typing import Any

from capture_plan.adapters.plugins import core
from capture_plan.adapters.plugins.hooks import hook

ENGINE = "vllm"
#: the adoption of this process (None until :func:`install`)
ADOPTION: core.Adoption | None = None
#: extra ``capture_loop`` keywords (the CPU tests pass ``device``)
LOOP_OPTIONS: dict[str, Any] = {}
#: how vLLM orders its captures (the refusal of a plan it cannot follow)
ORDER = "vLLM captures the model's graphs, then each speculator manager's; in each, PIECEWISE, then FULL"
#: the plan stream a micro-batch twin records on (the micro-batch runner's capture stream)
UBATCH_STREAM = "ubatch"
_MODES = {"PIECEWISE": 0, "FULL": 1}


def register() -> None:
    """The entry point: nothing unless ``CAPTURE_PLAN_PLAN`` is set; then the release
    check, the plan loaded (a missing or invalid plan stops start-up here), the hooks."""
    core.register(ENGINE, install)


def _make_loop(plan, *, stream=None, on_failure=None, **options):
    from capture_plan.executor import capture_loop

    given = {"stream": stream} if stream is not None else {}
    return capture_loop(plan, on_failure=on_failure, **given, **{**LOOP_OPTIONS, **options})


def _env_problems(plan) -> list[str]:
    from capture_plan.executor.load import check_environment, current_environment

    return check_environment(plan, current_environment(tuple(plan.requires.modules)))


def _name(mode) -> str:
    return str(getattr(mode, "name", mode))


def phase_of(desc, prefix: str = "", parent=None) -> str:
    """The plan phase of a descriptor (module docstring), ``prefix`` the manager's. A
    micro-batch twin is named for ``parent``, the FULL descriptor it is the twin of
    (:func:`twin_parents`): ``_maybe_ubatch_twin`` sets a twin's ``uniform_token_count``,
    so a mixed graph's twin would otherwise read as a uniform-decode one."""
    if parent is not None and desc.num_ubatches > 1:
        return phase_of(parent, prefix) + "_ubatch"
    mode = _name(desc.cg_mode)
    if mode == "PIECEWISE":
        routine = "piecewise"
    elif desc.uniform_token_count is not None or desc.max_query_len is not None:
        routine = "full_decode"
    else:
        routine = "full_mixed"
    return prefix + routine + ("_ubatch" if desc.num_ubatches > 1 else "")


def twin_parents(descs) -> dict:
    """twin -> the descriptor it is the micro-batch twin of, in one mode's list of
    ``_capture_descs``: ``_init_candidates`` appends a twin right after its descriptor and
    sorts by tokens only (stably), so its parent is the nearest descriptor before it with
    one micro-batch, its tokens and its LoRA count."""
    out, last = {}, {}
    for d in descs:
        key = (d.num_tokens, d.num_active_loras)
        if d.num_ubatches == 1:
            last[key] = d
        elif key in last:
            out[d] = last[key]
    return out


def labels_of(desc) -> tuple[tuple[str, str], ...]:
    """A descriptor's labels: ``loras``, its LoRA count (where the plan's phase declares
    the axis, or it is not 0: :func:`engine_keys`)."""
    return (("loras", str(desc.num_active_loras)),)


def managers(runner, manager_cls) -> list[tuple[str, Any]]:
    """(phase prefix, manager) of every manager ``capture_model`` runs, in its order: the
    runner's, then the speculator's ``CudaGraphManager`` attributes (as vLLM's
    ``profile_cudagraph_memory`` finds them: ``prefill_cudagraph_manager`` ->
    ``draft_prefill_``, ``cudagraph_manager`` -> ``draft_``), less the draft decode
    manager of a speculator with one speculative step (vLLM does not capture it)."""
    out = [("", runner.cudagraph_manager)] if runner.cudagraph_manager is not None else []
    speculator = getattr(runner, "speculator", None)
    if speculator is not None:
        # TargetDependentARSpeculator.capture returns before the draft decode manager's
        # capture with one speculative step: its graphs are never captured
        one_step = getattr(speculator, "num_speculative_steps", None) == 1
        for name, value in vars(speculator).items():
            if one_step and name == "decode_cudagraph_manager":
                continue
            if isinstance(value, manager_cls):
                role = name.removesuffix("cudagraph_manager").strip("_")
                out.append((f"draft_{role}_" if role else "draft_", value))
    return out


def engine_keys(runner, manager_cls) -> tuple[core.EngineKey, ...]:
    """Every graph the runner's managers will capture, in the plan's terms (``loras=0``
    a default: a plan without LoRA axes matches an engine without LoRA)."""
    keys = []
    for m, (prefix, manager) in enumerate(managers(runner, manager_cls)):
        for mode, descs in manager._capture_descs.items():
            parents = twin_parents(descs)
            for desc in descs:
                rank = (m, _MODES.get(_name(mode), 2))
                keys.append(
                    core.EngineKey(
                        phase_of(desc, prefix, parents.get(desc)),
                        desc.num_tokens,
                        labels_of(desc),
                        desc.num_ubatches,
                        rank,
                        defaults=(("loras", "0"),),
                        native=(manager, desc),
                    )
                )
    return tuple(keys)


def facts_of(vllm_config, keys: tuple[core.EngineKey, ...] = ()) -> core.EngineFacts:
    """TP size and the model's config.json from vLLM's config; the graphs it will capture."""
    tp = getattr(getattr(vllm_config, "parallel_config", None), "tensor_parallel_size", 1) or 1
    model = getattr(getattr(vllm_config, "model_config", None), "model", None)
    config = Path(model) / "config.json" if isinstance(model, str) and Path(model).is_dir() else None
    return core.EngineFacts(ENGINE, tp=int(tp), model_config=config, keys=keys, order=ORDER)


def _unroutable(runner, manager_cls) -> str | None:
    """What the plugin does not route, by the runner's settings (None: everything);
    each known before the first graph."""
    config = runner.vllm_config
    if getattr(config, "use_cumem_cudagraph_pool", False):
        return "sleep mode records graphs into its cuMem pool, not the plan's"
    pp = getattr(getattr(config, "parallel_config", None), "pipeline_parallel_size", 1) or 1
    if int(pp) > 1:  # ModelCudaGraphManager: a non-last rank keeps intermediate_tensors, hidden_states stays None
        return (
            f"pipeline parallelism (pipeline_parallel_size={pp}): a rank before the last returns intermediate "
            "tensors from its graphs, not the hidden states the plan's steps hold"
        )
    for prefix, manager in managers(runner, manager_cls):
        if getattr(manager, "use_breakable_cg", False):
            return f"the {prefix or 'model'} manager records breakable PIECEWISE graphs (VLLM_USE_BREAKABLE_CUDAGRAPH)"
    speculator = getattr(runner, "speculator", None)
    spec_config = getattr(speculator, "speculative_config", None)
    dynamic = getattr(spec_config, "uses_dynamic_speculative_decoding", None)
    # TargetDependentARSpeculator.capture passes specialize_spec_tokens=this to the draft
    # decode manager, which then makes a graph per speculative token count inside its capture
    if getattr(speculator, "supports_decode_metadata_update", False) and callable(dynamic) and dynamic():
        return (
            "dynamic speculative decoding (num_speculative_tokens_per_batch_size) makes the draft decode "
            "graphs per speculative token count inside their capture, after the plugin checked the keys"
        )
    return None


def install(s: core.Settings, version: str) -> core.Adoption:
    """Wrap the hook points of vLLM ``version``; idempotent. Returns the adoption."""
    global ADOPTION
    manager_cls = core.resolve(hook(ENGINE, version, "CudaGraphManager"))
    model_manager_cls = core.resolve(hook(ENGINE, version, "ModelCudaGraphManager"))
    wrapper_cls = core.resolve(hook(ENGINE, version, "CUDAGraphWrapper"))
    runner_cls = core.resolve(hook(ENGINE, version, "GPUModelRunner"))
    if getattr(manager_cls, "__capture_plan__", None) is not None:
        return manager_cls.__capture_plan__
    adoption = core.Adoption(s, ENGINE, make_loop=_make_loop)
    ADOPTION = adoption
    capture, capture_model = manager_cls.capture, runner_cls.capture_model
    profile, call = runner_cls.profile_cudagraph_memory, wrapper_cls.__call__
    where = f"{core.ENV_PLAN}={s.plan}"
    #: per manager (by id): descriptor -> the plan's graph key, while capture_model routes
    routes: dict[int, dict] = {}
    #: the PIECEWISE step whose pieces the wrappers record, while its forward runs
    piece: list = []

    def streams(runner):
        def options(plan) -> dict:
            declared = {st.stream for st in plan.steps if st.op == "capture"} - {"capture"}
            ubatch = getattr(getattr(runner, "ubatch_runner", None), "capture_stream", None)
            return {"streams": {UBATCH_STREAM: ubatch}} if UBATCH_STREAM in declared and ubatch is not None else {}

        return options

    def refusal(what: str, fix: str) -> core.PluginRefused:
        return core.PluginRefused(what, where=where, fix=fix)

    #: the plan's figure, where vLLM's estimate was answered with it (the KV cache is sized from it)
    answered: list[int] = []

    def fall_back(self, err: core.PluginRefused):
        """vLLM's own capture where the operator chose it, else the refusal; before the first graph."""
        if s.fallback != "engine":
            raise err
        sized = ""
        if answered:  # vLLM sized its KV cache with the plan's figure, not with its own estimate
            sized = (
                f"; its KV cache was sized with the plan's figure for graph memory ({answered[0]} B), not vLLM's "
                "own estimate, and vLLM's capture may take more: rebuild the plan for this engine, or leave "
                f"{core.ENV_PLAN} unset so that vLLM estimates its own"
            )
        core.log.warning("capture-plan: %s; capturing as vLLM does (%s=engine)%s", err, core.ENV_FALLBACK, sized)
        return capture_model(self, profile_only=False)

    def capture_model_routed(self, *, profile_only=False):
        if profile_only:  # vLLM's own estimate (the operator chose it): its throwaway capture
            return capture_model(self, profile_only=profile_only)
        if adoption.loop is not None and adoption.loop.complete:
            core.log.warning("capture-plan: vLLM captures again after the plan's capture; its own capture records it")
            return capture_model(self, profile_only=profile_only)
        why = _unroutable(self, manager_cls)
        if why is not None:
            err = refusal(f"{why}; the plugin does not route it", f"turn it off, or {core.ENV_FALLBACK}=engine")
            return fall_back(self, err)
        facts = facts_of(self.vllm_config, engine_keys(self, manager_cls))
        made_before = adoption.loop is not None  # by the estimate, without the keys
        loop = adoption.begin(facts, env_problems=_env_problems, options=streams(self))
        if loop is None:
            return capture_model(self, profile_only=profile_only)
        matched, problems = core.match_keys(adoption.plan, facts)
        if problems and made_before:  # the estimate made the loop; nothing is captured yet
            return fall_back(
                self,
                refusal(
                    f"the plan is not this engine's: {'; '.join(problems)}",
                    f"build the plan for vLLM's graphs (planner build ... -o {s.plan}), or {core.ENV_FALLBACK}=engine",
                ),
            )
        routes.clear()
        for e, k in matched.items():
            manager, desc = e.native
            routes.setdefault(id(manager), {})[desc] = k
        holder = _Holder(self, manager_cls, wrapper_cls)
        if holder not in adoption.holders:
            adoption.holders.append(holder)
        try:
            with loop.part():
                out = capture_model(self, profile_only=profile_only)
            if not loop.complete:
                loop.close()  # names the plan's first step vLLM did not capture, everything released
        finally:
            routes.clear()
        return out

    def capture_routed(self, create_forward_fn, progress_bar_desc="Capturing CUDA graphs"):
        route = routes.get(id(self))
        if route is None:
            return capture(self, create_forward_fn, progress_bar_desc)
        index = {st.id: st.index for st in adoption.plan.steps if st.op == "capture"}
        order = {d: index[k.id] for d, k in route.items()}  # the plan's position of each descriptor
        unknown = [d for ds in self._capture_descs.values() for d in ds if d not in order]
        if unknown:  # made after capture_model listed them: what _unroutable knows of is refused before
            raise refusal(
                f"vLLM's {type(self).__name__} captures {len(unknown)} graphs it did not list before the first "
                f"capture (such as {unknown[0]}); the plugin routes only graphs it checked against the plan, and "
                "the graphs captured so far are released",
                f"unset {core.ENV_PLAN} to capture as vLLM {version} does with these settings "
                "(the plugin does not know what adds them)",
            )
        saved = {mode: list(descs) for mode, descs in self._capture_descs.items()}, self.pool
        for descs in self._capture_descs.values():
            descs.sort(key=order.__getitem__)
        pending: list = []
        descs = sorted((d for ds in self._capture_descs.values() for d in ds), key=order.__getitem__)
        largest = max(descs, key=lambda d: d.num_tokens) if descs else None
        # vLLM sizes the persistent hidden states from its first warm-up (its largest
        # descriptor's); a plan that starts smaller gets one warm-up at the largest first,
        # inside the first step's warm-up block, where the bytes it keeps are measured
        prewarm = [largest] if isinstance(self, model_manager_cls) and self.hidden_states is None else []
        if prewarm and largest is descs[0]:
            prewarm.clear()
        #: the first step's warm-up block, opened before the pre-warm, closed after its own warm-up
        opened: list[contextlib.ExitStack] = []

        def hold_pending() -> None:
            if pending:
                desc, step = pending.pop()
                out = self.hidden_states[: desc.num_tokens] if isinstance(self, model_manager_cls) else None
                step.hold(out, graph=self.graphs[desc])

        def block(step):
            return step.warmup() if step.keeps is not None else contextlib.nullcontext()

        def create(desc, warmup):
            hold_pending()
            if not warmup:  # the recording's build: into the step's pool
                step = adoption.current
                self.pool = step.pool
                if _name(desc.cg_mode) == "FULL":
                    pending.append((desc, step))
                return create_forward_fn(desc, warmup)
            k = route[desc]
            step = adoption.step(k.phase, k.bs, dict(k.labels))
            if prewarm:  # built and run before this descriptor's build: each build sets vLLM's inputs
                first = contextlib.ExitStack()
                first.enter_context(block(step))
                opened.append(first)
                create_forward_fn(prewarm[0], True)(type(desc.cg_mode).NONE)  # vLLM's CUDAGraphMode.NONE
                prewarm.clear()
            forward_fn = create_forward_fn(desc, warmup)

            def routed(cg_mode):
                if _name(cg_mode) == "PIECEWISE":
                    piece.append(step)
                    try:
                        return forward_fn(cg_mode)
                    finally:
                        piece.clear()
                with opened.pop() if opened else block(step):
                    return forward_fn(cg_mode)

            return routed

        try:
            capture(self, create, progress_bar_desc)
            hold_pending()
        except BaseException:
            if opened:  # the first warm-up block never reached its own warm-up
                opened.pop().__exit__(*sys.exc_info())
            raise
        finally:
            self._capture_descs.update(saved[0])
            self.pool = saved[1]

    def call_routed(self, *args, **kwargs):
        if not piece:
            return call(self, *args, **kwargs)
        step = piece[0]
        before = {k for k, e in self.concrete_cudagraph_entries.items() if e.cudagraph is not None}
        saved, self.graph_pool = self.graph_pool, step.pool
        try:
            out = call(self, *args, **kwargs)
        finally:
            self.graph_pool = saved
        for k, e in self.concrete_cudagraph_entries.items():
            if k not in before and e.cudagraph is not None:  # this call recorded the piece
                step.hold(e.output, graph=e.cudagraph, ragged=True)
        return out

    def profile_routed(self):
        loop = adoption.begin(facts_of(self.vllm_config), env_problems=_env_problems, options=streams(self))
        if loop is None:
            return profile(self)
        from capture_plan.adapters.profiling import profile_cudagraph_memory
        from capture_plan.schemas.keys import capture_memory

        if not capture_memory(adoption.plan).complete:
            err = refusal(
                "the plan does not say what capture takes from the device (reserve for capture: unknown)",
                "calibrate it from a capture report of this device (planner build ... --calibration REPORT)",
            )
            if s.fallback != "engine":
                raise err
            core.log.warning("capture-plan: %s; vLLM profiles as it does", err)
            return profile(self)
        figure = profile_cudagraph_memory(plan=adoption.plan)
        answered[:] = [int(figure)]
        return figure

    manager_cls.capture = capture_routed
    runner_cls.capture_model = capture_model_routed
    runner_cls.profile_cudagraph_memory = profile_routed
    wrapper_cls.__call__ = call_routed
    manager_cls.__capture_plan__ = adoption
    return adoption


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
