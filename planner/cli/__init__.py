"""The ``planner`` command: a thin typer layer over the library.

Exit codes: 0 ok; 1 bad input or drift (one line on stderr: what, where,
fix); 2 a usage error (unknown command or option, missing argument: the
framework's standard message and exit code); 3 an internal bug (one line;
the traceback with ``planner --debug ...``). Command modules import the
library lazily so that ``planner --help`` stays fast and never imports torch.
"""

from __future__ import annotations

import sys
from typing import Optional

import typer

from . import build, check, diff, explain, graph, report, schema, show, simulate

__all__ = ["app", "main", "INTERNAL_ERROR"]

#: exit code of a bug in capture-plan (not the user's input)
INTERNAL_ERROR = 3

app = typer.Typer(add_completion=False, no_args_is_help=True, rich_markup_mode=None,
                  pretty_exceptions_enable=False, context_settings={"help_option_names": ["-h", "--help"]},
                  help="Plan CUDA-graph capture: predict pool memory, choose a safe schedule, write a plan.")

_state = {"debug": False}


def _version(value: bool) -> None:
    if value:
        from schemas import __version__

        typer.echo(f"planner (capture-plan) {__version__}")
        raise typer.Exit()


@app.callback()
def _root(debug: bool = typer.Option(False, "--debug", help="Show the traceback of any error."),
          version: Optional[bool] = typer.Option(None, "--version", callback=_version, is_eager=True,
                                                 help="Print the version and exit.")) -> None:
    """Plan CUDA-graph capture for LLM serving engines."""
    _state["debug"] = debug


for module in (build, check, show, explain, diff, graph, simulate, report, schema):
    module.register(app)


def main(argv: list[str] | None = None) -> int:
    from schemas.errors import CapturePlanError

    args = sys.argv[1:] if argv is None else list(argv)
    _state["debug"] = False
    try:
        # standalone: the framework prints usage errors, help and --version itself
        typer.main.get_command(app).main(args=args, prog_name="planner", standalone_mode=True)
    except SystemExit as done:
        code = done.code
        return code if isinstance(code, int) else (0 if code is None else 1)
    except CapturePlanError as err:
        if _state["debug"]:
            raise
        print(f"planner: error: {err}", file=sys.stderr)
        return err.exit_code
    except Exception as err:  # a bug in capture-plan
        if _state["debug"]:
            raise
        text = " ".join(f"{type(err).__name__}: {err}".split())
        print(f"planner: internal error: {text[:500]} (rerun as `planner --debug ...` and report it)",
              file=sys.stderr)
        return INTERNAL_ERROR
    return 0
