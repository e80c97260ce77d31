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
from pathlib import Path

from capture_plan.schemas.errors import InputError
from capture_plan.schemas.fit import FitItem, FitResult

from .fit import fit
from .flags import engine_flags, flags_of
from .model import FitModel, from_dimensions, load_model
from .tables import rule_for

__all__ = ["KvPricer", "parse_engine_flags", "spec_model", "CAPTURE_FLAGS"]

#: the engine flags that say what is captured: a plan's sizes say it instead
CAPTURE_FLAGS = ("cudagraph-capture-sizes", "max-cudagraph-capture-size", "enforce-eager", "cudagraph-mode")

_BOOLS = {"true": True, "1": True, "on": True, "false": False, "0": False, "off": False}


def parse_engine_flags(engine: str, items: tuple[str, ...] | list[str]) -> dict:
    """``--engine-flag NAME=VALUE`` items as fit's flags (NAME the engine's own flag, its value
    read by the row's type; the row's bounds are checked by fit). An item not ``NAME=VALUE``, a
    flag the engine lacks or given twice, one of :data:`CAPTURE_FLAGS`, or a value not of the
    row's type is refused naming the item."""
    eng = rule_for(engine)[0]
    rows, allowed = engine_flags(), flags_of(eng)
    # the fix's example: a flag the engine takes here, with a value its row gives as an example
    shown = next((a for a in allowed if a not in CAPTURE_FLAGS and rows[a].example), allowed[0])
    out: dict = {}
    for item in items:
        name, sep, text = item.partition("=")
        name = name.strip().removeprefix("--")
        where = f"--engine-flag {item}"
        if not sep or name not in allowed:
            raise InputError(
                f"{eng} has no flag {name!r}" if sep else "is not NAME=VALUE",
                where=where,
                fix=f"give one of {eng}'s flags as NAME=VALUE, e.g. --engine-flag {shown}="
                f"{rows[shown].example or 1} (one of: {', '.join(a for a in allowed if a not in CAPTURE_FLAGS)})",
            )
        if name in CAPTURE_FLAGS:
            raise InputError(
                f"{name} says what the engine captures, and the plan's sizes say it here",
                where=where,
                fix="leave it out: the plan's capture sizes are priced",
            )
        row, text = rows[name], text.strip()
        try:
            value: object = {"int": int, "float": float}[row.type](text) if row.type in ("int", "float") else text
        except ValueError:
            raise InputError(
                f"{name} takes {'an integer' if row.type == 'int' else 'a number'}, got {text!r:.30}",
                where=where,
                fix=f"e.g. --engine-flag {name}={row.example or 1}",
            ) from None
        if row.type == "bool":
            if text.lower() not in _BOOLS:
                raise InputError(f"{name} takes true or false, got {text!r:.30}", where=where, fix=f"{name}=true")
            value = _BOOLS[text.lower()]
        if name in out:
            raise InputError(
                f"{name} is given twice",
                where=where,
                fix=f"keep one of --engine-flag {name}={out[name]} and --engine-flag {name}={value}",
            )
        out[name] = value
    return out


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
    :func:`.fit.fit` with that figure as the measured graph memory, memoized. The settings are
    checked once, when it is made: a refusal names the build option to change."""

    def __init__(self, model: FitModel, device: str, engine: str, tp: int, flags: dict) -> None:
        self.model, self.device, self.engine, self.tp, self.flags = model, device, engine, tp, flags
        none = self.result(0)  # capturing nothing: refuses a setting fit refuses
        self.label = (
            f"{none.engine}=={none.version} on {none.device}"
            + (f" x{tp}" if tp > 1 else "")
            + (f" ({', '.join(f'{k}={v}' for k, v in sorted(flags.items()))})" if flags else "")
        )
        self.none_tokens = none.kv_tokens or 0

    @functools.lru_cache(maxsize=4096)  # noqa: B019 (one pricer per build: its cache lives as long)
    def result(self, graph_bytes: int) -> FitResult:
        item = FitItem("graph memory", graph_bytes, 0, "measured", "the plan's graph memory")
        try:
            return fit(self.model, self.device, self.engine, self.tp, dict(self.flags), item)
        except InputError as err:
            raise _as_build_error(err, self.flags) from None

    def tokens(self, graph_bytes: int) -> int:
        """The KV tokens left with ``graph_bytes`` of graph memory; 0 where the engine would not
        start (fit's verdict: fewer than one request, or graphs over SGLang's slack)."""
        res = self.result(graph_bytes)
        return (res.kv_tokens or 0) if res.fits else 0

    def why_not(self, graph_bytes: int) -> str:
        """fit's one line where ``graph_bytes`` does not fit ("" where it does)."""
        return self.result(graph_bytes).overflow


def _as_build_error(err: InputError, flags: dict) -> InputError:
    """fit's refusal as a build option's: ``--max-model-len 8192`` is ``--engine-flag
    max-model-len=8192`` in a build (a flag named alone: its value given, else an example)."""
    rows = engine_flags()
    names = "|".join(re.escape(n) for n in sorted(rows, key=len, reverse=True))

    def alone(m: re.Match) -> str:
        name = m.group(1)
        value = flags.get(name, rows[name].example or ("8192" if rows[name].type == "int" else "VALUE"))
        return f"--engine-flag {name}={value}"

    def spelled(text: str | None) -> str | None:
        if text is None:
            return None
        text = re.sub(rf"--({names}) ([^\s,;]+)", r"--engine-flag \1=\2", text)
        return re.sub(rf"--({names})(?![\w=-])", alone, text)

    where = "the spec's model" if err.where == "--model" else spelled(err.where)
    return InputError(err.what, where=where, fix=spelled(err.fix))
