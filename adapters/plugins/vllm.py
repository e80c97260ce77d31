"""The vLLM plugin: a ``vllm.general_plugins`` entry point (pyproject.toml) that routes the
V2 GPU model runner's FULL graphs through a capture plan and answers its graph-memory
estimate from the plan.

Enabled by ``CAPTURE_PLAN_PLAN`` (:mod:`.core`); unset, :func:`register` returns without
touching vLLM. vLLM calls general plugins in every process and lets their exceptions
stop it: a refusal is :class:`SystemExit` with the one line. Its hook points are rows of
:mod:`.hooks` for the vLLM release installed (0.33.0). What it wraps:

* ``CudaGraphManager.capture`` for a ``ModelCudaGraphManager`` (the model's graphs):
  the FULL descriptors in the plan's order (vLLM's are largest-first; where the plan's
  first is not the largest, one warm-up at the largest runs first, as vLLM sizes its
  persistent output buffer from the first warm-up), recorded into the
  plan's pool (``self.pool``), each descriptor one plan step (taken when vLLM prepares
  its warm-up), and each graph handed to the step with the persistent hidden-state
  buffer it copies into (``hold(graph=)``: the pool is checked; the stream, vLLM's own
  per descriptor, is not). The uniform-decode FULL graphs are the plan's ``decode``
  phase (``target_verify`` with speculative tokens), one per request count;
* ``GPUModelRunner.profile_cudagraph_memory``: the plan's device total (:func:`plan_total`)
  instead of a profiling capture; a plan without one
  (not calibrated for a device) is refused (or, with ``CAPTURE_PLAN_FALLBACK=engine``,
  vLLM profiles as it does).

Not routed (left to vLLM, in the same pool): PIECEWISE graphs (recorded by torch.compile's
wrappers), encoder graphs, the speculator's managers, LoRA variants and micro-batch twins
(a plan with those refuses: the descriptors would not match the plan's sizes).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from capture_plan.adapters.plugins import core
from capture_plan.adapters.plugins.hooks import hook

ENGINE = "vllm"
#: the adoption of this process (None until :func:`install`)
ADOPTION: core.Adoption | None = None
#: extra ``capture_loop`` keywords (the CPU tests pass ``device``)
LOOP_OPTIONS: dict[str, Any] = {}


def register() -> None:
    """The entry point: nothing unless ``CAPTURE_PLAN_PLAN`` is set; then the release
    check, the plan loaded (a missing or invalid plan stops start-up here), the hooks."""
    core.register(ENGINE, install)


def _make_loop(plan, *, stream=None, on_failure=None):
    from capture_plan.executor import capture_loop

    given = {"stream": stream} if stream is not None else {}
    return capture_loop(plan, on_failure=on_failure, **given, **LOOP_OPTIONS)


def _env_problems(plan) -> list[str]:
    from capture_plan.executor.load import check_environment, current_environment

    return check_environment(plan, current_environment(tuple(plan.requires.modules)))


def facts_of(vllm_config, phase: str | None) -> core.EngineFacts:
    """TP size and the model's config.json from vLLM's config."""
    tp = getattr(getattr(vllm_config, "parallel_config", None), "tensor_parallel_size", 1) or 1
    model = getattr(getattr(vllm_config, "model_config", None), "model", None)
    config = Path(model) / "config.json" if isinstance(model, str) and Path(model).is_dir() else None
    return core.EngineFacts(ENGINE, tp=int(tp), model_config=config, phases=(phase,) if phase else ())


def phase_of(manager) -> str:
    """The plan phase of a manager's uniform-decode FULL graphs."""
    return "target_verify" if getattr(manager, "decode_query_len", 1) > 1 else "decode"


def install(s: core.Settings, version: str) -> core.Adoption:
    """Wrap the hook points of vLLM ``version``; idempotent. Returns the adoption."""
    global ADOPTION
    manager_cls = core.resolve(hook(ENGINE, version, "CudaGraphManager"))
    model_manager_cls = core.resolve(hook(ENGINE, version, "ModelCudaGraphManager"))
    runner_cls = _owner(version)
    if getattr(manager_cls, "__capture_plan__", None) is not None:
        return manager_cls.__capture_plan__
    adoption = core.Adoption(s, ENGINE, make_loop=_make_loop)
    ADOPTION = adoption
    capture, profile = manager_cls.capture, runner_cls.profile_cudagraph_memory

    def capture_routed(self, create_forward_fn, progress_bar_desc="Capturing CUDA graphs"):
        full = next((m for m in self._capture_descs if getattr(m, "name", "") == "FULL"), None)
        if not isinstance(self, model_manager_cls) or full is None:
            return capture(self, create_forward_fn, progress_bar_desc)
        phase = phase_of(self)
        loop = adoption.begin(facts_of(self.vllm_config, phase), env_problems=_env_problems)
        if loop is None:
            return capture(self, create_forward_fn, progress_bar_desc)
        descs = self._capture_descs[full]
        by_reqs = {d.num_reqs: d for d in descs}
        order = loop.sizes(phase)
        if len(by_reqs) != len(descs) or sorted(by_reqs) != sorted(order):
            raise core.PluginRefused(
                f"vLLM's FULL {phase} graphs are for {sorted(d.num_reqs for d in descs)} requests, "
                f"the plan's for {sorted(order)}",
                where=f"{core.ENV_PLAN}={s.plan}",
                fix="build the plan with vLLM's sizes (a graph per request count, no LoRA or micro-batch twins)",
            )
        saved = self._capture_descs[full], self.pool
        self._capture_descs[full] = [by_reqs[n] for n in order]
        self.pool = loop.pool(next(st.pool for st in adoption.plan.steps if st.op == "capture" and st.phase == phase))
        if _Holder(self) not in adoption.holders:
            adoption.holders.append(_Holder(self))
        pending: list = []

        def hold_pending() -> None:
            if pending:
                desc, step = pending.pop()
                step.hold(self.hidden_states[: desc.num_tokens], graph=self.graphs[desc])

        def create(desc, warmup):
            if warmup and desc.cg_mode == full:
                hold_pending()
                pending.append((desc, adoption.step(phase, desc.num_reqs, {})))
            return create_forward_fn(desc, warmup)

        try:
            with loop.part():
                if order[0] != max(order):
                    # vLLM sizes its persistent hidden-state buffers from the first FULL warm-up:
                    # a plan that captures a smaller size first gets its warm-up at the largest
                    # (the plan's once-per-phase warm-up step) before it
                    largest = by_reqs[max(order)]
                    create_forward_fn(largest, True)(getattr(type(full), "NONE", None))
                capture(self, create, progress_bar_desc)
                hold_pending()
        finally:
            self._capture_descs[full] = saved[0]

    def profile_routed(self):
        manager = getattr(self, "cudagraph_manager", None)
        loop = adoption.begin(
            facts_of(self.vllm_config, phase_of(manager) if manager is not None else None), env_problems=_env_problems
        )
        if loop is None:
            return profile(self)
        total = plan_total(adoption.plan)
        if total is None:
            err = core.PluginRefused(
                "the plan does not say what capture takes from the device (reserve for capture: unknown)",
                where=f"{core.ENV_PLAN}={s.plan}",
                fix="calibrate it from a capture report of this device (planner build ... --calibration REPORT)",
            )
            if s.fallback != "engine":
                raise err
            core.log.warning("capture-plan: %s; vLLM profiles as it does", err)
            return profile(self)
        return int(total)

    manager_cls.capture = capture_routed
    runner_cls.profile_cudagraph_memory = profile_routed
    manager_cls.__capture_plan__ = adoption
    return adoption


def plan_total(plan) -> int | None:
    """What capture takes from the device by the plan: ``schemas.keys.capture_memory``
    where this checkout has it (per graph key, issue 28), else ``predicted.device.total_bytes``;
    None while an item is unknown (a plan not calibrated for a device)."""
    import importlib

    try:
        keys = importlib.import_module("capture_plan.schemas.keys")
    except ImportError:
        return getattr(getattr(plan.predicted, "device", None), "total_bytes", None)
    memory = keys.capture_memory(plan)
    return int(memory.bytes) if memory.complete else None


def _owner(version: str):
    """The runner class (the owner of ``GPUModelRunner.profile_cudagraph_memory``)."""
    import importlib

    h = hook(ENGINE, version, "GPUModelRunner.profile_cudagraph_memory")
    return getattr(importlib.import_module(h.module), h.name.split(".")[0])


class _Holder:
    """A manager as the adoption's holder: a failed loop drops its graphs (vLLM's own
    ``release_graphs``)."""

    def __init__(self, manager):
        self.manager = manager

    def __eq__(self, other):
        return isinstance(other, _Holder) and other.manager is self.manager

    def cleanup(self) -> None:
        self.manager.release_graphs()
