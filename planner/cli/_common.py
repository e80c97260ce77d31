"""Small helpers shared by the command modules: the help layout, plan and report readers.

The CLI is plain click. ``Command`` adds an ``Arguments:`` section (each
positional argument with its help) before the options, and ``argument`` and
``option`` give every parameter the same metavar style (``<path>``, ``<int>``).
"""

from __future__ import annotations

import os
from pathlib import Path

import click

__all__ = ["Command", "argument", "option", "PATH", "OUTPUT", "read_plan", "read_report"]

#: a path as given (relative to the cwd); reading and its errors are the library's
PATH = click.Path(path_type=Path)


class _OutputFile(click.Path):
    """A path to write a file to. One that names a folder by its spelling
    (``plans/``, ``plans/.``, ``plans/..``) is refused here, while the spelling
    is still there: as a ``Path`` the first two would name a file ``plans``.
    ``""`` and ``.`` are left to the command (build: "names no file")."""

    def convert(self, value, param, ctx):
        if (
            isinstance(value, str)
            and value not in ("", ".")
            and (value.endswith(("/", os.sep)) or os.path.basename(value) in (".", ".."))
        ):
            from capture_plan.schemas.errors import InputError

            flag = param.opts[0] if param is not None else "output"
            folder = os.path.normpath(value)
            raise InputError(
                f"{value!r} names a folder, not a file",
                where=flag,
                fix=f"give a file name, e.g. {os.path.join(folder, 'what-if.json')}",
            )
        return super().convert(value, param, ctx)


#: a file the command writes (as given, relative to the cwd)
OUTPUT = _OutputFile(path_type=Path)


class _Argument(click.Argument):
    """A positional argument with a help text for the ``Arguments:`` section."""

    def __init__(self, decls, *, doc: str, kind: str, **kw) -> None:
        super().__init__(decls, **kw)
        self.doc, self.kind = doc, kind

    def get_error_hint(self, ctx: click.Context | None) -> str:
        # the usage line's {name} is click's metavar; errors name the argument plainly
        return repr(self.name)

    def help_row(self) -> tuple[str, str]:
        name = self.name + ("..." if self.nargs == -1 else "")
        extra = (
            "  [required]" if self.required else f"  [default: {self.default}]" if isinstance(self.default, str) else ""
        )
        return f"{name} <{self.kind}>", self.doc + extra


class Command(click.Command):
    """A command whose help lists its positional arguments, then its options."""

    def format_options(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        rows = [p.help_row() for p in self.get_params(ctx) if isinstance(p, _Argument)]
        if rows:
            with formatter.section("Arguments"):
                formatter.write_dl(rows)
        super().format_options(ctx, formatter)


def argument(name: str, doc: str, kind: str, *, required: bool = True, many: bool = False, **kw):
    """A positional argument: ``{name}`` in the usage line when required, ``[name]`` (``[name]...``) when not."""
    metavar = f"[{name}]..." if many else f"{{{name}}}" if required else f"[{name}]"
    return click.argument(
        name,
        cls=_Argument,
        doc=doc,
        kind=kind,
        required=required and not many,
        nargs=-1 if many else 1,
        metavar=metavar,
        **kw,
    )


def option(*decls: str, help: str, metavar: str | None = None, **kw):
    """An option; value options show ``<metavar>``, flags none."""
    if not kw.get("is_flag"):
        kw["metavar"] = f"<{metavar}>"
    return click.option(*decls, help=help, **kw)


def read_plan(path: Path, *, stream: bool = False):
    """The plan at ``path``; with ``stream``, also from a pipe or ``-`` (standard input)."""
    from capture_plan.schemas.codec import decode_plan
    from capture_plan.schemas.files import read_input

    return decode_plan(read_input(path, "plan", stream=stream), str(path))


def read_report(path: Path):
    from capture_plan.schemas.codec import decode_report
    from capture_plan.schemas.files import read_input

    return decode_report(read_input(path, "report"), str(path))
