"""Kernel scratch whose size is not affine in the batch size: the shapes the fitter also tries.

The fitter (``planner/memory/fitting.py``) derives a capture's allocation sizes as
``a * f(bs) + b`` for integers ``a, b`` and a basis ``f`` it knows. Most
scratch is affine in a padded batch (``f = round_up(bs, k)``). One kernel every
speculative phase runs is not: ``torch.topk`` over a wide row (the
vocabulary) takes ATen's multi-block radix select
(``aten/src/ATen/native/cuda/TensorTopK.cu``, ``mbtopk``). It splits each row
into blocks of ``items * 256`` elements, where ``items`` grows with the work so
that every SM stays busy::

    items  = clamp(ceil(rows * width / (SMs * 6 * 256)), 4, 64)
    blocks = rows * ceil(width / (items * 256))

(256 threads a block; 6 blocks an SM: 65,536 registers over 40 registers a
thread), and sizes its scratch per block: 512 bytes (a 256-digit histogram of
shorts) and twice 4 bytes (counts). So the scratch rises with the batch, falls
where ``items`` steps up, then rises again, and no ``a * round_up(bs, k) + b``
fits it. Checked against the committed H200 trace (``plans/traces/fa3-eagle-ci.json``,
132 SMs, width 128,256): all 12 such allocations of the two draft phases, at
every one of their 51 recorded sizes, are 512 or 4 times ``blocks``.

A basis needs the device's SM count (a recorded trace carries it:
``Trace.multiprocessors``) and the row width: the vocabulary of the phase's
model, on rows of ``bs`` times one of the phase's per-request multipliers
(1, its ``topk``, its ``tokens_per_request``). Without an SM count no such
basis is offered and the fitter asks for every size, as before.

What it does not do: know other kernels' shapes (a basis is data here, added
where a trace shows one), or choose between candidates: the fitter checks each
on the samples it did not fit from and refuses where candidates disagree. Nor
does it fit the SM count: blocks per row are coarse (14 at bs 60 for 132 SMs
and for 143), so three samples cannot tell nearby counts apart, and the count
must be the device's own, as the recording reads it. The held-out sample does
guard ATen's constants: with 4 or 8 blocks an SM, 32 or 128 items, or 128
threads, the H200's draft allocations fit nothing and are refused
(tests/test_traces.py).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

__all__ = ["Basis", "BlockedRows", "MBTOPK", "rounding", "blocked_rows_bases"]


@dataclass(frozen=True)
class Basis:
    """A function of the batch size an allocation's size may be an integer multiple of
    (plus a constant); ``label`` names it in the fitter's messages."""

    label: str
    at: Callable[[int], int]


def _ceil_div(n: int, d: int) -> int:
    return -(-n // d)


def rounding(k: int) -> Basis:
    """``round_up(bs, k)``: a batch padded to a multiple of ``k`` (``k = 1``: affine)."""
    return Basis(f"round_up(bs, {k})", lambda bs: _ceil_div(bs, k) * k)


@dataclass(frozen=True)
class BlockedRows:
    """A kernel that splits each of ``rows`` rows of ``width`` elements into blocks of
    ``items * threads`` elements, ``items`` clamped to ``[min_items, max_items]`` and
    grown until ``rows * width`` fills ``blocks_per_sm`` blocks on every SM."""

    name: str
    threads: int
    blocks_per_sm: int
    min_items: int
    max_items: int

    def blocks(self, rows: int, width: int, sms: int) -> int:
        """Blocks over all rows."""
        items = _ceil_div(rows * width, sms * self.blocks_per_sm * self.threads)
        items = max(self.min_items, min(items, self.max_items))
        return rows * _ceil_div(width, items * self.threads)


#: torch.topk's multi-block radix select (ATen TensorTopK.cu, mbtopk): 256 threads a block,
#: 6 blocks an SM (65,536 registers / (40 a thread * 256)), 4 to 64 items a thread
MBTOPK = BlockedRows(name="torch.topk blocks", threads=256, blocks_per_sm=6, min_items=4, max_items=64)


def blocked_rows_bases(
    kernel: BlockedRows, widths: Iterable[int], multipliers: Iterable[int], sms: int | None
) -> list[Basis]:
    """``kernel``'s blocks at ``bs * m`` rows of each width, as bases; none without ``sms``."""
    if not sms:
        return []
    out = []
    for width in sorted(set(widths)):
        for m in sorted(set(multipliers)):
            rows = "bs" if m == 1 else f"{m}*bs"
            out.append(
                Basis(
                    f"{kernel.name}({rows} rows of {width}, {sms} SMs)",
                    lambda bs, w=width, m=m: kernel.blocks(bs * m, w, sms),
                )
            )
    return out
