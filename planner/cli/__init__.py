"""The ``planner`` command: a thin click layer over the library.

Exit codes: 0 ok; 1 bad input or drift (one line on stderr: what, where,
fix); 2 a usage error (unknown command or option, missing argument: click's
standard message and exit code); 3 an internal bug (one line; the traceback
with ``planner --debug ...``); 130 after Ctrl-C and 141 when the reader of
stdout went away (``planner show P | head``), as a shell reports SIGINT and
SIGPIPE (not click's exit 1 for both, which would read as drift).

Each command lives in its own module, imported only when that command runs
(or the top-level help lists it); command modules import the library inside
the command, so ``planner --help`` stays fast and never imports torch.

Shell completion is click's: ``eval "$(_PLANNER_COMPLETE=bash_source planner)"``
(``zsh_source``, ``fish_source``); ``--backend`` completes from
planner/data/backends.toml.
"""

from __future__ import annotations

import contextlib
import gc
import importlib
import os
import sys
from typing import NoReturn

import click

__all__ = ["app", "main", "script", "INTERNAL_ERROR", "INTERRUPTED", "BROKEN_PIPE", "COMMANDS"]

#: exit code of a bug in capture-plan (not the user's input)
INTERNAL_ERROR = 3
#: exit code after Ctrl-C (SIGINT), as a shell reports it
INTERRUPTED = 130
#: exit code when stdout's reader closed the pipe (SIGPIPE), as a shell reports it
BROKEN_PIPE = 141

#: command name -> module under capture_plan.planner.cli defining ``command``, in the order help lists them
COMMANDS = {
    name: name
    for name in (
        "build",
        "sizes",
        "check",
        "show",
        "explain",
        "diff",
        "plot",
        "graph",
        "simulate",
        "report",
        "schema",
        "spec",
        "fit",
    )
}

_state = {"debug": False}


class _Commands(click.Group):
    """Imports a command's module only when that command is asked for."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return list(COMMANDS)

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        if cmd_name not in COMMANDS:
            return None
        return importlib.import_module(f"{__name__}.{COMMANDS[cmd_name]}").command

    def resolve_command(self, ctx: click.Context, args: list[str]):
        # a mistyped command (`planner biuld`) is still click's usage error (exit 2), with the
        # commands it is nearest to
        name = args[0] if args else ""
        if name and not name.startswith("-") and name not in COMMANDS:
            import difflib

            near = difflib.get_close_matches(name, list(COMMANDS), n=3, cutoff=0.6)
            if near:
                ctx.fail(f"No such command {name!r}. Did you mean {' or '.join(map(repr, near))}?")
        return super().resolve_command(ctx, args)

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        # the top-level --help and --version print here, while the group's options
        # are parsed, before invoke: the same exit codes apply
        with _shell_exit_codes():
            return super().parse_args(ctx, args)

    def invoke(self, ctx: click.Context):
        with _shell_exit_codes():
            return super().invoke(ctx)


@contextlib.contextmanager
def _shell_exit_codes():
    """Ctrl-C and a closed stdout pipe exit as a shell reports SIGINT and SIGPIPE."""
    # click turns Ctrl-C into "Aborted!" and exit 1, which here means bad input or
    # drift: a CI script would tell the user to rebuild plans. 130 is the shell's
    # code for SIGINT. Outputs are written atomically: nothing is left half-written.
    try:
        yield
    except KeyboardInterrupt:
        click.echo("planner: interrupted", err=True)
        raise click.exceptions.Exit(INTERRUPTED) from None
    except BrokenPipeError:
        # `planner show P | head`: the reader has what it wanted. Nothing to say
        # (stderr may be the same pipe); stdout goes to /dev/null so that the
        # interpreter's final flush does not fail again.
        _silence_stdout()
        raise click.exceptions.Exit(BROKEN_PIPE) from None


def _silence_stdout() -> None:
    try:
        fd = sys.stdout.fileno()
    except (AttributeError, OSError, ValueError):  # not a real file (in-process callers, tests)
        return
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, fd)
    os.close(devnull)


def _version(ctx: click.Context, param: click.Parameter, value: bool) -> None:
    if value and not ctx.resilient_parsing:
        from capture_plan.planner.memory.core import core
        from capture_plan.schemas import __version__

        allocator = core().describe()  # compiled, or python and why (an error before any output)
        click.echo(f"planner (capture-plan) {__version__}\nallocator core: {allocator}")
        ctx.exit()


@click.group(
    "planner",
    cls=_Commands,
    no_args_is_help=True,
    context_settings={"help_option_names": ["-h", "--help"]},
    help="Plan CUDA-graph capture: predict pool memory, choose a safe schedule, write a plan.",
)
@click.option("--debug", is_flag=True, help="Show the traceback of any error.")
@click.option(
    "--version", is_flag=True, expose_value=False, is_eager=True, callback=_version, help="Print the version and exit."
)
def app(debug: bool) -> None:
    _state["debug"] = debug


def main(argv: list[str] | None = None) -> int:
    from capture_plan.schemas.errors import CapturePlanError

    args = sys.argv[1:] if argv is None else list(argv)
    _state["debug"] = False
    try:
        # standalone: click prints usage errors, help and --version itself
        app.main(args=args, prog_name="planner", standalone_mode=True)
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
        print(f"planner: internal error: {text[:500]} (rerun as `planner --debug ...` and report it)", file=sys.stderr)
        return INTERNAL_ERROR
    return 0


def script() -> NoReturn:
    """The ``planner`` console script and ``python -m capture_plan.planner``: :func:`main`
    in a process that ends with it (in-process callers use ``main``, which leaves the
    collector alone).

    ``gc.freeze()`` before and after the command: the modules, classes and functions a
    command imports live as long as the process, so the cyclic collector need not walk
    them again in each full collection, nor in the one the interpreter runs at exit. The
    command's own garbage is collected as before. For the 36-size Quickstart build this
    walking was a visible share of the process's instructions (``bench.build_bench``'s
    ``instructions`` figure, under valgrind, falls with it). What
    this gives up: a cycle still alive at the end is not collected at exit, so a file it
    holds open would not be flushed by its finalizer; the planner closes every file it
    writes (schemas/files.py writes them whole, then renames)."""
    gc.freeze()
    code = main()
    gc.freeze()
    sys.exit(code)
