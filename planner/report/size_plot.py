"""The front of ``planner sizes --plot``: padding and graph memory against the count of sizes.

One panel per phase the traffic names: the expected padding (% of step time,
log scale) of the best list of each count on the front, the graph memory of
each (the device total when calibrated, else the pool and hoisted
workspaces) on a second axis, and the spec's list, SGLang's and vLLM's
defaults and the chosen list marked at their counts. Approximate figures (a
roofline, interpolated step times) say so in the axis label.

Output as ``planner plot`` writes it (planner/report/plot.py): PNG, or SVG for
``.svg``, a fixed size, no timestamps; never over a file that is not such
an image. Needs matplotlib, imported only here.
"""

from __future__ import annotations

import io
from pathlib import Path

from capture_plan.schemas.errors import InputError
from capture_plan.schemas.files import write_atomic
from capture_plan.schemas.units import MiB

from ..sizes.pricing import Row
from ..sizes.sizes import SizesResult
from .plot import INSTALL_MATPLOTLIB, SIZE_PX, check_plot_path

__all__ = ["plot_front", "front_data", "draw_front"]

_DPI = 100
#: padding below this (in %) is drawn at it: a log scale has no 0
_FLOOR = 1e-3


def _row(r: Row) -> dict:
    return {
        "label": r.label,
        "graphs": len(r.sizes),
        "padding_pct": r.padding,
        "pool_bytes": r.pool_bytes,
        "device_bytes": r.device_bytes,
        "approximate": r.approximate,
    }


def front_data(res: SizesResult, traffic: str | None = None) -> dict:
    """What :func:`draw_front` draws, as JSON-able data: per phase, the front's lists and the
    spec's, the engines' defaults and the chosen one (count of sizes, padding, pool and device
    bytes). bench/sizes_bench.py records it; docs/generate.py draws the README's figure from it.
    ``traffic``: how the title names the traffic (default: as the user gave it)."""
    return {
        "title": f"capture sizes for {traffic or res.traffic.source} ({res.traffic.digest[:19]})",
        "phases": [
            {
                "phase": ph.phase,
                "steps": ph.steps,
                "top": ph.top,
                "front": [_row(r) for r in ph.front],
                "current": _row(ph.current),
                "defaults": [_row(r) for r in ph.defaults],
                "chosen": _row(ph.chosen),
            }
            for ph in res.phases
        ],
    }


def plot_front(res: SizesResult, path: Path, where: str = "--plot") -> None:
    """Draw ``res``'s fronts to ``path`` (see the module docstring)."""
    draw_front(front_data(res), path, where)


def _memory(r: dict) -> float:
    b = r["device_bytes"] if r["device_bytes"] is not None else r["pool_bytes"]
    return b / MiB


def draw_front(data: dict, path: Path, where: str = "--plot") -> None:
    """Draw :func:`front_data`'s ``data`` to ``path`` (see the module docstring)."""
    check_plot_path(path, where)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise InputError("matplotlib is not installed", where=where, fix=INSTALL_MATPLOTLIB) from None
    phases = data["phases"]
    calibrated = any(r["device_bytes"] is not None for ph in phases for r in ph["front"])
    memory = "device total" if calibrated else "graph pool"
    with matplotlib.rc_context(
        {"svg.hashsalt": "capture-plan", "svg.fonttype": "none", "font.size": 9, "axes.titlesize": 10}
    ):
        fig, axes = plt.subplots(
            1,
            len(phases),
            figsize=(SIZE_PX[0] / _DPI, SIZE_PX[1] / _DPI),
            dpi=_DPI,
            layout="constrained",
            squeeze=False,
        )
        for ax, ph in zip(axes[0], phases):
            front = ph["front"]
            counts = [r["graphs"] for r in front]
            ax.plot(
                counts,
                [max(r["padding_pct"], _FLOOR) for r in front],
                marker="o",
                markersize=3,
                color="C0",
                label="best list of each count: padding",
            )
            ax.set_yscale("log")
            approx = "~ " if any(r["approximate"] for r in front) else ""
            ax.set_ylabel(f"{approx}expected padding, % of step time")
            ax.set_xlabel("capture sizes (graphs)")
            ax.grid(color="0.85", linewidth=0.6)
            mem = ax.twinx()
            mem.step(counts, [_memory(r) for r in front], where="mid", color="C1", label=f"{memory}, MiB")
            mem.set_ylabel(f"{memory}, MiB ({'measured items + simulated pool' if calibrated else 'simulated'})")
            marks = [(ph["current"], "s", "0.3"), *[(d, "D", f"C{i + 2}") for i, d in enumerate(ph["defaults"])]]
            for r, shape, color in marks:
                ax.plot(
                    [r["graphs"]],
                    [max(r["padding_pct"], _FLOOR)],
                    shape,
                    color=color,
                    markersize=7,
                    label=f"{r['label']}: {r['graphs']} sizes, {r['padding_pct']:.2f}%, {_memory(r):,.0f} MiB",
                )
            c = ph["chosen"]
            ax.plot(
                [c["graphs"]],
                [max(c["padding_pct"], _FLOOR)],
                "*",
                color="#c0392b",
                markersize=14,
                label=f"chosen: {c['graphs']} sizes, {c['padding_pct']:.2f}%, {_memory(c):,.0f} MiB",
            )
            ax.set_title(f"{ph['phase']}: {ph['steps']:,.0f} steps, largest size {ph['top']}")
            lines, labels = ax.get_legend_handles_labels()
            more, more_labels = mem.get_legend_handles_labels()
            ax.legend(lines + more, labels + more_labels, fontsize=7, loc="upper center")
        fig.suptitle(data["title"])
        buf = io.BytesIO()
        if path.suffix.lower() == ".svg":
            fig.savefig(buf, format="svg", metadata={"Date": None, "Creator": None})
        else:
            fig.savefig(buf, format="png", metadata={"Software": None})
        plt.close(fig)
    write_atomic(path, buf.getvalue())
