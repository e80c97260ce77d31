"""``planner fit``: will it fit, before deploying (weights, activations, graphs, KV tokens)."""

from __future__ import annotations

from pathlib import Path

import click

from ._common import Command, option

_FLOAT = ("gpu-memory-utilization", "mem-fraction-static")
_STR = ("kv-cache-dtype", "cudagraph-mode")


def _engine_flags():
    from capture_plan.planner.fit.fit import SGLANG_FLAGS, VLLM_FLAGS

    out = []
    for name in dict.fromkeys(VLLM_FLAGS + SGLANG_FLAGS):
        if name == "enforce-eager":
            out.append(option(f"--{name}", is_flag=True, default=None, help="vLLM: no CUDA graphs."))
        elif name == "cudagraph-capture-sizes":
            out.append(option(f"--{name}", metavar="list", help="vLLM: capture sizes, comma-separated."))
        else:
            kind = float if name in _FLOAT else str if name in _STR else int
            owner = (
                "vLLM"
                if name in VLLM_FLAGS and name not in SGLANG_FLAGS
                else "SGLang"
                if name not in VLLM_FLAGS
                else "both"
            )
            out.append(
                option(
                    f"--{name}", type=kind, metavar=kind.__name__, help=f"{owner}'s own flag [the release's default]."
                )
            )
    return out


def _apply(fn):
    for dec in reversed(_engine_flags()):
        fn = dec(fn)
    return fn


@click.command("fit", cls=Command)
@option("--model", required=True, metavar="config", help="A transformers config.json or a preset name.")
@option("--device", required=True, metavar="name", help="The device as torch names it (planner/data/fit_devices.toml).")
@option("--engine", required=True, metavar="engine==version", help="vllm==0.34.0, vllm==0.33.0 or sglang==0.5.23.")
@option("--tp", type=int, default=1, metavar="int", help="Tensor-parallel size [1].")
@option(
    "--weights-index",
    type=click.Path(path_type=Path),
    metavar="path",
    help="model.safetensors.index.json: exact weight bytes.",
)
@option("--json", "as_json", is_flag=True, help="Print the result as JSON (planner schema fit).")
@_apply
def command(model, device, engine, tp, weights_index, as_json, **flags) -> None:
    """Where the device's memory goes: weights, non-torch, activation peak, graph memory, KV tokens.

    Exit 1 with one line when it does not fit, naming the item that overflows and the fixes."""
    import msgspec

    from capture_plan.planner.fit.fit import fit
    from capture_plan.planner.fit.model import load_model
    from capture_plan.schemas.errors import InputError

    given = {k.replace("_", "-"): v for k, v in flags.items() if v is not None}
    sizes = given.get("cudagraph-capture-sizes")
    if sizes is not None:
        try:
            given["cudagraph-capture-sizes"] = [int(s) for s in str(sizes).split(",") if s.strip()]
        except ValueError:
            raise InputError(
                f"capture sizes must be integers, got {sizes!r:.40}",
                where="--cudagraph-capture-sizes",
                fix="e.g. 1,2,4,8",
            ) from None
        if not given["cudagraph-capture-sizes"] or min(given["cudagraph-capture-sizes"]) < 1:
            raise InputError("capture sizes must be positive", where="--cudagraph-capture-sizes", fix="e.g. 1,2,4,8")
    res = fit(load_model(model, weights_index), device, engine, tp, given)
    if as_json:
        click.echo(msgspec.json.format(msgspec.json.encode(res), indent=2).decode())
    else:
        from capture_plan.planner.fit.render import render

        click.echo(render(res), nl=False)
    if not res.fits:
        raise InputError(f"does not fit: {res.overflow}", where=f"{res.device} x{res.tp}", fix=" or ".join(res.fixes))
