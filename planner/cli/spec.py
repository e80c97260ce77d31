"""``planner spec show``: the embedded spec as TOML to save, edit and pass with ``--spec``."""

from __future__ import annotations

import click

from ._common import Command, option


@click.group("spec", context_settings={"help_option_names": ["-h", "--help"]}, no_args_is_help=True)
def command() -> None:
    """Work with specs: print the embedded one to start your own."""


@command.command("show", cls=Command)
@option("--speculative", metavar="str", help="Add the speculative phases of this algorithm (eagle).")
@option("--preset", metavar="str", help="Another engine's conventions: vllm (as `planner build --preset`).")
@option("--max-bs", type=int, metavar="int", help="Largest capture size [256; --preset vllm: 512 tokens].")
@option("--tp", type=int, metavar="int", help="Tensor-parallel size to write into the spec [1].")
def show(speculative, preset, max_bs, tp) -> None:
    """Print the embedded spec for these options as TOML (redirect it to a file, edit it, build with --spec)."""
    import msgspec

    from capture_plan.planner.build import check_tp
    from capture_plan.planner.inputs.spec_toml import spec_toml
    from capture_plan.planner.inputs.specs import default_spec

    spec = default_spec(speculative, max_bs, preset)
    if tp is not None:
        check_tp(spec, tp)
        spec = msgspec.structs.replace(spec, tp=tp)
    args = [
        a
        for flag, v in (("--speculative", speculative), ("--preset", preset), ("--max-bs", max_bs), ("--tp", tp))
        if v is not None
        for a in (flag, str(v))
    ]
    shown = " ".join(["planner", "spec", "show", *args])
    click.echo(
        spec_toml(
            spec,
            [
                f"The embedded spec, from `{shown}`.",
                "Edit it and build with `planner build -b BACKEND --spec THIS.toml`",
                "(fields: `planner schema spec`; phase kinds: planner/data/phase_kinds.toml).",
            ],
        ),
        nl=False,
    )
