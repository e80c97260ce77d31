"""Engine start-ups around the runners: what the CPU tests (CUDA faked), the GPU
tests and engine plugins share. Each builds the engine's objects the way the
engine does (its global pool and streams first, runners made one after
another), opens one ``capture_loop`` over the plan with them, and captures.

Plans: :func:`sglang_plan` (the EAGLE reference spec, decode keyed by LoRA x
attention variants) and :func:`vllm_plan` (PIECEWISE pieces, FULL, a FULL
micro-batch twin on stream "ubatch"): the planner's where it builds the shape,
:func:`engines.plans.keyed` where a test needs the toy model's own kept bytes.
"""

from __future__ import annotations

import json

import torch

from . import sglang_runner, vllm_runner
from .plans import build, keyed

LORA = {"lora": ["lora", "nolora"], "attention": ["a", "b"]}


# -- SGLang --------------------------------------------------------------------------
def sglang_plan(tmp_path, sizes, *, keeps=None, strategies=()):
    """The EAGLE reference's four phases at ``sizes``, a warm-up before every
    key, decode keyed by LoRA x attention variants (the spec's ``variants``, the
    planner expanding them); ``keeps``: size -> bytes each decode warm-up keeps
    (FullCudaGraphBackend's reused output: the toy's bytes, set by
    :func:`engines.plans.keyed` on a plan built without variants);
    ``strategies``: more build strategies (``order=smallest-first``)."""
    from capture_plan.references.planted import spec_toml

    spec = spec_toml(sizes)
    if keeps is not None:
        return keyed(build(tmp_path, spec, "warmup=every-size"), "decode", variants=LORA, keeps=keeps)
    head = f'name = "decode"\nkind = "decode"\nsizes = {sorted(set(sizes))}\n'
    assert head in spec
    axes = ", ".join(f"{axis} = {labels!r}".replace("'", '"') for axis, labels in LORA.items())
    return build(tmp_path, spec.replace(head, head + f"variants = {{ {axes} }}\n"), "warmup=every-size", *strategies)


def sglang_runners(module, model, sizes, reuse=False):
    """The target's decode runner (LoRA and attention variants), the target in
    verify mode, then the EAGLE draft runners: the order SGLang makes them in."""
    return [
        module.DecodeCudaGraphRunner(
            model, sizes, reuse_output_buffer=reuse, record_nolora_graph=True, attention_labels=("a", "b")
        ),
        module.DecodeCudaGraphRunner(model, sizes, captured_req_width=4, phase="target_verify"),
        module.EAGLEDraftCudaGraphRunner(model, sizes),
        module.EAGLEDraftExtendCudaGraphRunner(model, sizes, captured_req_width=4),
    ]


class SGLangEngine:
    """What the tests read of an engine: its runners, every backend's graphs and outputs."""

    def __init__(self):
        self.runners: list = []

    def cleanup(self):  # capture_loop's on_failure: every runner's backend drops its graphs
        for r in self.runners:
            r.backend.cleanup()

    @property
    def graphs(self) -> dict:
        return {(r.phase, *k): g for r in self.runners for k, g in r.backend._graphs.items()}

    @property
    def outputs(self) -> dict:
        return {(r.phase, *k): o for r in self.runners for k, o in r.backend._outputs.items()}


def start_sglang(plan, model, sizes, *, reuse=False, configure=None, **kw):
    """SGLang's start-up: its global pool and stream, the runners made one
    after another (each with its backend), each capturing in its part of one
    loop. Returns (loop, engine, runners)."""
    from capture_plan.executor import capture_loop

    sglang_runner.reset_globals()
    pool = sglang_runner.get_or_create_global_graph_memory_pool()
    stream = sglang_runner.get_or_create_global_graph_capture_stream()
    engine = SGLangEngine()
    loop = capture_loop(
        plan, stream=stream, pools={"shared": pool}, device=model.device, on_failure=engine.cleanup, **kw
    )
    runners = sglang_runners(sglang_runner, model, sizes, reuse)
    runners.sort(key=lambda r: loop.phases.index(r.phase))  # the planner orders the phases as the engine makes runners
    if configure is not None:
        configure(engine, runners)
    for runner in runners:
        engine.runners.append(runner)  # made when the engine gets to it
        with loop.part():
            runner.capture(loop)
    return loop, engine, runners


def plugged_sglang_start(module, plan, model, sizes):
    """SGLang's start-up with the plugin installed, the release's code (``module``): its runners
    made one after another in the plan's phase order (the engine's), each capturing in its own
    loop (the plugin's capture_session)."""
    module.reset_globals()
    engine = SGLangEngine()
    capture_in_plan_order(engine, sglang_runners(module, model, sizes), plan)
    return engine


def capture_in_plan_order(engine: SGLangEngine, runners, plan) -> None:
    """SGLang's ``runners`` made one after another in ``plan``'s phase order (the engine's),
    each held by ``engine`` and capturing (the plugin's capture_session)."""
    phases = list(dict.fromkeys(s.phase for s in plan.steps if s.op == "capture"))
    for runner in sorted(runners, key=lambda r: phases.index(r.phase)):
        engine.runners.append(runner)
        runner.capture()


class SGLangTarget:
    """verify's view of the SGLang engine: a key's forward run eagerly (the
    dispatch name parsed back to phase and labels), fresh inputs."""

    def __init__(self, model):
        self.model = model

    def run(self, phase, bs, ws):
        name, _, suffix = phase.partition("/")
        labels = dict(pair.split("=") for pair in suffix.split(",")) if suffix else {}
        return self.model.forward(name, bs, labels)

    def prepare(self, phase, n, bs, generator):
        self.model.prepare(phase, n, bs, generator)

    def refresh(self, phase, n, bs, ws):
        pass


# -- vLLM ------------------------------------------------------------------------------
#: the speculator's draft prefill query length (EagleSpeculator: num_speculative_steps + 1)
DRAFT_QUERY = 3


def draft_sizes(sizes) -> list[int]:
    """The draft prefill manager's uniform-decode requests: each size rounded up to
    the query length, within the largest size (vLLM's _init_candidates)."""
    return sorted({-(-n // DRAFT_QUERY) for n in sizes if -(-n // DRAFT_QUERY) * DRAFT_QUERY <= max(sizes)})


def vllm_spec(sizes, *, draft: bool = False, loras=None, pieces: int | None = None, draft_decode=None) -> str:
    """vLLM's phases (the plugin's names: capture_plan.adapters.plugins.vllm.phase_of; the
    runner's desc_key names them alike): the model's PIECEWISE, uniform-decode FULL and FULL
    micro-batch twins; with ``draft`` the EAGLE speculator's draft prefill PIECEWISE and FULL
    (DRAFT_QUERY tokens a request) and its draft decode FULL. ``after`` states vLLM's order
    (each manager in turn, PIECEWISE then FULL in each), which the plugin refuses a plan to
    break: without it the optimizer may order the draft managers' phases by pool cost. ``loras`` (labels such as
    ["0", "1"]): the model's phases declare vLLM's LoRA axis ``loras``, and the spec sets the
    graph-key fields the planner then writes itself: ``pieces`` a PIECEWISE key, the twins'
    stream and micro-batches, the persistent hidden states the first warm-up keeps.
    ``draft_decode``: the draft decode manager's request sizes where they are not ``sizes``
    (vLLM 0.34.0's own grid up to max_num_seqs: ``decode_cudagraph_capture_grid``)."""
    twins = [n for n in sizes if n >= 2]
    keyed = ""
    if loras:
        keyed = f"variants = {{ loras = {json.dumps(list(loras))} }}\n"
    piecewise = keyed + (f"pieces = {pieces}\n" if pieces else "") + ('warmup_keeps = "outputs"\n' if loras else "")
    twin = keyed + ('stream = "ubatch"\nmicro_batches = 2\n' if loras else "")
    spec = (
        f'[[phases]]\nname = "piecewise"\nkind = "piecewise"\nsizes = {list(sizes)}\n{piecewise}'
        f'[[phases]]\nname = "full_decode"\nkind = "full"\nsizes = {list(sizes)}\nafter = ["piecewise"]\n{keyed}'
        f'[[phases]]\nname = "full_decode_ubatch"\nkind = "full"\nsizes = {twins}\ntwin_of = "full_decode"\n{twin}'
    )
    if draft:
        spec += (
            f'[[phases]]\nname = "draft_prefill_piecewise"\nkind = "piecewise"\nsizes = {list(sizes)}\n'
            'after = ["full_decode", "full_decode_ubatch"]\n'
            + (f"pieces = {pieces}\n" if loras and pieces else "")
            + f'[[phases]]\nname = "draft_prefill_full_decode"\nkind = "full"\nsizes = {draft_sizes(sizes)}\n'
            f'tokens_per_request = {DRAFT_QUERY}\nafter = ["draft_prefill_piecewise"]\n'
            f'[[phases]]\nname = "draft_decode_full_decode"\nkind = "full"\nsizes = {list(draft_decode or sizes)}\n'
            'after = ["draft_prefill_full_decode"]\n'
        )
    return spec


def vllm_plan(tmp_path, sizes, *, pieces=3, keeps=None, loras=None, draft=False, order=(), draft_decode=None):
    """PIECEWISE (``pieces`` a key), FULL, and the FULL micro-batch twins on
    stream "ubatch" (``twin_of``: each right after its FULL graph, as vLLM captures
    them), each largest first (``order``: more build strategies), outputs
    as views; ``keeps``: bytes the first warm-up keeps (the persistent hidden_states:
    the first warm-up of all, the largest PIECEWISE descriptor's, run as NONE, stores
    its output); ``draft``: the speculator's phases too (``draft_decode``: :func:`vllm_spec`'s).
    ``loras`` (vLLM's LoRA capture cases as labels, e.g. ["0", "1"]): the planner builds the whole plan from the spec
    (:func:`vllm_spec`: axis ``loras``, the graph-key fields; what the first warm-up
    keeps is then the planner's figure for the spec's model, ``keeps`` unused); without,
    :func:`engines.plans.keyed` sets the graph-key fields, ``keeps`` the toy's bytes."""
    strategies = ("warmup=every-size", "outputs=view", *order)
    if loras:
        spec = vllm_spec(sizes, draft=draft, loras=loras, pieces=pieces, draft_decode=draft_decode)
        return build(tmp_path, spec, *strategies)
    plan = build(tmp_path, vllm_spec(sizes, draft=draft, draft_decode=draft_decode), *strategies)
    first = max(sizes) if not order else plan.steps[0].bs
    plan = keyed(plan, "piecewise", pieces=pieces, keeps={first: keeps} if keeps is not None else None)
    plan = keyed(plan, "full_decode_ubatch", stream="ubatch", micro_batches=2)
    if draft:
        plan = keyed(plan, "draft_prefill_piecewise", pieces=pieces)
    return plan


class VLLMTarget:
    """verify's view of the vLLM engine: a piece run eagerly on the inputs it
    was recorded with, a FULL graph's compiled model run eagerly, fresh inputs."""

    def __init__(self, runner, model):
        self.runner, self.model = runner, model

    def run(self, phase, bs, ws):
        manager = self.runner.cudagraph_manager
        base, _, piece = phase.partition("#")
        name, _, suffix = base.partition("/")
        labels = dict(pair.split("=") for pair in suffix.split(",")) if suffix else {}
        compiled = self.runner.speculator.compiled if name.startswith("draft_") else manager.compiled
        if piece:
            wrapper = compiled.pieces[int(piece)]
            out = wrapper.runnable(*vllm_runner.entry(wrapper, bs, int(labels.get("loras", 0))).inputs)
            return out if isinstance(out, torch.Tensor) else out[0]
        return compiled(self.model.x[:bs])

    def prepare(self, phase, n, bs, generator):
        self.model.prepare(phase, n, bs, generator)

    def refresh(self, phase, n, bs, ws):
        pass


def vllm_runner_of(module, model, sizes, *, loras=None, draft=None):
    """vLLM's runner of ``module`` (the adopted runner, or the version before the
    adoption that the plugin routes): its manager, compiled pieces, global pool,
    capture stream, micro-batch stream, LoRA capture cases (``loras``: ints) and
    speculator (``draft``: the draft model)."""
    module.reset_globals()
    return module.GPUModelRunner(model, sizes, ubatch_stream=torch.cuda.Stream(), lora_capture_cases=loras, draft=draft)


def start_vllm(plan, model, sizes, *, configure=None, verified=False, loras=None, draft=None, **kw):
    """vLLM's start-up: the runner (:func:`vllm_runner_of`), then capture_model in one
    loop (``verified``: with :class:`VLLMTarget` as the loop's target, for verify).
    Returns (loop, runner)."""
    from capture_plan.executor import capture_loop

    runner = vllm_runner_of(vllm_runner, model, sizes, loras=loras, draft=draft)
    streams = {"ubatch": runner.ubatch_runner.capture_stream}
    if configure is not None:
        configure(runner, streams)
    if verified:
        kw["target"] = VLLMTarget(runner, model)
    loop = capture_loop(
        plan,
        stream=runner.cudagraph_manager.capture_stream,
        streams=streams,
        pools={"shared": vllm_runner.get_global_graph_pool()},
        device=model.device,
        on_failure=runner.release,
        **kw,
    )
    with loop:
        runner.capture_model(loop)
    return loop, runner


def vllm_profiling(plan, runner, model, profiling, passes: list):
    """``loop_for(throwaway_pool)`` for the adopted ``profile_cudagraph_memory``:
    the declared partial pass (``profiling``: phase -> keys), appended to ``passes``."""
    from capture_plan.executor import capture_loop

    def loop_for(throwaway):
        loop = capture_loop(
            plan,
            stream=runner.cudagraph_manager.capture_stream,
            streams={"ubatch": runner.ubatch_runner.capture_stream},
            pools={"shared": throwaway},
            device=model.device,
            on_failure=runner.release,
            profiling=profiling,
        )
        passes.append(loop)
        return loop

    return loop_for
