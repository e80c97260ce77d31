"""A step's outputs as the capture loop holds them: the tensors of whatever structure the
engine's forward returned, and how many rows of each belong to one request.

:func:`flatten` walks tuples, lists, dicts, named tuples and dataclasses down to their
tensors (None allowed) and returns a function that rebuilds the structure around
replacements (the held tensors, or non-owning views of them); :func:`rows_per_request`
says how :meth:`capture_plan.executor.graphs.GraphSet.replay` slices each. Each error is
an :class:`~capture_plan.executor.errors.ExecutorError` naming the step (``where``).
"""

from __future__ import annotations

import copy
import dataclasses

import torch

from .errors import ExecutorError

__all__ = ["flatten", "rows_per_request"]


def _walk(x, path: str, where: str, device: torch.device, leaves: list):
    """Append the tensors of ``x`` to ``leaves``; return a function that rebuilds ``x``.

    A module-level function, not a closure over ``leaves``: a recursive nested
    function is a reference cycle that would keep the engine's outputs alive
    until the next collection (and the collector is frozen while capturing),
    so "view" outputs would not be reused by the next capture. The rebuilders
    hold types and leaf indices, never the engine's tensors."""
    if isinstance(x, torch.Tensor):
        if x.device.type != device.type:
            raise ExecutorError(
                f"output {path} is on {x.device}, not {device}: a replay never writes it",
                where=where,
                fix="return the tensors the graph computes on the device",
            )
        leaves.append(x)
        i = len(leaves) - 1
        return lambda held: held[i]
    if x is None:
        return lambda held: None
    kind = type(x)
    if isinstance(x, tuple) and hasattr(x, "_fields"):  # a named tuple
        fields = x._fields  # pyright: ignore[reportAttributeAccessIssue]  # hasattr above
        parts = [_walk(v, f"{path}.{k}", where, device, leaves) for k, v in zip(fields, x)]
        return lambda held: kind(*(p(held) for p in parts))
    if isinstance(x, (tuple, list)):
        parts = [_walk(v, f"{path}[{i}]", where, device, leaves) for i, v in enumerate(x)]
        return lambda held: kind(p(held) for p in parts)
    if isinstance(x, dict):
        fields = {k: _walk(v, f"{path}[{k!r}]", where, device, leaves) for k, v in x.items()}
        return lambda held: {k: p(held) for k, p in fields.items()}
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        fields = {
            f.name: _walk(getattr(x, f.name), f"{path}.{f.name}", where, device, leaves) for f in dataclasses.fields(x)
        }
        template = copy.copy(x)  # its other fields; the tensor fields are replaced on every rebuild
        for name in fields:
            object.__setattr__(template, name, None)

        def rebuild(held):
            new = copy.copy(template)
            for k, p in fields.items():
                object.__setattr__(new, k, p(held))  # frozen dataclasses too
            return new

        return rebuild
    raise ExecutorError(
        f"output {path} is a {kind.__name__}: the output policy holds tensors",
        where=where,
        fix="return tensors, or tuples, lists, dicts or dataclasses of them (None allowed)",
    )


def flatten(out, where: str, device: torch.device):
    """The tensors of ``out`` in order, and a function that rebuilds ``out`` from
    replacements for them; an ExecutorError for anything the policy cannot hold.
    ``None`` is a graph that returns nothing (it writes into the engine's buffers):
    no tensors; a structure without any tensor is refused (an engine's mistake)."""
    if out is None:
        return (), lambda held: None
    leaves: list[torch.Tensor] = []
    try:
        rebuild = _walk(out, "out", where, device, leaves)
    except ExecutorError:
        leaves.clear()  # the error's frames keep this list: let go of the outputs now
        raise
    if not leaves:
        raise ExecutorError(
            "the step's outputs hold no tensor: a graph that returns nothing cannot be replayed for its results",
            where=where,
            fix="return the output tensors the engine reads, or hold(None) for a graph that writes into buffers",
        )
    return tuple(leaves), rebuild


def rows_per_request(outs: tuple[torch.Tensor, ...], bs: int, ragged: bool, where: str) -> tuple[int, ...]:
    """Rows per request of each output: its rows over ``bs`` (0: held whole:
    a 0-dim output, or with ``ragged`` one whose rows are no multiple of it;
    without ``ragged`` that is an ExecutorError naming the step)."""
    rows = []
    for i, t in enumerate(outs):
        per, rem = divmod(t.shape[0], bs) if t.dim() else (0, 0)
        if rem and not ragged:
            which = "output" if i == 0 else f"output {i}"
            raise ExecutorError(
                f"{which} has {t.shape[0]} rows, not a multiple of bs {bs}",
                where=where,
                fix="return per-request or per-token rows, or hold(out, ragged=True) for slots held whole",
            )
        rows.append(0 if rem else per)
    return tuple(rows)
