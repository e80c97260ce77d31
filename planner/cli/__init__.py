"""The ``planner`` command: a thin typer layer over the library.

Exit codes: 0 ok; 1 user error or drift (one line on stderr: what, where, fix);
2 internal bug (traceback only with ``--debug``). Command modules import the
library lazily so that ``planner --help`` stays fast and never imports torch.
"""

from __future__ import annotations

import sys

import typer

from . import build, check, diff, explain, graph, report, schema, show, simulate

__all__ = ["app", "main"]

app = typer.Typer(add_completion=False, no_args_is_help=True, rich_markup_mode=None,
                  pretty_exceptions_enable=False,
                  help="Plan CUDA-graph capture: predict pool memory, choose a safe schedule, write a plan.")


@app.callback()
def _root(debug: bool = typer.Option(False, "--debug", help="Show tracebacks for errors.")) -> None:
    """Plan CUDA-graph capture for LLM serving engines."""


for module in (build, check, show, explain, diff, graph, simulate, report, schema):
    module.register(app)


def _usage_errors() -> tuple[type, ...]:
    # Newer typer vendors click (typer._click); older typer uses click itself.
    kinds: list[type] = []
    base = getattr(__import__("typer.exceptions").exceptions, "TyperException", None)
    if base is not None:
        kinds.append(base)
    try:
        import click

        kinds.append(click.ClickException)
    except ImportError:
        pass
    return tuple(kinds)


def main(argv: list[str] | None = None) -> int:
    from schemas.errors import CapturePlanError

    args = sys.argv[1:] if argv is None else argv
    debug = "--debug" in args
    try:
        rc = typer.main.get_command(app).main(args=args, prog_name="planner", standalone_mode=False)
        if isinstance(rc, int):  # click returns the code of an Exit raised by a command
            return rc
    except CapturePlanError as err:
        if debug:
            raise
        print(f"planner: error: {err}", file=sys.stderr)
        return err.exit_code
    except typer.Abort:
        print("planner: aborted", file=sys.stderr)
        return 1
    except typer.Exit as err:
        return err.exit_code
    except _usage_errors() as err:  # bad options and arguments: a user error
        if debug or not hasattr(err, "format_message"):
            raise
        hint = f" (see `planner {err.ctx.info_name} --help`)" if getattr(err, "ctx", None) else ""
        print(f"planner: error: {' '.join(err.format_message().split())}{hint}", file=sys.stderr)
        return 1
    except Exception as err:  # a bug in capture-plan
        if debug:
            raise
        print(f"planner: internal error: {type(err).__name__}: {err} (rerun with --debug and report it)",
              file=sys.stderr)
        return 2
    return 0
