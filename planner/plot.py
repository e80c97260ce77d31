"""``--plot``: reserved and allocated pool bytes per step, captures marked.

Needs matplotlib (``pip install 'capture-plan[plot]'``); imported only when a
plot is asked for.
"""

from __future__ import annotations

from pathlib import Path

from schemas.errors import InputError
from schemas.files import existing_output
from schemas.plan import Plan
from schemas.units import MiB

__all__ = ["plot_timeline", "check_plot_path"]


#: the first bytes of every PNG file
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def check_plot_path(path: Path) -> None:
    """Refuse to replace a file that is not a PNG: ``--plot`` given the plan's
    own path (or a spec, another plan) replaced it with an image. An existing
    PNG or an empty file is replaced (a re-plot); a missing path is fine. One
    that is not a regular file (a folder, a FIFO: never opened here, a FIFO
    would block) is refused by write_atomic's own check, but before the
    command prints anything; one that cannot be stat'ed or read is left to
    write_atomic, which reports it."""
    try:
        if existing_output(path, f"--plot {path}", "plot to a new .png path") is None:
            return
        with open(path, "rb") as f:
            head = f.read(len(PNG_MAGIC))
    except (OSError, ValueError):
        return
    if head and head != PNG_MAGIC:  # an empty file loses nothing
        raise InputError("exists and is not a PNG image; the plot would replace it", where=f"--plot {path}",
                         fix="plot to a new .png path")


def plot_timeline(plan: Plan, path: Path) -> None:
    """Draw the plan's predicted timeline to the PNG ``path`` (atomically).
    Never replaces a file that is not a PNG (see :func:`check_plot_path`)."""
    check_plot_path(path)
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise InputError("matplotlib is not installed", where="--plot",
                         fix="pip install 'capture-plan[plot]'") from None
    from schemas.files import write_atomic
    import io

    tl = plan.predicted.timeline
    x = [m.step for m in tl]
    fig, ax = plt.subplots(figsize=(10, 4), dpi=100)
    ax.step(x, [m.reserved / MiB for m in tl], where="post", label="reserved")
    ax.step(x, [m.allocated / MiB for m in tl], where="post", label="allocated")
    caps = [s.index for s in plan.steps if s.op == "capture"]
    ax.vlines(caps, 0, plan.predicted.pool_bytes / MiB, colors="0.85", linewidth=0.5, zorder=0, label="capture")
    ax.set_xlabel("step")
    ax.set_ylabel("graph pool MiB (predicted)")
    ax.set_title(f"{plan.name}: peak {plan.predicted.pool_bytes / MiB:,.0f} MiB")
    ax.legend(loc="upper left")
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", metadata={"Software": None})
    plt.close(fig)
    write_atomic(path, buf.getvalue())
