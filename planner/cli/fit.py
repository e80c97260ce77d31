"""``planner fit``: will it fit, before deploying (weights, activations, graphs, KV tokens)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import click

from ._common import PATH, Command, option

if TYPE_CHECKING:
    from capture_plan.planner.fit.inputs import FitRequest

_CLICK_TYPES = {"int": int, "float": float, "choice": str, "sizes": str, "json": str, "str": str}


def _engine_flags(fn):
    """One option per row of planner/data/fit_flags.toml (its type and help from the row)."""
    from capture_plan.planner.fit.flags import engine_flags

    for name, f in reversed(engine_flags().items()):
        if f.type == "bool":
            fn = option(f"--{name}", is_flag=True, default=None, help=f.describe())(fn)
        else:
            metavar = {"sizes": "list", "json": "json"}.get(f.type, _CLICK_TYPES[f.type].__name__)
            fn = option(f"--{name}", type=_CLICK_TYPES[f.type], metavar=metavar, help=f.describe())(fn)
    return fn


def _engines() -> str:
    """The modelled releases (planner/data/fit_rules.toml), a run of one engine's as its ends."""
    from capture_plan.planner.fit.tables import releases

    by: dict[str, list[str]] = {}
    for r in releases():
        by.setdefault(r.split("==")[0], []).append(r)
    runs = [vs[0] if len(vs) == 1 else f"{vs[-1]} to {vs[0]}" if len(vs) > 2 else " or ".join(vs) for vs in by.values()]
    return ", ".join(runs[:-1]) + f" or {runs[-1]}" if len(runs) > 1 else runs[0]


def fit_command(req: FitRequest, model: str, tail: list[str], changes: dict) -> str:
    """The ``planner fit`` command of request ``req`` (``model``: its ``--model`` as given;
    ``tail``: the other options as given, files and ``--json``) with a refusal's ``changes``
    applied; behind the engine's variable (``VLLM_ALLOW_LONG_MAX_MODEL_LEN=1 planner fit ...``)
    where the changed request's context length is let through by it, since the command is
    pasted into a shell that may not have it set."""
    import shlex

    req = req.changed(changes)
    env = _allowed_by(req)
    argv = ["planner", "fit", "--model", model, "--device", req.device, "--engine", req.engine]
    argv += ["--tp", str(req.tp)] if req.tp != 1 else []
    for name, v in req.flags.items():
        if v is True:
            argv.append(f"--{name}")
        elif v is not False:
            argv += [f"--{name}", ",".join(map(str, v)) if isinstance(v, (list, tuple)) else str(v)]
    return (f"{env}=1 " if env else "") + shlex.join(argv + tail)


def _allowed_by(req: FitRequest) -> str:
    """The engine's variable (set in this process) that lets ``req``'s context length past the
    length the release derives; "" where none does, or where ``req`` is refused (its refusal's
    command is rendered, not resolved)."""
    from capture_plan.planner.fit.inputs import resolve
    from capture_plan.schemas.errors import InputError

    try:
        return resolve(req).context.allowed_by
    except InputError:
        return ""


@click.command("fit", cls=Command)
@option("--model", required=True, metavar="config", help="A transformers config.json, a spec TOML or a preset name.")
@option(
    "--device",
    required=True,
    metavar="name",
    help="The device: torch's name, or words of exactly one (H100, a100-40gb; planner/data/fit_devices.toml).",
)
@option(
    "--engine",
    required=True,
    metavar="engine==version",
    help=f"A modelled release: {_engines()} (planner/data/fit_rules.toml).",
)
@option("--tp", type=int, default=1, metavar="int", help="Tensor-parallel size [1].")
@option(
    "--weights-index",
    type=PATH,
    metavar="path",
    help="model.safetensors.index.json: exact weight bytes (at --tp 1; over --tp, the replicated norms estimated).",
)
@option(
    "--plan",
    "plan_path",
    type=PATH,
    metavar="path",
    help="A plan file: its capture sizes and phases replace the engine default's, its predicted pool is the "
    "graph figure's pool.",
)
@option(
    "--calibration",
    type=PATH,
    metavar="path",
    help="A capture report measured on --device from --plan's plan (as build --calibration takes it; needs "
    "--plan): the graph memory is its measured pool + graph-exec + workspaces.",
)
@option(
    "--traffic",
    type=PATH,
    metavar="file",
    help="Batch sizes the engine ran (planner sizes --traffic's forms: size,count CSV, JSON, a Prometheus "
    "scrape): the traffic's best size lists priced in KV tokens beside the engine default's, each row's "
    "expected padding.",
)
@option("--json", "as_json", is_flag=True, help="Print the result as JSON (planner schema fit).")
@_engine_flags
def command(model, device, engine, tp, weights_index, plan_path, calibration, traffic, as_json, **flags) -> None:
    """Where the device's memory goes: weights, non-torch, activation peak, graph memory, KV tokens.

    Exit 1 with one line when it does not fit, naming the item that overflows and the fixes.

    \b
    Examples (run from a checkout's root; tests/test_fit.py runs each):
      planner fit --model planner/data/configs/llama-3.1-8b.json --device H100 --engine vllm==0.34.0
      planner fit --model planner/data/configs/qwen2.5-7b.json --device H200 --engine sglang==0.5.23 --json
      planner fit --model llama-3-8b --device H200 --engine vllm==0.34.0 --max-model-len 8192 \\
        --plan plans/fa3-ci-h200.json --calibration plans/calibration/h200-fa3-ci.json
      SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN=1 planner fit --model planner/data/configs/llama-3.1-8b.json \\
        --device H100 --engine sglang==0.5.23 --context-length 8192 --speculative-algorithm EAGLE \\
        --speculative-draft-model-path planner/data/configs/eagle-llama-3.1-8b.json
      VLLM_ALLOW_LONG_MAX_MODEL_LEN=1 planner fit --model planner/data/configs/qwen2.5-7b.json \\
        --device H100 --engine vllm==0.34.0 --max-model-len 65536
      planner fit --model planner/data/configs/llama-3.1-8b.json --device H100 --engine vllm==0.34.0 \\
        --max-model-len 8192 --traffic tests/data/traffic-skewed.csv"""
    import msgspec

    from capture_plan.planner.fit.fit import FitRequest, fit
    from capture_plan.planner.fit.model import load_model
    from capture_plan.schemas.errors import InputError

    given = {k.replace("_", "-"): v for k, v in flags.items()}
    fit_model = load_model(model, weights_index)
    plan = graphs = None
    if plan_path is not None:
        from capture_plan.planner.fit.measured import plan_graphs

        from ._common import read_plan

        plan = read_plan(plan_path)
        graphs = plan_graphs(plan, str(plan_path), fit_model)
    if calibration is not None and plan is None:  # the report measured its own plan's graphs
        raise InputError(
            "a calibration measures the graphs of the plan it was captured from, not the engine default's",
            where=f"--calibration {calibration}",
            fix="give --plan PLAN, the plan the report was captured from",
        )
    from capture_plan.planner.fit.refusal import Refusal

    files = [
        ("--weights-index", weights_index),
        ("--plan", plan_path),
        ("--calibration", calibration),
        ("--traffic", traffic),
    ]
    tail = [str(x) for flag, path in files if path is not None for x in (flag, path)] + (["--json"] if as_json else [])
    req = FitRequest(fit_model, device, engine, tp, {k: v for k, v in given.items() if v is not None}, None, graphs)
    try:
        if calibration is not None and plan is not None:  # its device is --device (refused: this command's fix)
            from capture_plan.planner.fit.measured import calibration_graph
            from capture_plan.planner.inputs.specs import speculative_kinds
            from capture_plan.planner.report.check import check_report_plan

            measured = calibration_graph(calibration, device, plan, str(plan_path), check_report_plan)
            # a plan with speculative phases: the report measured its verify and draft graphs
            spec = any(p.kind in speculative_kinds() for p in plan.phases)
            req = msgspec.structs.replace(req, measured_graph=measured, measured_speculative=spec)
        if traffic is not None:  # its front's lists priced beside the engine default's
            from capture_plan.planner.sizes.fit_traffic import fit_traffic

            res = fit_traffic(req, str(traffic))
        else:
            res = fit(req)
    except Refusal as err:  # its fix as this command, changed
        err.fix = f"{err.hint}: `{fit_command(req, model, tail, err.changes)}`"
        raise
    if as_json:
        click.echo(msgspec.json.format(msgspec.json.encode(res), indent=2).decode())
    else:
        from capture_plan.planner.fit.render import render

        click.echo(render(res), nl=False)
    if not res.fits:
        from capture_plan.planner.fit.flags import changes_of
        from capture_plan.planner.fit.result import fix_text

        fix = fix_text(res.fixes)
        if res.fixes:  # each checked by fit to fit; the first as this command with it
            first, *more = res.fixes
            cmd = fit_command(req, model, tail, changes_of(first))
            fix = f"{first}: `{cmd}`" + (f" (or {' or '.join(more)})" if more else "")
        raise InputError(f"does not fit: {res.overflow}", where=f"{res.device} x{res.tp}", fix=fix)
