"""The SGLang plugin: an ``sglang.srt.plugins`` entry point (pyproject.toml) that routes
the graph runners' capture through a capture plan.

Enabled by ``CAPTURE_PLAN_PLAN`` (:mod:`.core`); unset, :func:`register` returns without
touching SGLang. Its hook points are rows of :mod:`.hooks` for the SGLang release
installed (0.5.23); another release is refused naming the ones it knows. What it wraps,
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

The runner's phase: ``draft_extend`` and ``draft_decode`` for the EAGLE draft runners,
else its capture forward mode (``decode``, ``target_verify``). Not routed: the prefill
runners (breakable and piecewise graphs are recorded by other backends).

SGLang's loader logs and ignores an exception a plugin raises, so a refusal at
registration stops the process with :class:`SystemExit` and the one line; a refusal at
the first capture (a plan for another model or TP size) raises from the runner's
capture, which stops the engine's start-up.
"""

from __future__ import annotations

import contextlib
import inspect
from pathlib import Path
from typing import Any

from capture_plan.adapters.plugins import core
from capture_plan.adapters.plugins.hooks import hook

ENGINE = "sglang"
#: the draft runners' phases, by class name (their forward modes do not tell them apart)
DRAFT_PHASES = {"EAGLEDraftExtendCudaGraphRunner": "draft_extend", "EAGLEDraftCudaGraphRunner": "draft_decode"}
#: the adoption of this process (None until :func:`install`)
ADOPTION: core.Adoption | None = None


def register() -> None:
    """The entry point: nothing unless ``CAPTURE_PLAN_PLAN`` is set; then the release
    check, the plan loaded once (a missing or invalid plan stops start-up here), and
    the hooks installed."""
    core.register(ENGINE, install)


def phase_of(runner) -> str:
    """The plan phase a runner captures."""
    for cls in type(runner).__mro__:
        if cls.__name__ in DRAFT_PHASES:
            return DRAFT_PHASES[cls.__name__]
    mode = getattr(getattr(runner, "capture_forward_mode", None), "name", "DECODE")
    return str(mode).lower()


def facts_of(runner) -> core.EngineFacts:
    """What the runner's model runner says: TP size, the model's config.json, the phase."""
    mr = getattr(runner, "model_runner", None)
    path = getattr(getattr(mr, "model_config", None), "model_path", None)
    config = Path(path) / "config.json" if path else None
    tp = int(getattr(mr, "tp_size", 1) or 1)
    return core.EngineFacts(ENGINE, tp=tp, model_config=config, phases=(phase_of(runner),))


def _pool_of(plan, phase: str) -> str:
    return next(s.pool for s in plan.steps if s.op == "capture" and s.phase == phase)


def _env_problems(plan) -> list[str]:
    from capture_plan.executor.load import check_environment, current_environment

    return check_environment(plan, current_environment(tuple(plan.requires.modules)))


def _make_loop(plan, *, stream=None, on_failure=None, **options):
    from capture_plan.executor import capture_loop

    return capture_loop(plan, stream=stream, on_failure=on_failure, **{**LOOP_OPTIONS, **options})


#: extra ``capture_loop`` keywords (the CPU tests pass ``device``)
LOOP_OPTIONS: dict[str, Any] = {}


class _GraphThroughStep:
    """The backend's device module with ``graph`` recording through the plan's step."""

    def __init__(self, module, step):
        self._module, self._step, self.used = module, step, False

    def __getattr__(self, name: str):
        return getattr(self._module, name)

    def graph(self, cuda_graph=None, pool=None, stream=None, **kw):
        self.used = True
        return self._step.graph(cuda_graph, pool=pool, stream=stream)


def install(s: core.Settings, version: str) -> core.Adoption:
    """Wrap the hook points of SGLang ``version`` (a release of :data:`hooks.KNOWN`);
    idempotent. Returns the process's adoption."""
    global ADOPTION
    runner_cls = core.resolve(hook(ENGINE, version, "DecodeCudaGraphRunner"))
    backend_cls = core.resolve(hook(ENGINE, version, "FullCudaGraphBackend"))
    if getattr(backend_cls, "__capture_plan__", None) is not None:
        return backend_cls.__capture_plan__
    adoption = core.Adoption(s, ENGINE, make_loop=_make_loop)
    ADOPTION = adoption
    one_stream, one_shape = runner_cls._capture_one_stream, runner_cls.capture_one_shape
    session, capture_one = backend_cls.capture_session, backend_cls.capture_one

    def _capture_one_stream(self, *args, **kw):
        loop = adoption.loop
        if loop is None:
            return one_stream(self, *args, **kw)
        order = loop.sizes(phase_of(self))  # checked against capture_bs in capture_session
        saved = self.capture_bs
        self.capture_bs = list(reversed(order))  # the runner iterates reversed(capture_bs)
        try:
            return one_stream(self, *args, **kw)
        finally:
            self.capture_bs = saved

    shape_params = inspect.signature(one_shape)

    def capture_one_shape(self, *args, **kw):
        if adoption.loop is not None:
            # by name, as the release's signature has them (a hook point of the contract)
            given = shape_params.bind(self, *args, **kw).arguments
            labels = {"lora": given.get("variant_label"), "attention": given.get("attention_variant")}
            adoption.step(phase_of(self), given["size"], labels)
        return one_shape(self, *args, **kw)

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
        if sorted(order) != sorted(runner.capture_bs):  # before the part: nothing to release
            raise core.PluginRefused(
                f"the {phase} runner captures sizes {sorted(runner.capture_bs)}, the plan {sorted(order)}",
                where=f"{core.ENV_PLAN}={s.plan}",
                fix="build the plan with the engine's capture sizes, or set the engine's sizes to the plan's",
            )
        self._pool = loop.pool(_pool_of(adoption.plan, phase))
        if self not in adoption.holders:
            adoption.holders.append(self)
        with loop.part(), session(self, stream):
            yield

    def capture_one_routed(self, shape_key, forward_fn, capture_inputs=None, post_warmup_hook=None):
        step = adoption.current
        if adoption.loop is None or step is None:
            return capture_one(self, shape_key, forward_fn, capture_inputs, post_warmup_hook)
        module = self._device_module
        via = self._device_module = _GraphThroughStep(module, step)
        try:
            capture_one(self, shape_key, forward_fn, capture_inputs, post_warmup_hook)
        finally:
            self._device_module = module
        out = self._outputs[shape_key]
        self._outputs[shape_key] = step.hold(out) if via.used else step.hold(out, graph=self._graphs[shape_key])
        adoption.current = None

    runner_cls._capture_one_stream = _capture_one_stream
    runner_cls.capture_one_shape = capture_one_shape
    backend_cls.capture_session = capture_session
    backend_cls.capture_one = capture_one_routed
    backend_cls.__capture_plan__ = adoption
    return adoption
