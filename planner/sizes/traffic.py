"""Traffic: how many engine steps ran at each batch size, per phase (``planner sizes --traffic``).

Three forms, told apart by their content:

* **CSV**: ``size,count`` lines, ``phase,size,count`` to name the phase, or one
  ``size`` a line (a per-step log: each line one step); an optional header naming
  ``size`` and any of ``phase`` and ``count`` in any order and case (``count,size``);
  ``#`` comments and blank lines; tab- or ``;``-separated alike (told by the first line
  that is no comment). Numbers in the ASCII digits only. A size listed on several
  lines counts the steps of all of them (logs concatenated).
* **JSON**: ``{"PHASE": {"SIZE": COUNT, ...}, ...}``.
* **Prometheus text** (a scrape of the engine's ``/metrics``): the
  histogram ``vllm:iteration_tokens_total`` (tokens per engine step; another
  with ``metric``). Its series (one per label set other than ``le``, such as
  one per engine) are added together; each bucket's count is spread evenly
  over the whole sizes in the bucket, and the traffic says so in its
  ``notes`` (approximate within a bucket: vLLM's ``custom_histogram_buckets``
  set to single sizes makes it exact). The ``+Inf`` bucket is spread up to
  the largest size the engine schedules.

Sizes in CSV and JSON count what the spec's sizes of the phase count
(requests; vLLM's phases count tokens); the histogram counts tokens, which
become ``ceil(tokens / tokens_per_request)`` requests of a phase. Counts are
whole, non-negative numbers of steps.

Refused with one located line: a malformed line or document, a negative or
fractional count, a size below 1 or above the largest the engine schedules
(``max_size``: nothing is truncated), a phase the spec does not have, a
scrape without the metric, traffic with no steps at all.

What this does not do: weigh steps by anything but their count, or read the
engine's other metrics (requests running, queue depth).
"""

from __future__ import annotations

import csv
import math
import re
from typing import TypeVar

import msgspec

from capture_plan.schemas.codec import sha256
from capture_plan.schemas.errors import InputError
from capture_plan.schemas.files import read_input
from capture_plan.schemas.limits import MAX_INT

from ..inputs.build_options import SizeChoiceOptions

__all__ = ["Traffic", "read_traffic", "DEFAULT_METRIC"]

#: vLLM's histogram of the tokens each engine step ran
DEFAULT_METRIC = "vllm:iteration_tokens_total"

_FIX = "see `planner sizes --help` for the traffic forms (size,count CSV; JSON; a Prometheus scrape)"


class Traffic(msgspec.Struct, frozen=True):
    """Steps per batch size, per phase, and how they were read."""

    #: phase -> {size: steps}; a bucket spread over its sizes gives fractions of a step
    phases: dict[str, dict[int, float]]
    #: the file as the user named it
    source: str
    #: sha256 of the file's bytes
    digest: str
    #: "csv", "json" or "prometheus"
    form: str
    #: how the counts were read, where that is not exact (buckets spread within themselves)
    notes: tuple[str, ...] = ()

    def steps(self, phase: str) -> float:
        return sum(self.phases.get(phase, {}).values())


def read_traffic(
    choice: SizeChoiceOptions, phases: dict[str, int], max_size: dict[str, int], raw: bytes | None = None
) -> Traffic:
    """The traffic file ``choice.traffic`` (see the module's docstring), read as the size-choice
    options say: ``choice.traffic_phases``, the phases traffic that names none applies to (none
    given: every phase), and ``choice.metric``, the histogram a scrape is read for (none given:
    :data:`DEFAULT_METRIC`). ``phases``: the spec's phases and their ``tokens_per_request``;
    ``max_size``: per phase, the largest size the engine schedules; ``raw``: the file's bytes
    where they are already read (else read from the path). Every error names the path."""
    path = choice.traffic
    if raw is None:
        raw = read_input(path, "traffic", fix="give the file of batch sizes the engine ran")
    source = str(path)
    default_phases = list(choice.traffic_phases) or list(phases)
    metric = DEFAULT_METRIC if choice.metric is None else choice.metric
    # the options as read: every default resolved (what the scrape's reader takes)
    choice = msgspec.structs.replace(choice, traffic_phases=tuple(default_phases), metric=metric)
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as err:
        raise InputError(f"not UTF-8 text (byte {err.start})", where=source, fix=_FIX) from None
    head = text.lstrip()
    notes: tuple[str, ...] = ()
    if head.startswith("{"):
        form, counts = "json", _json(raw, source, default_phases)
    elif _is_prometheus(text, metric):
        form = "prometheus"
        counts, notes = _prometheus(text, choice, phases, max_size)
    else:
        form, counts = "csv", _csv(text, source, default_phases)
    for phase in counts:
        if phase not in phases:
            raise InputError(
                f"phase {phase!r} is not in the spec (it has {', '.join(sorted(phases))})",
                where=source,
                fix="name the spec's phases in the traffic, or plan the spec that has this phase",
            )
    for phase, sizes in counts.items():
        top = max_size[phase]
        over = [s for s, c in sizes.items() if s > top and c > 0]
        if over:
            err = InputError(
                f"phase {phase!r}'s traffic reaches size {max(over)}, above the engine's largest size {top} "
                f"({len(over)} size(s) above it; a traffic file is never truncated)",
                where=source,
                fix=f"pass the engine's largest batch with --max-size {max(over)} (or more), "
                "or give traffic of this engine's configuration",
            )
            err.retry = {"max_size": max(over)}
            raise err
    kept = {p: dict(sorted((s, c) for s, c in sizes.items() if c > 0)) for p, sizes in sorted(counts.items())}
    kept = {p: sizes for p, sizes in kept.items() if sizes}
    if form != "prometheus" and not any(counts.values()):  # not one size: no count to be 0 (a histogram has buckets)
        raise InputError(
            "the traffic lists no batch sizes (the file is empty, or holds only a header and comments)",
            where=source,
            fix=_FIX,
        )
    if not kept:
        raise InputError("the traffic has no steps (every count is 0)", where=source, fix=_FIX)
    return Traffic(phases=kept, source=source, digest=sha256(raw), form=form, notes=notes)


def _ascii_number(value: str, what: str, where: str, fix: str) -> None:
    """Refuse what Python's ``int``/``float`` take but no counter writes: other scripts'
    digits (full-width ``１２``, Arabic-Indic), ``_`` between digits."""
    if not value.isascii() or "_" in value:
        raise InputError(f"{what} {value!r} is not a number in ASCII digits", where=where, fix=fix)


#: what a number read by each parser is, for the error of a value it refuses
_NUMBER_KIND = {int: "a whole number", float: "a number"}
_N = TypeVar("_N", int, float)


def _parsed(parse: type[_N], value: str, what: str, where: str, fix: str) -> _N:
    """``parse(value)`` (``int`` or ``float``); a value it refuses is an InputError
    ``{what} is not a whole number`` (int) or ``... not a number`` (float), ``what``
    naming the value (``count '1x'``)."""
    try:
        return parse(value)
    except ValueError:
        raise InputError(f"{what} is not {_NUMBER_KIND[parse]}", where=where, fix=fix) from None


def _count(value: str, where: str) -> int:
    """A whole, non-negative step count (``12``, ``12.0``, ``1.2e3``: Prometheus writes floats)."""
    _ascii_number(value, "count", where, "give the number of steps in the digits 0-9")
    x = _parsed(float, value, f"count {value!r}", where, "give the number of steps")
    if not math.isfinite(x) or x < 0 or x != int(x) or x > MAX_INT:
        raise InputError(
            f"count {value!r} is not a whole number of steps from 0 to 2**53",
            where=where,
            fix="counts are steps: whole and not negative",
        )
    return int(x)


def _size(value: str, where: str) -> int:
    _ascii_number(value, "size", where, "give batch sizes as 1, 2, ... in the digits 0-9")
    n = _parsed(int, value, f"size {value!r}", where, "give batch sizes as 1, 2, ...")
    if n < 1 or n > MAX_INT:
        raise InputError(f"size {n} is out of range", where=where, fix="batch sizes are 1 or more")
    return n


def _add(counts: dict[str, dict[int, float]], phase: str, size: int, n: float) -> None:
    """Add ``n`` steps at ``size``: a size listed twice (a log of several engines, or of several
    exports, concatenated) counts the steps of both lines."""
    sizes = counts.setdefault(phase, {})
    sizes[size] = sizes.get(size, 0) + n


#: the columns a CSV line may name in its header, in any order and case; ``size`` is required. Without
#: a header, one column is a size per line (each line one step), two ``size,count``, three
#: ``phase,size,count``
_COLUMNS = ("phase", "size", "count")
_HEADERLESS: dict[int, tuple[str, ...]] = {1: ("size",), 2: ("size", "count"), 3: ("phase", "size", "count")}


def _delimiter(text: str) -> str:
    """``\t`` for tab-separated values (a spreadsheet's export), ``;`` for a semicolon-separated
    one (a spreadsheet in a locale whose decimal mark is the comma), else ``,``: told by the
    first line that is no comment."""
    first = next((line for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")), "")
    if "," in first:
        return ","
    return "\t" if "\t" in first else ";" if ";" in first else ","


def _header(cells: list[str], where: str) -> tuple[str, ...]:
    """The columns a header names (``size`` and any of ``phase`` and ``count``, each once, in any
    order and case)."""
    names = tuple(c.lower() for c in cells)
    if "size" not in names or len(set(names)) != len(names) or not set(names) <= set(_COLUMNS):
        raise InputError(
            f"expected a header naming size and any of phase and count (each once, in any order), or numbers; "
            f"got {','.join(cells)!r}",
            where=where,
            fix=_FIX,
        )
    return names


def _csv(text: str, source: str, default_phases: list[str]) -> dict[str, dict[int, float]]:
    counts: dict[str, dict[int, float]] = {}
    columns: tuple[str, ...] | None = None
    for lineno, row in enumerate(csv.reader(text.splitlines(), delimiter=_delimiter(text)), 1):
        where = f"{source}:{lineno}"
        cells = [c.strip() for c in row]
        if not cells or all(not c for c in cells) or cells[0].startswith("#"):
            continue
        if columns is None and not cells[0].isdigit():
            columns = _header(cells, where)  # a header in any case (a spreadsheet's Size,Count)
            continue
        if columns is None:
            if len(cells) not in _HEADERLESS:
                raise InputError(
                    f"expected 1 to 3 columns, got {len(cells)}",
                    where=where,
                    fix="write size (one step a line), size,count or phase,size,count on every line",
                )
            columns = _HEADERLESS[len(cells)]
        if len(cells) != len(columns):
            raise InputError(
                f"expected {len(columns)} columns, got {len(cells)}",
                where=where,
                fix=f"write {','.join(columns)} on every line",
            )
        row_of: dict[str, str] = {name: cell for name, cell in zip(columns, cells, strict=True)}
        s = _size(row_of["size"], where)
        c = _count(row_of["count"], where) if "count" in row_of else 1
        for phase in [row_of["phase"]] if "phase" in row_of else default_phases:
            _add(counts, phase, s, c)
    return counts


def _json(raw: bytes, source: str, default_phases: list[str]) -> dict[str, dict[int, float]]:
    try:
        doc = msgspec.json.decode(raw, type=dict[str, dict[str, object]])
    except msgspec.ValidationError as err:
        raise InputError(
            f"not a traffic document: {err}", where=source, fix='write {"PHASE": {"SIZE": COUNT}}'
        ) from None
    except msgspec.DecodeError as err:
        raise InputError(f"not valid JSON: {err}", where=source, fix='write {"PHASE": {"SIZE": COUNT}}') from None
    counts: dict[str, dict[int, float]] = {}
    for phase, sizes in doc.items():
        for size, n in sizes.items():
            where = f"{source}: $.{phase}[{size!r}]"
            if isinstance(n, bool) or not isinstance(n, (int, float)):
                raise InputError(f"count {n!r} is not a number", where=where, fix="give the number of steps")
            _add(counts, phase, _size(size, where), _count(repr(n), where))
    return counts


# one sample line of the text format: name{labels} value [timestamp]
_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{(.*)\})?\s+(\S+)(\s+-?\d+)?\s*$")
_LABEL = re.compile(r'\s*([a-zA-Z_][a-zA-Z0-9_]*)\s*=\s*"((?:[^"\\]|\\.)*)"\s*(,|$)')


def _is_prometheus(text: str, metric: str) -> bool:
    """A scrape: a ``# HELP``/``# TYPE`` line, or a sample line (``name{...} value``, its value a
    number). A CSV line has commas between its cells, and a tab-separated one tabs: an
    exporter writes spaces (``size<TAB>count`` read as a sample named size was a scrape
    without the histogram)."""

    def sample(line: str) -> bool:
        m = _SAMPLE.match(line)
        if m is None or "\t" in line:
            return False
        try:
            float(m.group(4))
        except ValueError:
            return False
        return True

    return any(line.startswith(("# HELP ", "# TYPE ", metric)) or sample(line) for line in text.splitlines())


def _labels(body: str, where: str) -> dict[str, str]:
    out, pos = {}, 0
    while pos < len(body):
        m = _LABEL.match(body, pos)
        if m is None:
            raise InputError(
                f"cannot read the labels {{{body}}}", where=where, fix="give the scrape as the engine wrote it"
            )
        out[m.group(1)] = m.group(2)
        pos = m.end()
    return out


def _prometheus(
    text: str, choice: SizeChoiceOptions, phases: dict[str, int], max_size: dict[str, int]
) -> tuple[dict[str, dict[int, float]], tuple[str, ...]]:
    """The histogram ``choice.metric``'s buckets, added over its series and spread within each
    bucket over ``choice.traffic_phases`` (``choice``: as :func:`read_traffic` resolved it)."""
    source, default_phases = str(choice.traffic), list(choice.traffic_phases)
    assert choice.metric is not None, "read_traffic resolves it"
    metric = choice.metric
    name = metric + "_bucket"
    series: dict[tuple, dict[float, tuple[int, str]]] = {}
    histograms: set[str] = set()
    for lineno, line in enumerate(text.splitlines(), 1):
        if not line.strip() or line.startswith("#"):
            if line.startswith("# TYPE ") and line.split()[-1] == "histogram":
                histograms.add(line.split()[2])
            continue
        m = _SAMPLE.match(line)
        where = f"{source}:{lineno}"
        if m is None:
            if line.startswith(name):
                raise InputError(
                    "cannot read this sample line", where=where, fix="give the scrape as the engine wrote it"
                )
            continue
        if m.group(1) != name:
            continue
        labels = _labels(m.group(3) or "", where)
        le = labels.pop("le", None)
        if le is None:
            raise InputError(f"a bucket of {metric} without its le label", where=where, fix="give the whole scrape")
        bound = _parsed(float, le, f"bucket bound le={le!r}", where, "give the whole scrape")
        key = tuple(sorted(labels.items()))
        buckets = series.setdefault(key, {})
        if bound in buckets:
            raise InputError(f"bucket le={le} listed twice in one series", where=where, fix="give one scrape, not two")
        buckets[bound] = (_count(m.group(4), where), where)
    if not series:
        found = ", ".join(sorted(histograms)) or "none"
        raise InputError(
            f"the scrape has no histogram {metric} (histograms in it: {found})",
            where=source,
            fix=f"scrape the engine's /metrics (vLLM exports {DEFAULT_METRIC}), or name the metric with --metric",
        )
    tokens: dict[int, float] = {}
    bounds: list[float] = []
    for buckets in series.values():
        prev_bound, prev = 0.0, 0
        for bound in sorted(buckets):
            total, where = buckets[bound]
            if total < prev:
                raise InputError(
                    f"bucket le={bound:g} counts {total}, fewer than the bucket before it ({prev}): "
                    "the buckets of a histogram are cumulative",
                    where=where,
                    fix="give the scrape as the engine wrote it",
                )
            n, prev = total - prev, total
            lo = math.floor(prev_bound) + 1
            if math.isinf(bound):
                hi = max(max_size[p] * phases[p] for p in default_phases)
            else:
                hi = math.floor(bound)
            if n and hi < lo:
                top = "the engine's largest size (--max-size)" if math.isinf(bound) else f"le={bound:g}"
                raise InputError(
                    f"{n} step(s) lie above {prev_bound:g} tokens and at most {top}: no whole size is left there",
                    where=where,
                    fix="pass the engine's largest batch with --max-size, or give the scrape of this configuration",
                )
            for size in range(lo, hi + 1) if n else ():
                tokens[size] = tokens.get(size, 0.0) + n / (hi - lo + 1)
            prev_bound = bound
            bounds.append(bound)
    finite = sorted({b for b in bounds if math.isfinite(b)})
    single = all(b == int(b) and (i == 0 or b - finite[i - 1] == 1) for i, b in enumerate(finite))
    notes = ()
    if not single:
        notes = (
            f"{metric}: {len(series)} series added, {len(finite) + 1} buckets; each bucket's steps spread "
            "evenly over its sizes (approximate within a bucket: set vLLM's custom_histogram_buckets to "
            "single sizes for exact counts)",
        )
    counts: dict[str, dict[int, float]] = {}
    for phase in default_phases:
        tpr = phases[phase]
        own: dict[int, float] = {}
        for t, n in tokens.items():
            own[-(-t // tpr)] = own.get(-(-t // tpr), 0.0) + n
        counts[phase] = own
    return counts, notes
