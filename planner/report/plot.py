"""Pool memory over the capture sequence, one plan or two overlaid: a picture for a PR.

``planner plot OLD NEW -o change.png`` (and ``planner simulate P --plot``)
draws, per graph pool, the predicted reserved bytes after each capture, with
the phases as labelled bands, batch sizes on the x-axis, the engines'-loop
baseline and an optional budget as horizontal lines, and the totals in the
title. With two plans the old one is drawn dashed under the new one, aligned by
phase and batch size: each (phase, size) of either plan has one x position, so
a size both plans capture is at the same x in both lines and a size only one
captures is a position only its line visits (its tick label says which plan:
``bs (old)``/``bs (new)``). Each plan is labelled (``--label``, by default its
file and the commit it was last committed in) and the title says what changed
between them (the recorded inputs, as ``planner diff`` names them).

Per-pool series come from the plan alone: a private pool never gives
segments back while its graphs live, and only the pool being captured into
grows, so each capture's growth of the timeline's reserved bytes (all pools
together) belongs to that capture's pool.

Output: PNG (``.png`` or any other name) or SVG (``.svg``), a fixed size
(1400 x 640 px for PNG), no timestamps or version strings in the file: the
same plans draw the same bytes with the same matplotlib. Needs matplotlib
(``pip install 'matplotlib>=3.7'``, the ``plot`` extra), imported only when a plot is drawn.
Layout: phases in the new plan's capture order (then phases only the old one
has), each phase's sizes in the new plan's capture order for it (largest-first:
descending), a gap between phases. A line visits its plan's captures in x order,
so a plan that captures a phase in the other direction reads right to left in
time; a phase whose captures another phase's interrupt is drawn as one band.

What this does not do: draw the baseline's own timeline (the plan records
only its peak).
"""

from __future__ import annotations

import contextlib
import io
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from capture_plan.schemas.errors import InputError
from capture_plan.schemas.files import existing_output, write_atomic
from capture_plan.schemas.plan import Plan
from capture_plan.schemas.units import MiB

__all__ = [
    "plot_timeline",
    "plot_plans",
    "check_plot_path",
    "pool_series",
    "layout",
    "drawing",
    "plan_label",
    "PNG_MAGIC",
    "SIZE_PX",
    "INSTALL_MATPLOTLIB",
]

#: the first bytes of every PNG file
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
#: the PNG's size in pixels (width, height)
SIZE_PX = (1400, 640)
#: the fix of a plot without matplotlib: the dependency itself (pyproject's ``plot`` extra), from
#: the index that serves it; capture-plan is no index's package (it installs from its repository)
INSTALL_MATPLOTLIB = "pip install 'matplotlib>=3.7'"
_DPI = 100
#: at most this many batch-size labels on the x-axis (each phase's first and last always)
_MAX_TICKS = 64


def _is_svg_path(path: Path) -> bool:
    return path.suffix.lower() == ".svg"


def check_plot_path(path: Path, where: str = "--plot") -> None:
    """Refuse to replace a file that is not an image of the kind the path asks
    for (PNG, or SVG for ``.svg``): ``--plot`` given the plan's own path (or a
    spec, another plan) replaced it with an image. An existing image of that
    kind or an empty file is replaced (a re-plot); a missing path is fine. One
    that is not a regular file (a folder, a FIFO: never opened here, a FIFO
    would block) or cannot be looked at is refused before the command prints
    anything; one that cannot be read is left to write_atomic, which reports it."""
    svg = _is_svg_path(path)
    kind = "an SVG image" if svg else "a PNG image"
    fix = f"plot to a new .{'svg' if svg else 'png'} path"
    if existing_output(path, f"{where} {path}", fix) is None:
        return
    try:
        with open(path, "rb") as f:
            head = f.read(256)
    except (OSError, ValueError):
        return
    ok = head.lstrip().startswith((b"<?xml", b"<svg")) if svg else head.startswith(PNG_MAGIC)
    if head and not ok:  # an empty file loses nothing
        raise InputError(f"exists and is not {kind}; the plot would replace it", where=f"{where} {path}", fix=fix)


def pool_series(plan: Plan) -> dict[str, list[int]]:
    """Per pool, its reserved bytes after each capture of the plan (one value per
    capture, in capture order). See the module docstring for why this is exact."""
    reserved = {m.step: m.reserved for m in plan.predicted.timeline}
    captures = [s for s in plan.steps if s.op == "capture"]
    now = {p: 0 for p in sorted({s.pool for s in captures})}
    out: dict[str, list[int]] = {p: [] for p in now}
    before = 0
    for s in captures:
        now[s.pool] += reserved[s.index] - before
        before = reserved[s.index]
        for p in out:
            out[p].append(now[p])
    return out


def _captures(plan: Plan) -> list[tuple[str, int]]:
    return [(s.phase, s.bs) for s in plan.steps if s.op == "capture"]


def _phase_runs(caps: list[tuple[str, int]]) -> list[tuple[str, int, int]]:
    """(phase, first capture index, last) for each run of one phase's captures."""
    runs: list[tuple[str, int, int]] = []
    for i, (phase, _) in enumerate(caps):
        if runs and runs[-1][0] == phase and runs[-1][2] == i - 1:
            runs[-1] = (phase, runs[-1][1], i)
        else:
            runs.append((phase, i, i))
    return runs


def _ticks(caps: list[tuple[str, int]]) -> list[int]:
    """Capture positions to label with their batch size: every k-th of each phase
    run, its first and last always, at most about _MAX_TICKS."""
    step = max(1, -(-len(caps) // _MAX_TICKS))
    ticks: set[int] = set()
    for _, first, last in _phase_runs(caps):
        ticks.update(range(first, last + 1, step))
        ticks.update((first, last))
    return sorted(ticks)


def _mib(n: int) -> str:
    from .compare_text import bytes_text

    return bytes_text(n, n < MiB)


#: at most this many changed inputs in the title (then "and N more"), in lines of at most this many characters
_TITLE_CHANGES = 3
_TITLE_WIDTH = 160


def _title(old: Plan | None, new: Plan, labels: list[str]) -> tuple[str, list[str]]:
    """(the head line: labels and totals; the lines that say which inputs changed)."""
    from .compare import input_changes, total
    from .compare_text import change_text, input_text

    if old is None:
        p = new.predicted
        return (
            f"{labels[0]}: predicted {_mib(total(new))} "
            f"(pools {_mib(p.pool_bytes)} + hoisted {_mib(p.hoisted_bytes)}), "
            f"engines' loop {_mib(p.baseline_bytes)}"
        ), []
    head = f"{labels[0]} \u2192 {labels[1]}: predicted total {change_text(total(old), total(new))}"
    # the command names the output file and the options, which the other inputs name by what they change
    changes = [input_text(c) for c in input_changes(old, new) if c.label != "command"]
    if not changes:
        return head, ["no recorded input changed"]
    shown = changes[:_TITLE_CHANGES]
    more = f"; and {len(changes) - len(shown)} more (planner diff lists them)" if len(changes) > len(shown) else ""
    text = "changed: " + "; ".join(shown) + more
    return head, textwrap.wrap(text, _TITLE_WIDTH, max_lines=2, placeholder=" ...")


def plan_label(path: Path) -> str:
    """``path``, and the commit it was last committed in when git tracks it
    (``plans/fa3.json @ 1a2b3c4``; ``(modified)`` when the file differs from that commit).
    Just the path where git is missing or the file is not tracked (a base branch's plan
    written out with ``git show``: name it with ``--label``)."""
    import subprocess

    text = str(path)
    folder, name = path.parent, path.name
    try:
        git = ["git", "-C", str(folder)]
        log = git + ["log", "-1", "--format=%h", "--", name]
        commit = subprocess.run(log, capture_output=True, text=True, timeout=10, check=False).stdout.strip()
        if not commit:
            return text
        diff = git + ["diff", "--quiet", "HEAD", "--", name]
        dirty = subprocess.run(diff, capture_output=True, timeout=10, check=False).returncode != 0
    except (OSError, subprocess.SubprocessError, ValueError):
        return text
    return f"{text} @ {commit}" + (" (modified)" if dirty else "")


#: empty positions between two phases' captures on the x-axis
_GAP = 2


def layout(old: Plan | None, new: Plan) -> tuple[dict[tuple[str, int], float], list[tuple[str, list[int]]]]:
    """(x of every (phase, size) either plan captures, the phases in x order with
    their sizes): the alignment the module docstring describes."""
    plans = [new] + ([old] if old is not None else [])
    phases: dict[str, set[int]] = {}
    descending: dict[str, bool] = {}
    for plan in plans:
        for s in plan.steps:
            if s.op == "capture":
                phases.setdefault(s.phase, set()).add(s.bs)
        for ph in plan.phases:
            descending.setdefault(ph.name, ph.strategy.order == "largest-first")
    blocks = [(name, sorted(sizes, reverse=descending.get(name, False))) for name, sizes in phases.items()]
    xs: dict[tuple[str, int], float] = {}
    x = 0
    for i, (name, sizes) in enumerate(blocks):
        x += _GAP if i else 0
        for bs in sizes:
            xs[(name, bs)] = x
            x += 1
    return xs, blocks


def plot_plans(
    plans: list[Plan],
    path: Path,
    *,
    budget_mib: float | None = None,
    where: str = "-o",
    labels: list[str] | None = None,
) -> None:
    """Draw one plan, or two (old, new) overlaid and aligned by phase and size, to
    ``path`` (PNG, or SVG for ``.svg``), atomically; never replaces a file that is
    not such an image (:func:`check_plot_path`). ``labels`` name the plans in the
    legend and title (default: their names; two equal ones get "old"/"new")."""
    check_plot_path(path, where)
    with drawing(plans, budget_mib=budget_mib, where=where, labels=labels) as fig:
        buf = io.BytesIO()
        if _is_svg_path(path):
            fig.savefig(buf, format="svg", metadata={"Date": None, "Creator": None})
        else:
            fig.savefig(buf, format="png", metadata={"Software": None})
    write_atomic(path, buf.getvalue())


@contextlib.contextmanager
def drawing(
    plans: list[Plan], *, budget_mib: float | None = None, where: str = "-o", labels: list[str] | None = None
) -> Iterator[Any]:
    """The matplotlib Figure of :func:`plot_plans`, open while the ``with`` block runs
    (its style settings in force, so a save in the block writes what plot_plans writes);
    closed after it. For a caller that reads the drawing back (the tests) or saves it itself."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.ticker import FuncFormatter
    except ImportError:
        raise InputError("matplotlib is not installed", where=where, fix=INSTALL_MATPLOTLIB) from None
    old, new = (None, plans[0]) if len(plans) == 1 else (plans[0], plans[1])
    if labels is None:
        labels = [p.name for p in plans]
        if len(labels) == 2 and labels[0] == labels[1]:
            labels = [f"old {labels[0]}", f"new {labels[1]}"]
    xs, blocks = layout(old, new)
    series_new = pool_series(new)
    series_old = pool_series(old) if old is not None else {}
    names = sorted(set(series_new) | set(series_old))
    colors = {n: f"C{i}" for i, n in enumerate(names)}

    # svg.fonttype none: text stays text (searchable, editable in a review tool), not glyph paths
    with matplotlib.rc_context(
        {"svg.hashsalt": "capture-plan", "svg.fonttype": "none", "font.size": 9, "axes.titlesize": 11}
    ):
        fig, ax = plt.subplots(figsize=(SIZE_PX[0] / _DPI, SIZE_PX[1] / _DPI), dpi=_DPI, layout="constrained")
        peak = max([new.predicted.pool_bytes] + ([old.predicted.pool_bytes] if old else []))
        top = max(peak, (budget_mib or 0) * MiB)

        def draw(plan: Plan, series: dict[str, list[int]], label: str, is_old: bool) -> None:
            # each capture at its (phase, size)'s x, visited in x order
            at = sorted(range(len(_captures(plan))), key=lambda i: xs[_captures(plan)[i]])
            x = [xs[_captures(plan)[i]] for i in at]
            series = {name: [ys[i] for i in at] for name, ys in series.items()}
            style: dict[str, Any] = dict(linestyle="--", linewidth=1.3, alpha=0.8) if is_old else dict(linewidth=2.0)
            tag = f"{label}: " if old is not None else ""
            if len(series) > 1:
                # the sum under the pools, wider and grey: where one pool is all of it, both show
                totals = [sum(v) for v in zip(*series.values())]
                ax.step(
                    x,
                    [y / MiB for y in totals],
                    where="post",
                    color="0.3",
                    zorder=2,
                    **{**style, "linewidth": style["linewidth"] * 2.2, "alpha": 0.45},
                    label=f"{tag}all pools: {_mib(max(totals, default=0))}",
                )
            for name, ys in series.items():
                ax.step(
                    x,
                    [y / MiB for y in ys],
                    where="post",
                    color=colors[name],
                    zorder=3,
                    **style,
                    label=f"{tag}pool {name}: {_mib(max(ys, default=0))}",
                )

        if old is not None:
            draw(old, series_old, labels[0], True)
        draw(new, series_new, labels[-1], False)

        # phases as bands, labelled inside at the top
        for i, (phase, sizes) in enumerate(blocks):
            first, last = xs[(phase, sizes[0])], xs[(phase, sizes[-1])]
            ax.axvspan(first - 0.5, last + 0.5, color="0.92" if i % 2 == 0 else "0.96", zorder=0, linewidth=0)
            ph = next((p for p in new.phases if p.name == phase), None)
            detail = f"{ph.pool} pool, {ph.strategy.order}" if ph is not None else "old plan only"
            ax.text(
                (first + last) / 2,
                0.985,
                f"{phase}\n{len(sizes)} sizes, bs {sizes[0]}\u2192{sizes[-1]}\n{detail}",
                transform=ax.get_xaxis_transform(),
                ha="center",
                va="top",
                fontsize=8,
                color="0.2",
                linespacing=1.3,
            )

        # the engines' loop and the budget as lines; the loop's peak may be far above the plan's
        ax.set_ylim(0, top * 1.4 / MiB if top else 1)
        base = new.predicted.baseline_bytes
        ratio = base / new.predicted.pool_bytes if new.predicted.pool_bytes else 0
        if base / MiB <= ax.get_ylim()[1]:
            ax.axhline(base / MiB, color="0.4", linestyle=":", linewidth=1.6, label=f"engines' loop peak: {_mib(base)}")
        else:
            ax.plot(
                [],
                [],
                " ",
                label=f"engines' loop peak: {_mib(base)}\n({ratio:.1f}x the plan's pools; above this scale)",
            )
        if budget_mib is not None:
            ax.axhline(budget_mib, color="#c0392b", linewidth=1.6, label=f"budget: {budget_mib:,g} MiB")

        keys = list(xs)
        ticks = _ticks(keys)
        in_new, in_old = set(_captures(new)), set(_captures(old)) if old is not None else set()

        def tick(key: tuple[str, int]) -> str:
            if old is None or (key in in_new and key in in_old):
                return str(key[1])
            return f"{key[1]} (new)" if key in in_new else f"{key[1]} (old)"

        ax.set_xticks([xs[keys[t]] for t in ticks], [tick(keys[t]) for t in ticks], rotation=90, fontsize=7)
        ax.set_xlim(-0.5, max(xs.values(), default=0) + 0.5)
        if old is None:
            ax.set_xlabel(f"batch size, each phase's sizes in capture order ({len(in_new)} captures)")
        else:
            ax.set_xlabel(
                f"batch size, each phase's sizes in the new plan's capture order, both plans at the same x "
                f"for the same phase and size ({len(in_old)} captures old, {len(in_new)} new)"
            )
        ax.set_ylabel("graph pool reserved, MiB (predicted)")
        ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:,.0f}"))
        ax.grid(axis="y", color="0.82", linewidth=0.6)
        head, changed = _title(old, new, labels)
        if budget_mib is not None:
            from .compare import total

            over = total(new) - budget_mib * MiB
            head += f"; budget {budget_mib:,g} MiB: " + (f"over by {_mib(int(over))}" if over > 0 else "within")
        ax.set_title("\n".join([head] + changed))
        fig.legend(loc="outside lower center", ncols=3, fontsize=8, frameon=False)
        try:
            yield fig
        finally:
            plt.close(fig)


def plot_timeline(plan: Plan, path: Path) -> None:
    """``planner simulate P --plot``: :func:`plot_plans` of the one plan."""
    plot_plans([plan], path, where="--plot")
