"""A plan's graph memory priced in KV tokens: what a set of capture sizes leaves the KV cache of
one engine release on one device (``planner build``/``planner sizes`` ``--engine``,
``--min-kv-tokens``; ``planner diff --fail-above-kv-tokens`` compares what builds recorded).

Nothing is re-derived here: :func:`.fit.fit` is run whole with the plan's graph figure (its
device total, or the device items it knows) as fit's measured graph figure in place of fit's
own estimate, so the release's rule decides what graph memory costs: deducted from the budget
before capture (vLLM 0.33's profile_cudagraph_memory), only logged (the releases before it),
taken from free memory after capture (0.34's extensible KV cache), or nothing but the slack it
must fit in (SGLang's static fraction). The engine's settings are its own flags, as ``planner
fit`` takes them (planner/data/fit_flags.toml), given as ``--engine-flag NAME=VALUE``.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable
from pathlib import Path

import msgspec

from capture_plan.schemas.errors import ConstraintError, InputError
from capture_plan.schemas.fit import FitItem, FitResult
from capture_plan.schemas.plan import KvCost

from .fit import fit
from .flags import EngineFlag, changes_of, engine_flags, flags_of
from .inputs import FitRequest, resolve
from .model import FitModel, from_dimensions, load_model
from .refusal import INPUTS, Refusal
from .result import NO_FIX
from .tables import rule_for

__all__ = ["KvPricer", "parse_engine_flags", "spec_model", "changed_flags", "CAPTURE_FLAGS"]

#: the engine flags that say what is captured: a plan's sizes say it instead
CAPTURE_FLAGS = ("cudagraph-capture-sizes", "max-cudagraph-capture-size", "enforce-eager", "cudagraph-mode")

_BOOLS = {"true": True, "1": True, "on": True, "false": False, "0": False, "off": False}


def parse_engine_flags(engine: str, items: tuple[str, ...] | list[str]) -> dict:
    """``--engine-flag NAME=VALUE`` items as fit's flags (NAME the engine's own flag, its value
    read by the row's type; the row's bounds are checked by fit). An item not ``NAME=VALUE``, a
    flag the engine lacks or given twice, one of :data:`CAPTURE_FLAGS`, or a value not of the
    row's type is a :class:`.refusal.Refusal` naming the item, its change the item that works
    (or none: left out)."""
    eng = rule_for(engine)[0]
    rows, allowed = engine_flags(), flags_of(eng)
    out: dict = {}
    for item in items:
        name, sep, text = item.partition("=")
        name = name.strip().removeprefix("--")
        where = f"--engine-flag {item}"
        same = rows[name].same_as if name in rows else ""
        if sep and name not in allowed and same in allowed:  # the other engine's flag of the same meaning
            hint = f"{eng}'s flag for it is {same}"
            raise Refusal(f"{eng} has no flag {name!r}", where=where, hint=hint, changes={name: None, same: text})
        if not sep or name not in allowed:
            takes = ", ".join(a for a in allowed if a not in CAPTURE_FLAGS)
            raise Refusal(
                f"{eng} has no flag {name!r}" if sep else "is not NAME=VALUE",
                where=where,
                hint=f"{eng}'s flags as NAME=VALUE (one of: {takes})",
                # a flag named without its value: the row's example; else the item left out
                changes={name: _example(rows[name]) if name in allowed and name not in CAPTURE_FLAGS else None},
            )
        if name in CAPTURE_FLAGS:
            raise Refusal(
                f"{name} says what the engine captures, and the plan's sizes say it here",
                where=where,
                hint="leave it out: the plan's capture sizes are priced",
                changes={name: None},
            )
        row, text = rows[name], text.strip()
        try:
            value: object = {"int": int, "float": float}[row.type](text) if row.type in ("int", "float") else text
        except ValueError:
            raise Refusal(
                f"{name} takes {'an integer' if row.type == 'int' else 'a number'}, got {text!r:.30}",
                where=where,
                hint="a value it takes",
                changes={name: _example(row)},
            ) from None
        if row.type == "bool":
            if text.lower() not in _BOOLS:
                raise Refusal(
                    f"{name} takes true or false, got {text!r:.30}", where=where, hint="true", changes={name: True}
                )
            value = _BOOLS[text.lower()]
        if name in out:
            raise Refusal(
                f"{name} is given twice (--engine-flag {name}={out[name]} and --engine-flag {name}={value})",
                where=where,
                hint="keep the last",
                changes={name: value},
            )
        out[name] = value
    return out


def _example(row: EngineFlag) -> object:
    """A value of ``row``'s type it takes: its example, else its first choice, else its lower bound."""
    if row.type == "bool":
        return True
    return row.example or (row.choices[0] if row.choices else int(row.lo))


def spec_model(name: str, dimensions: dict[str, int], config: Path | None) -> FitModel:
    """The build's model as fit reads it: its config.json where the spec names one (layer
    types, MLA, quantization and max_position_embeddings from it), else the spec's dimensions
    (full attention in the dtype the spec says; no context length: the engine's max-model-len
    must then be given)."""
    if config is not None:
        return load_model(str(config))
    return from_dimensions(name, dimensions, "preset", f"the spec's model {name} (its dimensions)")


class KvPricer:
    """KV tokens one engine release leaves on one device for a graph figure (bytes), by
    :func:`.fit.fit` of ``request`` (the build's, made once by planner/schedule/kv.py) with
    that figure as the measured graph memory, memoized. The settings are
    checked once, when it is made: a refusal names the build option to change, its fix the
    build's command with the change (``command``: a fit refusal's changes -> that command line,
    planner/schedule/kv.py's). A plan whose engine would not start is refused by
    :meth:`check_plan`, with the plan's graphs (fit's fixes then leave room for them)."""

    def __init__(self, request: FitRequest, command: Callable[[dict[str, object]], str] | None = None) -> None:
        self.request, self.command = request, command
        none = self.result(0, ())  # capturing nothing: refuses a setting fit refuses
        # a context length past the model's, let through by the engine's variable: the label says so
        allowed = resolve(request).context.allowed_by
        flags, tp = request.flags, request.tp
        self.label = (
            f"{none.engine}=={none.version} on {none.device}"
            + (f" x{tp}" if tp > 1 else "")
            + (f" ({', '.join(f'{k}={v}' for k, v in sorted(flags.items()))})" if flags else "")
            + (f" under {allowed}=1" if allowed else "")
        )
        self.none_tokens = none.kv_tokens or 0
        graph = next(i for i in self.result(0).items if i.name == "graph memory")
        #: why fit leaves the graph memory unknown whatever the plan's figure ("": it takes the
        #: figure, with the draft's graphs beside it where fit models them): the engine captures
        #: graphs the plan's do not hold (a speculative draft's fit does not model, or a plan's
        #: own speculative phases uncalibrated). The KV tokens are then unknown (:meth:`tokens`),
        #: never those of the plan's graphs with the draft's as 0.
        self.unpriced = graph.source if graph.bytes is None else ""

    @property
    def engine(self) -> str:
        """The release as the build names it (``ENGINE==VERSION``)."""
        return self.request.engine

    @functools.lru_cache(maxsize=4096)  # noqa: B019 (one pricer per build: its cache lives as long)
    def result(self, graph_bytes: int, sizes: tuple[int, ...] | None = None) -> FitResult:
        """fit with ``graph_bytes`` as the graph figure, of the capture ``sizes`` (every phase's;
        () no graphs; None the engine default's: FitRequest.figure_sizes)."""
        item = FitItem("graph memory", graph_bytes, 0, "measured", "the plan's graph memory")
        try:
            return fit(msgspec.structs.replace(self.request, measured_graph=item, figure_sizes=sizes))
        except InputError as err:
            raise _as_build_error(err, self.request.flags, self.command) from err  # its cause: fit's refusal

    def tokens(self, graph_bytes: int, sizes: tuple[int, ...] | None = None) -> int | None:
        """The KV tokens left with ``graph_bytes`` of graph memory, of the capture ``sizes``
        (:meth:`result`); 0 where the engine would not start (fit's verdict: fewer than one
        request, or graphs over SGLang's slack); None where the graph memory is unknown whatever
        the plan's (:attr:`unpriced`)."""
        if self.unpriced:
            return None
        res = self.result(graph_bytes, sizes)
        return (res.kv_tokens or 0) if res.fits else 0

    def why_not(self, graph_bytes: int, sizes: tuple[int, ...] | None = None) -> str:
        """fit's one line where ``graph_bytes`` of ``sizes`` does not fit ("" where it does)."""
        return self.result(graph_bytes, sizes).overflow

    def not_starting(self, res: FitResult, what: str) -> ConstraintError:
        """The build refused where the engine would not start (``res``, fit's verdict), ``what``
        saying with which graphs: its fix is fit's first fix (each one checked by fit to fit
        with those graphs) as the build's command, the others named besides."""
        if what and not self.result(0).fits:
            what += " (nor without graphs)"
        err = ConstraintError(
            f"{self.label} would not start {what}: {res.overflow}", where=f"--engine {self.engine}", fix=NO_FIX
        )
        if res.fixes:
            first, *more = (_spelled(f) or f for f in res.fixes)
            shown = f"`{self.command(changes_of(res.fixes[0]))}`" if self.command is not None else first
            err.fix = f"{first}: {shown}" + (f" (or {' or '.join(more)})" if more else "")
        return err

    @staticmethod
    def sizes_of(groups) -> tuple[int, ...]:
        """Every capture size of ``groups`` (each phase's list), sorted, once: the sizes a
        plan's graph figure is of, as :meth:`result` takes them."""
        return tuple(sorted({s for g in groups for s in g}))

    def plan_sizes(self, plan) -> tuple[int, ...]:
        """Every phase's capture sizes of ``plan`` (a Plan)."""
        return self.sizes_of(p.sizes for p in plan.phases)

    def check_plan(self, kv: KvCost | None, sizes: tuple[int, ...] | None = None) -> None:
        """Refuse (:meth:`not_starting`) a plan whose graphs (``kv``: what its build recorded of
        them, planner/schedule/kv.py ``kv_cost``; ``sizes``: every phase's capture sizes, as
        :meth:`result` takes them) leave the engine unable to start, or, where its graph memory
        is unknown, one whose engine would not start even without graphs."""
        if kv is None:
            return
        if kv.graph_bytes is None:
            if not (none := self.result(0)).fits:
                raise self.not_starting(none, "even without graphs")
        elif kv.overflow:
            graphs = f"with the plan's graphs ({kv.graph_bytes / (1 << 20):,.1f} MiB, {kv.graph})"
            raise self.not_starting(self.result(kv.graph_bytes, sizes), graphs)


def _names(switches: bool) -> str:
    """The engine flags' names as a pattern: the switches (bool rows) or the flags with a value."""
    rows = engine_flags()
    names = (n for n in rows if (rows[n].type == "bool") is switches)
    return "|".join(re.escape(n) for n in sorted(names, key=len, reverse=True))


def _spelled(text: str | None) -> str | None:
    """fit's ``--flag value`` as a build's ``--engine-flag flag=value`` (a switch:
    ``--engine-flag flag=true``); a flag with a value named alone as its name."""
    if text is None:
        return None
    text = re.sub(rf"--({_names(True)})(?![\w=-])", r"--engine-flag \1=true", text)
    names = _names(False)
    text = re.sub(rf"--({names}) ([^\s,;`]+)", r"--engine-flag \1=\2", text)
    return re.sub(rf"--({names})(?![\w=-])", r"\1", text)


def _as_build_error(err: InputError, flags: dict, command: Callable[[dict[str, object]], str] | None) -> InputError:
    """fit's refusal as a build option's: ``--max-model-len 8192`` is ``--engine-flag
    max-model-len=8192`` in a build (a flag named alone, where it was given: with its value);
    a :class:`.refusal.Refusal`'s fix is the build's command with its change."""
    name = (err.where or "").removeprefix("--")
    if name in flags and name in engine_flags():
        where = f"--engine-flag {name}={flags[name]}"
    else:
        where = "the spec's model" if err.where == "--model" else _spelled(err.where)
    if isinstance(err, Refusal) and command is not None:
        return InputError(err.what, where=where, fix=f"{_spelled(err.hint)}: `{command(err.changes)}`")
    return InputError(err.what, where=where, fix=_spelled(err.fix))


def changed_flags(items: tuple[str, ...], engine: str, changes: dict[str, object]) -> tuple[str, tuple[str, ...]]:
    """A build's ``--engine`` and ``--engine-flag NAME=VALUE`` items with a fit refusal's
    ``changes`` applied: a flag it names replaced (None: left out), a new engine keeping only
    the flags it has."""

    def name(item: str) -> str:
        return item.partition("=")[0].strip().removeprefix("--")

    def text(v: object) -> str:
        return "true" if v is True else ",".join(map(str, v)) if isinstance(v, (list, tuple)) else str(v)

    out = [i for i in items if name(i) not in changes]
    out += [f"{k}={text(v)}" for k, v in changes.items() if k not in INPUTS and v is not None]
    engine = str(changes.get("engine", engine))
    if "engine" in changes:
        have = set(flags_of(engine.split("==")[0].strip().lower()))
        out = [i for i in out if name(i) in have]
    return engine, tuple(out)
