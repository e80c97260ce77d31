"""Byte units and the one way the project writes a byte count in MiB.

Shared by the planner (plan summaries, decisions, errors) and the executor
(its capture log line), so that every figure a user compares is rounded and
separated the same way. The benches keep their own ``MiB`` (they write raw
MiB floats to JSON, not this text).
"""

from __future__ import annotations

__all__ = ["KiB", "MiB", "DRIVER_CHUNK", "mib"]

KiB = 1024
MiB = 1024 * KiB
#: the driver takes a graph's executable memory (graph-exec) in steps of this many bytes
#: (measured on an H200, driver 580: bench/results/graph-exec-2026-12-01.json)
DRIVER_CHUNK = 2 * MiB


def mib(n: int, unit: bool = True) -> str:
    """``n`` bytes in MiB, one decimal, thousands separated: "2,122.0 MiB" (``unit=False``: "2,122.0")."""
    text = f"{n / MiB:,.1f}"
    return f"{text} MiB" if unit else text
