"""What a size choice records in the plan built with its sizes (``planner build --sizes auto``).

Per phase whose sizes were chosen for a traffic: its figures (``predicted.sizes``: the chosen
list against the spec's and the engines' defaults, and why each size is in) and its decisions
(``planner explain``; ``planner diff`` shows the sizes that came and went, each with its why),
written here from the :class:`~capture_plan.planner.sizes.sizes.Choice` and handed to the
pipeline ready-made (:class:`~capture_plan.planner.schedule.pipeline.SizeRecord`), which
records them as given.
"""

from __future__ import annotations

from pathlib import Path

from capture_plan.schemas.plan import Decision, ListCost, SizeChoice, SizeWorth
from capture_plan.schemas.units import mib

from ..inputs.build_options import BuildOptions, relative
from ..schedule.pipeline import SizeRecord
from ..schedule.resolve import Resolved
from .size_front import size_runs
from .sizes import Choice, PhaseChoice

__all__ = ["size_record"]


def size_record(choice: Choice, r: Resolved) -> SizeRecord:
    """``choice`` as the plan of the build ``r`` records it (paths relative to the plan's folder)."""
    opts, folder = r.opts, r.output.parent
    assert opts.sizes is not None  # a build that chose its sizes
    return SizeRecord(
        decisions=_size_decisions(opts, choice, folder),
        sizes=_size_choices(opts, choice, folder),
        traffic=relative(opts.sizes.traffic, folder),
        traffic_digest=choice.traffic.digest,
    )


def _step_time_source(opts: BuildOptions, text: str, plan_folder: Path) -> str:
    """Where step times came from, as a plan records it: a timing report by its path relative
    to the plan (the report names it as the user gave it, relative to the cwd)."""
    timing = opts.sizes.timing if opts.sizes is not None else None
    return f"measured replay times in {relative(timing, plan_folder)}" if timing is not None else text


def _size_choices(opts: BuildOptions, chosen: Choice, folder: Path) -> list[SizeChoice]:
    """The sizes chosen per phase and their figures, as the plan in ``folder`` records them
    (``predicted.sizes``)."""
    return [
        SizeChoice(
            phase=c.phase,
            steps=round(c.steps, 6),
            padding=round(c.chosen.padding, 6),
            approximate=c.chosen.approximate,
            step_time=_step_time_source(opts, c.time_source, folder),
            why=c.why,
            pool_bytes=c.worth_pool_bytes,
            device_bytes=c.worth_device_bytes,
            graph_bytes=c.worth_graph_bytes,
            kv_tokens=c.worth_kv_tokens,
            sizes=c.worth,
            against=[
                ListCost(
                    label=row.label,
                    sizes=list(row.sizes),
                    padding=round(row.padding, 6),
                    pool_bytes=row.pool_bytes,
                    device_bytes=row.device_bytes,
                    kv_tokens=row.kv_tokens,
                )
                for row in [c.current, *c.defaults]
            ],
            notes=list(chosen.traffic.notes),
        )
        for c in chosen.phases
    ]


def _added(n: int) -> str:
    """Bytes a size adds to the list's graph memory, in words (the allocator's reuse can make it
    nothing, or less than nothing)."""
    return f"it adds {mib(n)}" if n >= 0 else f"it saves {mib(-n)} (the allocator reuses its blocks)"


def _graph_memory(pool: int, device: int | None, kv: int | None = None) -> str:
    return (
        f"graph memory {mib(pool)}"
        + (f", device total {mib(device)}" if device is not None else "")
        + (f", {kv:,} KV tokens left" if kv is not None else "")
    )


def _size_cost(c: PhaseChoice, w: SizeWorth, engine: str) -> str:
    """What one size costs, in words: its pool and hoisted bytes; on a plan built for a device,
    the device memory it adds (graph-exec included: each graph's executable, which the pool's
    reuse does not make nothing); under ``--engine``, the KV tokens it takes."""
    text = _added(c.worth_pool_bytes - w.pool_bytes_without) + " of graph memory"
    if c.worth_graph_bytes is not None and w.device_bytes_without is not None:
        device = mib(c.worth_graph_bytes - w.device_bytes_without)
        text += f" (pool and hoisted), {device} on the device (graph-exec included)"
    if c.worth_kv_tokens is not None and w.kv_tokens_without is not None:  # it read "adds ..., 16 KV tokens"
        cost = w.kv_tokens_without - c.worth_kv_tokens
        text += f"; it {f'costs {cost:,}' if cost >= 0 else f'leaves {-cost:,} more'} KV tokens under {engine}"
    return text


def _size_decisions(opts: BuildOptions, chosen: Choice, folder: Path) -> list[Decision]:
    """Per phase whose sizes were chosen: the choice against the spec's list and the engines'
    defaults, then one decision per size saying why it is in (``planner explain``; ``planner diff``
    shows the sizes that came and went, each with its why)."""
    out = []
    traffic = relative(opts.sizes.traffic, folder) if opts.sizes is not None else ""
    for c in chosen.phases:
        row = c.chosen
        mark = "~" if row.approximate else ""
        against = "; ".join(
            f"{d.label} ({len(d.sizes)} sizes): padding {mark}{d.padding:.2f}%, "
            + _graph_memory(d.pool_bytes, d.device_bytes, d.kv_tokens)
            for d in [c.current, *c.defaults]
        )
        notes = "".join(f"; {n}" for n in chosen.traffic.notes)
        out.append(
            Decision(
                phase=c.phase,
                rule="sizes-auto",
                constraint=f"traffic {traffic} ({chosen.traffic.digest[:19]}): {c.steps:,.0f} steps; "
                f"largest size {c.top} always captured; budget {chosen.budget}{notes}",
                choice=f"{len(row.sizes)} sizes: {size_runs(row.sizes)}",
                why=f"{c.why}: padding {mark}{row.padding:.2f}% of step time "
                f"({_step_time_source(opts, c.time_source, folder)}), "
                f"{_graph_memory(c.worth_pool_bytes, c.worth_device_bytes, c.worth_kv_tokens)}; "
                f"against {against}",
            )
        )
        sizes = sorted(row.sizes)
        for i, w in enumerate(c.worth):
            low = sizes[i - 1] + 1 if i else 1
            runs = f"{w.steps:,.6g} steps of sizes {low}..{w.size}" if low < w.size else f"{w.steps:,.6g} steps"
            if w.padding_saved is None:
                why = "the largest size the engine schedules: always captured, so no step runs eagerly"
            else:
                why = (
                    f"without it they run the graph of {sizes[i + 1]}: padding {mark}+{w.padding_saved:.3f}% "
                    "of step time"
                )
            out.append(
                Decision(
                    phase=c.phase,
                    rule=f"sizes-auto {w.size}",
                    constraint=f"{runs} run its graph",
                    choice=f"capture {w.size}",
                    why=f"{why}; {_size_cost(c, w, chosen.kv)}",
                )
            )
    return out
