"""What ``planner sizes`` prints and writes: the table of each phase's front, and the spec with
the chosen sizes (``--write-spec``) that ``planner build --spec`` builds."""

from __future__ import annotations

import os
from pathlib import Path

import msgspec

from capture_plan.schemas.errors import InputError
from capture_plan.schemas.files import existing_output, write_atomic
from capture_plan.schemas.spec import Spec
from capture_plan.schemas.units import MiB

from ..inputs.build_options import BuildOptions
from ..inputs.spec_toml import spec_toml
from .pricing import Row
from .size_front import size_runs
from .sizes import SizesOptions, SizesResult

__all__ = ["render", "write_spec"]


def _rebased(spec: Spec, opts: BuildOptions, folder: Path | None) -> Spec:
    """``spec``'s paths (model config, trace), relative to the spec file, made relative to
    ``folder`` (absolute when None): for a copy of the spec written elsewhere."""
    if opts.spec is None:
        return spec
    base = opts.spec.parent

    def move(p: str) -> str:
        path = os.path.abspath(base / p)
        return path if folder is None else Path(os.path.relpath(path, os.path.abspath(folder))).as_posix()

    model = spec.model
    if isinstance(model.config, str):
        model = msgspec.structs.replace(model, config=move(model.config))
    trace = move(spec.trace) if spec.trace is not None else None
    return msgspec.structs.replace(spec, model=model, trace=trace)


def _mib(x: int | None) -> str:
    return "-" if x is None else f"{x / MiB:,.1f}"


def _line(r: Row, width: int, kv: bool) -> str:
    mark = "~" if r.approximate else " "
    cap = "-" if r.capture_seconds is None else ("~" if r.capture_approximate else " ") + f"{r.capture_seconds:.2f}"
    tokens = ("-" if r.kv_tokens is None else f"{r.kv_tokens:,}").rjust(10) + " " if kv else ""
    return (
        f"  {r.label:<{width}} {len(r.sizes):>6} {mark}{r.padding:>8.2f} {mark}{r.step_seconds * 1e3:>8.3f} "
        f"{_mib(r.pool_bytes):>9} {_mib(r.device_bytes):>10} {cap:>9} {tokens} {size_runs(r.sizes)}"
    )


def render(res: SizesResult) -> str:
    """The table ``planner sizes`` prints."""
    tr = res.traffic
    out = [
        f"traffic: {tr.source} ({tr.form}, {tr.digest[:19]}): "
        + ", ".join(f"{p} {sum(s.values()):,.0f} steps at sizes {min(s)}..{max(s)}" for p, s in tr.phases.items())
    ]
    out += [f"  note: {n}" for n in res.notes]
    out += [
        f"graph memory: {res.memory_source}",
        res.device_source,
        f"budget: {res.budget}",
        "~: approximate (a roofline, or step times interpolated between measured sizes)",
    ]
    kv = res.plan.predicted.kv
    if kv is not None and kv.kv_tokens is None:  # --engine, and what a list leaves it is not known
        out.append(f"KV tokens: left under {kv.engine}: unknown ({kv.graph})")
    elif kv is not None:  # --engine: each list's graph memory in that release's KV tokens
        out.append(f"KV tokens: left under {kv.engine} (planner fit's rule over each list's graph memory)")
    for ph in res.phases:
        width = max(12, *(len(r.label) for r in ph.defaults))
        out += [
            "",
            f"{ph.phase}: {ph.steps:,.0f} steps, largest size {ph.top}; candidates: {ph.candidates}",
            f"  step time: {ph.time_source}",
            f"  {'list':<{width}} {'graphs':>6} {'padding %':>9} {'step ms':>9} {'pool MiB':>9} {'device MiB':>10} "
            f"{'capture s':>9} {'KV tokens ' if kv is not None else ''} sizes",
        ]
        out += [_line(r, width, kv is not None) for r in ph.front]
        out += [_line(r, width, kv is not None) for r in [ph.current, *ph.defaults]]
        c = ph.chosen
        out.append(f"  chosen: {len(c.sizes)} sizes ({ph.why}): {size_runs(c.sizes)}")
        for d in ph.defaults:
            if d.padding > 0 and c.padding >= 0:
                if c.padding <= 0:
                    times = "none left"
                elif c.padding <= d.padding:
                    times = f"{d.padding / c.padding:.1f}x less"
                else:
                    times = f"{c.padding / d.padding:.1f}x more"
                out.append(
                    f"    against {d.label} ({len(d.sizes)} sizes): padding {c.padding:.2f}% vs {d.padding:.2f}% "
                    f"({times}), pool {_mib(c.pool_bytes)} vs {_mib(d.pool_bytes)} MiB"
                    + (
                        f", device {_mib(c.device_bytes)} vs {_mib(d.device_bytes)} MiB"
                        if c.device_bytes is not None
                        else ""
                    )
                )
    p = res.plan.predicted
    known = p.device.total_bytes if p.device is not None else None
    total = "unknown" if known is None else f"{known / MiB:,.1f} MiB"
    out += [
        "",
        f"plan of the chosen sizes: {sum(s.op == 'capture' for s in res.plan.steps)} captures, "
        f"pool {p.pool_bytes / MiB:,.1f} MiB (simulated), device total {total}"
        + ("" if kv is None else f", {'unknown' if kv.kv_tokens is None else f'{kv.kv_tokens:,}'} KV tokens left"),
    ]
    return "\n".join(out) + "\n"


#: the first line of every spec ``write_spec`` writes: a file that starts otherwise is not replaced
_WRITTEN = "# Capture sizes chosen by `planner sizes`"


def write_spec(res: SizesResult, opts: SizesOptions, path: Path) -> str:
    """Write the spec with the chosen sizes to ``path`` (TOML, its header saying what chose
    them and with what figures); returns the ``planner build`` command that builds it.

    The build's own options that a spec can hold go into it (``--tp``, ``--allocator``,
    ``--trace``); ``--ci`` and ``--calibration`` are in the command. Paths in it are relative
    to its own folder, so the same choice writes the same bytes from any directory. Replaces
    only a spec this function wrote before: never the spec, traffic or reports it read, nor
    any other file."""
    where = f"--write-spec {path}"
    b, given = opts.build, opts.choice
    if existing_output(path, where, "name a spec file, not a folder") is not None:
        for what, src in (("spec", b.spec), ("traffic", given.traffic), ("timing report", given.timing)):
            if src is not None and os.path.samefile(path, src):
                raise InputError(f"the output is the {what} file", where=where, fix="name another file")
        with open(path, "rb") as f:
            head = f.read(len(_WRITTEN))
        if head and head != _WRITTEN.encode():
            raise InputError(
                "exists and is not a spec planner sizes wrote; writing would replace it",
                where=where,
                fix="name a new file",
            )
    folder = path.parent

    def rel(p: Path) -> str:
        return Path(os.path.relpath(os.path.abspath(p), os.path.abspath(folder))).as_posix()

    header = [f"{_WRITTEN[2:]} for the traffic {rel(given.traffic)} ({res.traffic.digest})."]
    header += [f"note: {n}" for n in res.traffic.notes]
    for ph in res.phases:
        c = ph.chosen
        # a measured step time names its report as the user gave it: here relative to this file
        time = f"measured replay times in {rel(given.timing)}" if given.timing is not None else ph.time_source
        header.append(
            f"{ph.phase}: {len(c.sizes)} sizes, padding {'~' if c.approximate else ''}{c.padding:.2f}% of step time "
            f"({ph.why}), pool {_mib(c.pool_bytes)} MiB, device total "
            f"{'unknown' if c.device_bytes is None else _mib(c.device_bytes) + ' MiB'}; step time: {time}"
        )
    header.append(f"graph memory: {res.memory_source}")
    spec = _rebased(res.spec, b, folder)
    own = {"tp": b.tp, "allocator": b.allocator, "trace": rel(b.trace) if b.trace is not None else None}
    spec = msgspec.structs.replace(spec, **{k: v for k, v in own.items() if v is not None})
    ci = ["--ci"] if b.ci else []
    cal = ["--calibration", str(b.calibration)] if b.calibration is not None else []
    cmd = ["planner", "build", "--backend", b.backend, *ci, *cal, "--spec", str(path)]
    shown = ["--calibration", "REPORT"] if cal else []  # the header is the same bytes from any directory
    header.append(f"Build: {' '.join(['planner', 'build', '--backend', b.backend, *ci, *shown])} --spec THIS.toml")
    write_atomic(path, spec_toml(spec, header).encode("utf-8"))
    return " ".join(cmd)
