"""``--plot``: reserved and allocated pool bytes per step, captures marked.

Needs matplotlib (``pip install 'capture-plan[plot]'``); imported only when a
plot is asked for.
"""

from __future__ import annotations

from pathlib import Path

from schemas.errors import InputError
from schemas.plan import Plan
from schemas.units import MiB

__all__ = ["plot_timeline"]


def plot_timeline(plan: Plan, path: Path) -> None:
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
