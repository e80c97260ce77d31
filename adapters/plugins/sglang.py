"""The SGLang plugin: an ``sglang.srt.plugins`` entry point (pyproject.toml) that routes
the graph runners' capture through a capture plan.

Enabled by ``CAPTURE_PLAN_PLAN`` (:mod:`.core`); unset, :func:`register` returns without
touching SGLang. Its hook points are rows of :mod:`.hooks` for the SGLang release
installed (0.5.23), checked live on the imported engine at registration (``live.live_release``:
a release whose hook points moved is captured as SGLang does, with one warning). What it wraps,
all on the classes, so that the EAGLE draft runners (subclasses of the decode runner,
the same backend) are covered too:

* ``FullCudaGraphBackend.capture_session``: the first capture of the process makes the
  loop over the plan, on the engine's one capture stream; each runner's capture is a
  ``part`` of it; the backend records into the plan's pool for the runner's phase;
* ``DecodeCudaGraphRunner._capture_one_stream``: the runner iterates the plan's sizes,
  in the plan's order (its own loop, handed ``capture_bs`` reversed, as it reverses them);
* ``DecodeCudaGraphRunner.capture_one_shape``: each graph key (size, LoRA variant,
  attention variant) takes the plan's next step;
* ``FullCudaGraphBackend.capture_one``: the engine's own warm-ups and recording, the
  recording through the step (``step.graph``: the plan's pool and stream checked), the
  outputs held as the plan says (``step.hold``). Where the backend records through the
  memory saver's graph context instead, the graph is handed in (``hold(graph=)``).

* ``ModelRunner.initialize`` (before the weights load and the KV cache is sized): the
  plan's sizes checked against the decode sizes SGLang is configured with
  (``get_exec().graph.cuda_graph_config.decode.bs``), so that a plan for other sizes stops
  the start-up in seconds, not after minutes of loading (:func:`size_problems`).

With ``CAPTURE_PLAN_GRAPHS=FILE`` (:mod:`.restoring`), where FILE is there, each runner's
capture collects instead of capturing: ``capture_one_shape`` names the plan's key, the backend's
``capture_one`` keeps the run of it (the runner's ``capture_one_shape`` again, its forward once)
and warms up and records nothing. The runner holding the plan's last key restores every graph
at the end of its session (SGLang makes its runners one after another: the EAGLE draft runners'
keys come last) and hands each to its backend (``_graphs`` and ``_outputs`` by shape key); the
runners before it have no graphs until then, which SGLang replays none of before serving.
Refused, one WARNING, and every collected runner captures through the plan there, in the
order they came (its ``_capture_one_stream`` again, in its backend's session). Where FILE is
not there, the graphs are recorded into the loop's own graphs (``keep_graph=True``, swapped
into the backend as a shared phase's are) and FILE written once the loop closes.

The runner's phase: ``draft_extend`` and ``draft_decode`` for the EAGLE draft runners,
else its capture forward mode (``decode``, ``target_verify``). Not routed: the prefill
runners (breakable and piecewise graphs are recorded by other backends).

SGLang's loader logs and ignores an exception a plugin raises, so a refusal at
registration stops the process with :class:`SystemExit` and the one line; a refusal of
the sizes at the model runner's start raises from ``ModelRunner.initialize``, and one at
the first capture (a plan for another model or TP size) from the runner's capture: each
stops the engine's start-up.

Why sizes are checked twice: before the KV cache, SGLang knows the sizes it is
configured with, not yet those its runners capture. A runner's list
(``get_batch_sizes_to_capture``) is the configured one clamped to the request pool's size,
known once the KV cache is sized (the pool's size itself added where it is below the
largest configured), and filtered by an alignment (two-batch overlap, attention TP/CP
gathers) that the early check only follows where it is 1; a PD role switch
(``ensure_decode_cuda_graphs``) rewrites the configured list after start-up. The early
check refuses only a plan that no request pool's size makes SGLang's; the capture's
compares the runner's final list.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import os
import shlex
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from capture_plan.adapters.plugins import core, restoring
from capture_plan.adapters.plugins.hooks import hook

ENGINE = "sglang"
#: the draft runners, by class name, and the draft graph each captures (a phase kind's ``draft``
#: property, planner/data/phase_kinds.toml; their forward modes do not tell them apart)
DRAFT_RUNNERS = {"EAGLEDraftExtendCudaGraphRunner": "extend", "EAGLEDraftCudaGraphRunner": "steps"}
#: the adoption of this process (None until :func:`install`)
ADOPTION: core.Adoption | None = None


def register() -> None:
    """The entry point: nothing unless ``CAPTURE_PLAN_PLAN`` is set; then the release
    check, the plan loaded once (a missing or invalid plan stops start-up here), and
    the hooks installed."""
    core.register(ENGINE, install, LIVE)


#: the rows checked live at registration: the classes :func:`install` resolves and the methods
#: it calls with the engine's arguments (``capture_one_shape`` is bound by name, whatever its order)
LIVE = (
    "DecodeCudaGraphRunner",
    "FullCudaGraphBackend",
    "FullCudaGraphBackend.capture_session",
    "FullCudaGraphBackend.capture_one",
    "FullCudaGraphBackend.cleanup",
    "ModelRunner",
    "ModelRunner.initialize",
)


def phase_of(runner) -> str:
    """The plan phase a runner captures."""
    for cls in type(runner).__mro__:
        if cls.__name__ in DRAFT_RUNNERS:  # SGLang's phases are named after their kinds
            return next(name for name, kind in _kinds().items() if kind.draft == DRAFT_RUNNERS[cls.__name__])
    mode = getattr(getattr(runner, "capture_forward_mode", None), "name", "DECODE")
    return str(mode).lower()


def facts_of(runner) -> core.EngineFacts:
    """What the runner's model runner says: TP size, the model's config.json, the phase."""
    mr = getattr(runner, "model_runner", None)
    path = getattr(getattr(mr, "model_config", None), "model_path", None)
    config = Path(path) / "config.json" if path else None
    tp = int(getattr(mr, "tp_size", 1) or 1)
    return core.EngineFacts(ENGINE, tp=tp, model_config=config, phases=(phase_of(runner),))


def _kinds() -> dict:
    """The phase kinds and their properties (planner/data/phase_kinds.toml)."""
    from capture_plan.planner.inputs.resources import phase_kinds

    return phase_kinds()


def sized_phases(plan) -> list:
    """The plan's phases whose runners capture SGLang's configured decode sizes (the decode
    runner, in decode and verify mode, and the EAGLE draft runners: ``get_batch_sizes_to_capture``):
    those whose kind's sizes count requests."""
    kinds = _kinds()
    return [ph for ph in plan.phases if ph.kind in kinds and kinds[ph.kind].sizes == "requests"]


def runner_sizes(configured: Sequence[int], pool: int | None = None, alignment: int = 1) -> list[int]:
    """The sizes a runner of SGLang 0.5.23 captures (``get_batch_sizes_to_capture``,
    ``base_cuda_graph_runner.py``, for a runner one request wide): the ``configured``
    decode sizes that are multiples of ``alignment``, none above the request pool's size
    ``pool`` (aligned up), and ``pool`` itself where it is below the largest configured.
    ``pool`` None: a pool at least as large as every configured size."""
    sizes = list(configured)
    if pool is not None:
        pool = -(-pool // alignment) * alignment
        if max(sizes) > pool:
            sizes.append(pool)
    return sorted({bs for bs in sizes if bs % alignment == 0 and (pool is None or bs <= pool)})


def _sizes_text(sizes: Sequence[int], n: int = 8) -> str:
    more = f" and {len(sizes) - n} more" if len(sizes) > n else ""
    return ", ".join(map(str, sizes[:n])) + more


def size_problems(plan, configured: Sequence[int], alignment: int = 1) -> list[str]:
    """What differs between the sizes of the plan's phases that SGLang's decode runners
    capture (:func:`sized_phases`) and the ``configured`` decode sizes, where no request
    pool's size makes the runners' list (:func:`runner_sizes`) the plan's: against the
    list clamped at the plan's largest size where that is below the largest configured
    (the pool may be that size), else against the whole list. Phases alike are named
    together. Nothing with an ``alignment`` above 1 (a runner's width enters then: the
    capture's check compares) or without configured sizes."""
    if alignment != 1 or not configured:
        return []
    differ: dict[tuple, list[str]] = {}
    for ph in sized_phases(plan):
        want = sorted(ph.sizes)
        clamped = runner_sizes(configured, max(want))
        if want in (runner_sizes(configured), clamped):
            continue
        engine = clamped if max(want) < max(configured) else runner_sizes(configured)
        extra = sorted(set(want) - set(engine))
        missing = sorted(set(engine) - set(want))
        differ.setdefault((tuple(extra), tuple(missing)), []).append(ph.name)
    out = []
    for (extra, missing), phases in differ.items():
        parts = [f"the plan captures {_sizes_text(extra)}, SGLang does not"] if extra else []
        parts += [f"SGLang captures {_sizes_text(missing)}, the plan does not"] if missing else []
        out.append(f"{', '.join(phases)}: {' and '.join(parts)}")
    return out


def rebuild_fix(plan, path: Path, engine_sizes: Sequence[int], *, engine_can_take: bool = True) -> str:
    """How to make the plan at ``path`` and SGLang agree on sizes: SGLang started with the
    plan's (``--cuda-graph-bs-decode``, where its decode runners' phases share one list and
    ``engine_can_take``: False where the request pool clamps SGLang's list below the plan's
    largest size, which starting SGLang with the plan's sizes would not change), or
    the plan rebuilt with ``engine_sizes``: the recorded build with ``--max-bs`` where those
    are SGLang's default list, else with its spec's phases set to them. A plan whose sizes
    were chosen for a traffic (``--sizes auto``) is not rebuilt: SGLang takes its sizes."""
    import msgspec

    from capture_plan.planner.inputs.build_options import command_for_cwd, options_from_record, relative
    from capture_plan.planner.inputs.specs import sgl_sizes
    from capture_plan.schemas.limits import MAX_BS

    lists = {tuple(sorted(ph.sizes)) for ph in sized_phases(plan)}
    first = (
        f"start SGLang with --cuda-graph-bs-decode {' '.join(map(str, next(iter(lists))))}, or "
        if len(lists) == 1 and engine_can_take
        else ""
    )
    sizes = sorted(engine_sizes)
    rec = plan.inputs.build
    if isinstance(rec, msgspec.UnsetType):  # a plan that records its build as text only
        return f"{first}rebuild it with the decode sizes {sizes} (planner build ... -o {path})"
    if rec.sizes is not None and first:  # sizes chosen for a traffic (--sizes auto): SGLang takes the plan's
        return first.removesuffix(", or ") + " (the plan's, chosen for its traffic)"
    opts = options_from_record(rec, path)
    if rec.spec is None and rec.preset is None and rec.sizes is None and sizes and max(sizes) <= MAX_BS:
        top = max(sizes)
        if sgl_sizes("speculative" if rec.speculative else "decode", top) == sizes:
            again = command_for_cwd(msgspec.structs.replace(opts, max_bs=top))
            return f"{first}rebuild it with SGLang's: `{again} --force`"
    phases = ", ".join(ph.name for ph in sized_phases(plan))
    if opts.spec is not None:
        spec = relative(opts.spec, Path.cwd())
        return (
            f"{first}set the sizes of {phases} in {spec} to {sizes} and rebuild it: `{command_for_cwd(opts)} --force`"
        )
    # the embedded spec with other sizes than SGLang's default list: written out, then edited
    show = shlex.join(["planner", "spec", "show", *(["--speculative", rec.speculative] if rec.speculative else [])])
    again = command_for_cwd(msgspec.structs.replace(opts, spec=Path("sglang-spec.toml"), speculative=None, max_bs=None))
    return (
        f"{first}write the spec ({show} > sglang-spec.toml), set the sizes of {phases} there to {sizes} "
        f"and rebuild it: `{again} --force`"
    )


def _pool_of(plan, phase: str) -> str:
    return next(s.pool for s in plan.steps if s.op == "capture" and s.phase == phase)


_env_problems = core.env_problems

#: SGLang's switch for sizing the KV cache after capture (``Envs``: off by default)
POST_CAPTURE_ENV = "SGLANG_ENABLE_POST_CAPTURE_KV_SIZING"
POST_CAPTURE_SIZED = f"SGLang sizes its KV cache after capture ({POST_CAPTURE_ENV})"


def sizes_kv_cache_after_capture(environ=os.environ) -> bool:
    """Whether SGLang sizes its KV cache after capture: ``SGLANG_ENABLE_POST_CAPTURE_KV_SIZING``
    set true. The plugin answers no reserve either way (SGLang's own ``reserve_for_graph_mb``
    stands before capture; after it, nothing), so nothing is counted twice; with it on, the
    plan's figure is checked against what the capture took (``core.check_capture``), which is
    what SGLang then sizes the KV cache from. (SGLang may switch it off itself,
    ``post_capture_kv_sizing_planned``: the check then compares all the same.)"""
    return environ.get(POST_CAPTURE_ENV, "").strip().lower() in ("1", "true", "yes", "on")


def capture_drop(loop) -> int | None:
    """What the capture took from the device by the loop's own measure (its report's
    ``device_view``: the free-memory drop around the capture; None where not measured)."""
    report = loop.graphs.report
    view = getattr(report, "device_view", None) if report is not None else None
    return None if view is None else int(view.drop)


#: SGLang's own executable reuse (``cudaGraphExecUpdate`` between structurally identical graphs
#: of its breakable backend: runner_backend/cuda_graph_dedup_mixin.py, off by default, on by
#: default for Muse Spark models unless the environment says): off while the plan decides
ENGINE_REUSE_ENV = "SGLANG_ENABLE_CUDA_GRAPH_DEDUP"


def engine_reuse_off(environ=os.environ) -> str | None:
    """Switch SGLang's own executable reuse off (the plan decides reuse: one mechanism per
    process); the line to log where it was on, else None. Written into the environment,
    where SGLang reads it at each capture and where its model defaults leave a set value."""
    was = environ.get(ENGINE_REUSE_ENV, "").strip().lower()
    environ[ENGINE_REUSE_ENV] = "false"
    if was in ("1", "true", "yes", "on"):
        return f"capture-plan: {ENGINE_REUSE_ENV} switched off: the plan decides executable reuse"
    return None


#: extra ``capture_loop`` keywords (the CPU tests pass ``device``)
LOOP_OPTIONS: dict[str, Any] = {}


class _FromFile:
    """What the start-up from a graph file keeps of SGLang's runners: each backend, its runner
    and the arguments of its ``_capture_one_stream`` (a refused restore captures every runner
    that collected its keys, in the order they came), the key ``capture_one_shape`` is
    collecting, the runs of a restore in progress (each a box: whether it is the key's eager
    run, then the forward's output)."""

    def __init__(self):
        self.order: list[tuple] = []  # (backend, runner)
        self.args: dict[int, tuple] = {}
        self.key: tuple | None = None
        self.running: list[list] = []

    def came(self, backend, runner) -> None:
        if all(r is not runner for _, r in self.order):
            self.order.append((backend, runner))

    def ran(self, runner, args, kw) -> None:
        self.args[id(runner)] = (args, kw)

    def take_key(self) -> tuple:
        key, self.key = self.key, None
        if key is None:
            raise core.PluginRefused(
                "SGLang's backend captured a graph its runner's capture_one_shape did not name",
                where=core.ENV_GRAPHS,
                fix=f"unset {core.ENV_GRAPHS} to capture through the plan",
            )
        return key


class _GraphThroughStep:
    """The backend's device module with ``graph`` recording through the plan's step."""

    def __init__(self, module, step, keep: bool = False):
        self._module, self._step, self.keep, self.used = module, step, keep, False

    def __getattr__(self, name: str):
        return getattr(self._module, name)

    def graph(self, cuda_graph=None, pool=None, stream=None, **kw):
        self.used = True
        # a phase that shares executables, and a capture a graph file is written from, record
        # into the loop's own graph (keep_graph=True, its nodes read); the backend's is swapped
        # for what the step serves (capture_one_routed)
        return self._step.graph(None if self._step.shares or self.keep else cuda_graph, pool=pool, stream=stream)


def install(s: core.Settings, version: str) -> core.Adoption:
    """Wrap the hook points of SGLang ``version`` (a release of :data:`hooks.KNOWN`);
    idempotent. Returns the process's adoption."""
    global ADOPTION
    runner_cls = core.resolve(hook(ENGINE, version, "DecodeCudaGraphRunner"))
    backend_cls = core.resolve(hook(ENGINE, version, "FullCudaGraphBackend"))
    model_runner_cls = core.resolve(hook(ENGINE, version, "ModelRunner"))
    adoption, new = core.opening(ENGINE, s, backend_cls, core.loop_maker(lambda: LOOP_OPTIONS))
    if not new:
        return adoption
    ADOPTION = adoption
    where = f"{core.ENV_PLAN}={s.plan}"
    said = engine_reuse_off()
    if said is not None:
        core.log.warning(said)
    initialize = model_runner_cls.initialize
    #: whether the sizes were checked before the weights (once a process: a draft worker's runner too)
    early: list[bool] = []

    def check_sizes_early() -> None:
        if early or adoption.loop is not None or adoption.fallback:
            return
        try:
            decode = core.resolve(hook(ENGINE, version, "get_exec"))().graph.cuda_graph_config.decode
            alignment = core.resolve(hook(ENGINE, version, "get_cuda_graph_batch_size_alignment"))()
        except (AttributeError, ValueError):  # not published here, or no graph config: the capture checks
            return
        if decode.backend != core.resolve(hook(ENGINE, version, "Backend.FULL")):
            return  # decode graphs disabled, or breakable (another backend): none the plugin routes
        configured = decode.bs
        try:
            plan = core.load(s)
            problems = size_problems(plan, list(configured or ()), alignment)
            if problems:
                raise core.PluginRefused(
                    f"the plan's sizes are not SGLang's (its decode sizes {_sizes_text(sorted(configured))}): "
                    + "; ".join(problems),
                    where=where,
                    fix=rebuild_fix(plan, s.plan, runner_sizes(configured)),
                )
            early.append(True)  # a draft worker's model runner, later in the process, is not checked again
        except core.PluginRefused as err:
            if s.fallback != "engine":
                raise
            core.log.warning("capture-plan: %s; capturing as sglang does (%s=engine)", err, core.ENV_FALLBACK)
            adoption.fallback = True

    def initialize_checked(self, *args, **kw):
        check_sizes_early()
        return initialize(self, *args, **kw)

    one_stream, one_shape = runner_cls._capture_one_stream, runner_cls.capture_one_shape
    session, capture_one = backend_cls.capture_session, backend_cls.capture_one
    ff = _FromFile()

    def _capture_one_stream(self, *args, **kw):
        loop = adoption.loop
        if loop is None:
            return one_stream(self, *args, **kw)
        ff.ran(self, args, kw)  # run again where a restore refuses after this runner collected its keys
        order = loop.sizes(phase_of(self))  # checked against capture_bs in capture_session
        saved = self.capture_bs
        self.capture_bs = list(reversed(order))  # the runner iterates reversed(capture_bs)
        try:
            return one_stream(self, *args, **kw)
        finally:
            self.capture_bs = saved

    shape_params = inspect.signature(one_shape)

    def capture_one_shape(self, *args, **kw):
        if adoption.loop is not None and not ff.running:  # a restore's run of a key is neither collected nor a step
            # by name, as the release's signature has them (a hook point of the contract)
            given = shape_params.bind(self, *args, **kw).arguments
            labels = {"lora": given.get("variant_label"), "attention": given.get("attention_variant")}
            start = adoption.graphs
            if start is not None and start.collecting:  # the key's run, collected at the backend's capture_one
                ff.key = (restoring.plan_key(adoption.loop, phase_of(self), given["size"], labels), self, args, kw)
            else:
                adoption.step(phase_of(self), given["size"], labels)
        return one_shape(self, *args, **kw)

    def run_key(runner, args, kw, runs: list[int]):
        """A restore's run of one key: the runner's own path to it (its preparation in
        capture_one_shape, then the backend's forward, once: capture_one_routed). A restore runs
        each of its loading keys eagerly, then records it (``kernel_loading``): after the first,
        the eager one, SGLang's post-warm-up hook runs, as after each of its warm-ups."""
        box: list = [runs[0] == 0]
        runs[0] += 1
        ff.running.append(box)
        try:
            one_shape(runner, *args, **kw)
        finally:
            ff.running.pop()
        return box[1] if len(box) > 1 else None

    def tensors(device) -> dict:
        """The runners' tensors, each runner's under its phase (:func:`restoring.engine_tensors`)."""
        return restoring.engine_tensors([(phase_of(r), r) for _, r in ff.order], device)

    @contextlib.contextmanager
    def through_plan(backend, runner, stream, loop, *, opened: bool = False):
        """A runner's capture as one part of the plan's loop (``opened``: its session is open already)."""
        backend._pool = loop.pool(_pool_of(adoption.plan, phase_of(runner)))
        if backend not in adoption.holders:
            adoption.holders.append(backend)
        with loop.part(), contextlib.nullcontext() if opened else session(backend, stream):
            yield
        if not loop.complete:  # a later runner's part closes the loop
            return
        if sizes_kv_cache_after_capture():
            core.check_capture(adoption, capture_drop(loop), "SGLang", POST_CAPTURE_SIZED, record=False)
        start = adoption.graphs
        if start is not None and not start.restore and start.outcome is None:
            restoring.save(start, adoption.plan, loop.graphs, tensors=tensors(loop.device), engine={}, who="SGLang")

    def restore_or_capture(backend, stream, loop, start) -> None:
        """Every runner's keys collected (this runner's session open): the graphs restored and
        handed to each runner's backend, or, refused, every collected runner captured through
        the plan in the order they came."""
        gs = restoring.restore_collected(
            start, adoption.plan, tensors=tensors(loop.device), engine={}, device=loop.device
        )
        if gs is not None:
            try:
                for key, (owner, shape_key) in start.native.items():
                    owner._graphs[shape_key] = gs.graphs[key].graph
                    owner._outputs[shape_key] = restoring.outputs(start, key)
            except Exception as err:  # noqa: BLE001  # nothing of the restored set is kept: captured instead
                for owner, _ in ff.order:
                    owner.cleanup()
                restoring.drop(start, err)
            else:
                restoring.restored(start, "SGLang")
                if sizes_kv_cache_after_capture():
                    core.check_capture(adoption, start.outcome.took, "SGLang", POST_CAPTURE_SIZED, record=False)
                return
        for owner, runner in list(ff.order):
            args, kw = ff.args[id(runner)]
            with through_plan(owner, runner, stream, loop, opened=owner is backend):
                runner._capture_one_stream(*args, **kw)

    @contextlib.contextmanager
    def capture_session(self, stream):
        runner = self._cuda_graph_runner
        loop = adoption.begin(facts_of(runner), stream=stream, env_problems=_env_problems)
        if loop is None:
            with session(self, stream):
                yield
            return
        phase = phase_of(runner)
        order = loop.sizes(phase)
        # the runner's final list: clamped to the request pool, aligned, or changed since start-up
        if sorted(order) != sorted(runner.capture_bs):  # before the part: nothing to release
            raise core.PluginRefused(
                f"the {phase} runner captures sizes {sorted(runner.capture_bs)}, the plan {sorted(order)}",
                where=where,
                # the runner's list ends below the plan's largest size: its request pool may clamp
                # it there, whatever sizes SGLang is started with, so only the rebuild is sure to work
                fix=rebuild_fix(
                    adoption.plan,
                    s.plan,
                    runner.capture_bs,
                    engine_can_take=max(order) <= max(runner.capture_bs, default=0),
                ),
            )
        ff.came(self, runner)
        start = restoring.start(adoption)
        if start is None or not start.collecting:
            with through_plan(self, runner, stream, loop):
                yield
            return
        with session(self, stream):
            yield  # the runner's loop, each key collected (capture_one_shape, capture_one_routed), nothing recorded
            if start.complete:  # the runner holding the plan's last key: every runner's keys are in
                restore_or_capture(self, stream, loop, start)

    def capture_one_routed(self, shape_key, forward_fn, capture_inputs=None, post_warmup_hook=None):
        if ff.running:  # a restore's run of a key: the engine's forward once, eager or recorded as the restore runs it
            box = ff.running[-1]
            box.append(forward_fn())
            if post_warmup_hook is not None and box[0]:  # the eager run: as after the engine's own warm-up
                post_warmup_hook()
            return
        start = adoption.graphs
        if adoption.loop is not None and start is not None and start.collecting:
            key, runner, args, kw = ff.take_key()
            start.collect(key, (self, shape_key), functools.partial(run_key, runner, args, kw, [0]))
            return
        step = adoption.current
        if adoption.loop is None or step is None:
            return capture_one(self, shape_key, forward_fn, capture_inputs, post_warmup_hook)
        keep = start is not None and start.saving  # the graph file reads the graph: kept (keep_graph=True)
        module = self._device_module
        via = self._device_module = _GraphThroughStep(module, step, keep)
        try:
            capture_one(self, shape_key, forward_fn, capture_inputs, post_warmup_hook)
        finally:
            self._device_module = module
        out = self._outputs[shape_key]
        self._outputs[shape_key] = step.hold(out) if via.used else step.hold(out, graph=self._graphs[shape_key])
        if via.used and (
            step.shares or keep
        ):  # the backend replays what the step serves (its own graph was never used)
            self._graphs[shape_key] = step.served
        adoption.current = None

    model_runner_cls.initialize = initialize_checked
    runner_cls._capture_one_stream = _capture_one_stream
    runner_cls.capture_one_shape = capture_one_shape
    backend_cls.capture_session = capture_session
    backend_cls.capture_one = capture_one_routed
    return adoption
