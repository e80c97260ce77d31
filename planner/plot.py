"""Pool memory over the capture sequence, one plan or two overlaid: a picture for a PR.

``planner plot OLD NEW -o change.png`` (and ``planner simulate P --plot``)
draws, per graph pool, the predicted reserved bytes after each capture, with
the phases as labelled bands, batch sizes on the x-axis, the engines'-loop
baseline and an optional budget as horizontal lines, and the totals in the
title. With two plans the old one is drawn dashed under the new one, both on
the new one's capture positions (capture ``i`` of each).

Per-pool series come from the plan alone: a private pool never gives
segments back while its graphs live, and only the pool being captured into
grows, so each capture's growth of the timeline's reserved bytes (all pools
together) belongs to that capture's pool.

Output: PNG (``.png`` or any other name) or SVG (``.svg``), a fixed size
(1400 x 640 px for PNG), no timestamps or version strings in the file: the
same plans draw the same bytes with the same matplotlib. Needs matplotlib
(``pip install 'capture-plan[plot]'``), imported only when a plot is drawn.
What this does not do: draw the baseline's own timeline (the plan records
only its peak), or align two plans' captures by phase and size (by position).
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

from capture_plan.schemas.errors import InputError
from capture_plan.schemas.files import existing_output
from capture_plan.schemas.plan import Plan
from capture_plan.schemas.units import MiB

__all__ = ["plot_timeline", "plot_plans", "check_plot_path", "pool_series", "PNG_MAGIC", "SIZE_PX"]

#: the first bytes of every PNG file
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
#: the PNG's size in pixels (width, height)
SIZE_PX = (1400, 640)
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
    from .compare import bytes_text

    return bytes_text(n, n < MiB)


def _title(old: Plan | None, new: Plan) -> str:
    from .compare import change_text, total

    if old is None:
        p = new.predicted
        return (
            f"{new.name}: predicted {_mib(total(new))} "
            f"(pools {_mib(p.pool_bytes)} + hoisted {_mib(p.hoisted_bytes)}), "
            f"engines' loop {_mib(p.baseline_bytes)}"
        )
    return f"{old.name} \u2192 {new.name}: predicted total {change_text(total(old), total(new))}"


#: empty positions between two phases' captures on the x-axis
_GAP = 2


def _positions(caps: list[tuple[str, int]]) -> list[float]:
    """x of each capture: its index, plus a gap before each new phase run."""
    xs, shift = [], 0
    for i, (phase, _) in enumerate(caps):
        if i and caps[i - 1][0] != phase:
            shift += _GAP
        xs.append(i + shift)
    return xs


def plot_plans(plans: list[Plan], path: Path, *, budget_mib: float | None = None, where: str = "-o") -> None:
    """Draw one plan, or two (old, new) overlaid, to ``path`` (PNG, or SVG for
    ``.svg``), atomically; never replaces a file that is not such an image
    (:func:`check_plot_path`)."""
    check_plot_path(path, where)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.ticker import FuncFormatter
    except ImportError:
        raise InputError("matplotlib is not installed", where=where, fix="pip install 'capture-plan[plot]'") from None
    from capture_plan.schemas.files import write_atomic

    old, new = (None, plans[0]) if len(plans) == 1 else (plans[0], plans[1])
    caps = _captures(new)
    xs = _positions(caps)
    series_new = pool_series(new)
    series_old = pool_series(old) if old is not None else {}
    names = sorted(set(series_new) | set(series_old))
    colors = {n: f"C{i}" for i, n in enumerate(names)}

    # the old plan's captures at the new one's positions (capture i of each); beyond them, one apart
    def x_at(i: int) -> float:
        return xs[i] if i < len(xs) else (xs[-1] if xs else -1) + 1 + i - len(xs)

    # svg.fonttype none: text stays text (searchable, editable in a review tool), not glyph paths
    with matplotlib.rc_context(
        {"svg.hashsalt": "capture-plan", "svg.fonttype": "none", "font.size": 9, "axes.titlesize": 11}
    ):
        fig, ax = plt.subplots(figsize=(SIZE_PX[0] / _DPI, SIZE_PX[1] / _DPI), dpi=_DPI, layout="constrained")
        peak = max([new.predicted.pool_bytes] + ([old.predicted.pool_bytes] if old else []))
        top = max(peak, (budget_mib or 0) * MiB)

        def draw(plan: Plan, series: dict[str, list[int]], is_old: bool) -> None:
            n = len(next(iter(series.values()), []))
            x = [x_at(i) for i in range(n)]
            style: dict[str, Any] = dict(linestyle="--", linewidth=1.3, alpha=0.8) if is_old else dict(linewidth=2.0)
            tag = ("old " if is_old else "new ") + f"{plan.name}: " if old is not None else ""
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
                    label=f"{tag}all pools: {_mib(totals[-1] if totals else 0)}",
                )
            for name, ys in series.items():
                ax.step(
                    x,
                    [y / MiB for y in ys],
                    where="post",
                    color=colors[name],
                    zorder=3,
                    **style,
                    label=f"{tag}pool {name}: {_mib(ys[-1] if ys else 0)}",
                )

        if old is not None:
            draw(old, series_old, True)
        draw(new, series_new, False)

        # phases as bands, labelled inside at the top
        for i, (phase, first, last) in enumerate(_phase_runs(caps)):
            ax.axvspan(xs[first] - 0.5, xs[last] + 0.5, color="0.92" if i % 2 == 0 else "0.96", zorder=0, linewidth=0)
            sizes = [bs for _, bs in caps[first : last + 1]]
            ph = next((p for p in new.phases if p.name == phase), None)
            detail = f"{ph.pool} pool, {ph.strategy.order}" if ph is not None else ""
            ax.text(
                (xs[first] + xs[last]) / 2,
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

        ticks = _ticks(caps)
        ax.set_xticks([xs[t] for t in ticks], [str(caps[t][1]) for t in ticks], rotation=90, fontsize=7)
        ax.set_xlim(-0.5, max(x_at(max(len(caps), len(_captures(old)) if old else 0) - 1), 0) + 0.5)
        ax.set_xlabel(f"captures of {new.name} in order, labelled with their batch size ({len(caps)} captures)")
        if old is not None and _captures(old) != caps:
            # another order or other sizes: the old plan's batch sizes along the top
            old_caps = _captures(old)
            top_ax = ax.secondary_xaxis("top")
            old_ticks = _ticks(old_caps)
            top_ax.set_xticks(
                [x_at(t) for t in old_ticks], [str(old_caps[t][1]) for t in old_ticks], rotation=90, fontsize=7
            )
            top_ax.set_xlabel(f"captures of {old.name} (old), batch sizes", fontsize=8)
        ax.set_ylabel("graph pool reserved, MiB (predicted)")
        ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:,.0f}"))
        ax.grid(axis="y", color="0.82", linewidth=0.6)
        title = _title(old, new)
        if budget_mib is not None:
            from .compare import total

            over = total(new) - budget_mib * MiB
            title += f"; budget {budget_mib:,g} MiB: " + (f"over by {_mib(int(over))}" if over > 0 else "within")
        ax.set_title(title)
        fig.legend(loc="outside lower center", ncols=3, fontsize=8, frameon=False)
        buf = io.BytesIO()
        if _is_svg_path(path):
            fig.savefig(buf, format="svg", metadata={"Date": None, "Creator": None})
        else:
            fig.savefig(buf, format="png", metadata={"Software": None})
        plt.close(fig)
    write_atomic(path, buf.getvalue())


def plot_timeline(plan: Plan, path: Path) -> None:
    """``planner simulate P --plot``: :func:`plot_plans` of the one plan."""
    plot_plans([plan], path, where="--plot")
