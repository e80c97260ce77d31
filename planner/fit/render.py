"""fit's table: one row per item with its status, error bar and source."""

from __future__ import annotations

from capture_plan.schemas.fit import FitResult

from .result import NO_FIX
from .tables import GiB

__all__ = ["render"]


def _gib(b: int | None) -> str:
    return "unknown" if b is None else f"{b / GiB:.2f} GiB"


def render(r: FitResult) -> str:
    lines = [
        f"{r.model} on {r.device} x{r.tp}, {r.engine} {r.version} (rule {r.rule}, wheel sha256 {r.wheel_sha256[:12]})",
        "settings: " + " ".join(f"--{k} {v}" for k, v in r.settings.items()),
        f"{'item':<18} {'figure':>12} {'error':>12}  {'status':<9} source",
    ]
    for i in r.items:
        err = "" if i.error_bytes is None else f"+-{i.error_bytes / GiB:.2f} GiB"
        lines.append(f"{i.name:<18} {_gib(i.bytes):>12} {err:>12}  {i.status:<9} {i.source}")
    for k in r.kv_layers:
        lines.append(
            f"KV per token, {k.kind}: {k.bytes_per_token} B a layer ({k.layers} layers, {k.dtype_bytes}-byte elements)"
        )
    tok = "unknown" if r.kv_tokens is None else f"{r.kv_tokens:,}"
    blocks = "unknown" if r.kv_blocks is None else f"{r.kv_blocks:,}"
    lines.append(
        f"KV tokens {tok} in {blocks} blocks of {r.block_tokens}; max concurrency at {r.max_model_len} tokens: "
        f"{r.max_concurrency}x"
    )
    if r.speculative is not None:
        sp = r.speculative
        without = "unknown" if sp.kv_tokens_without is None else f"{sp.kv_tokens_without:,}"
        lines.append(
            f"speculative {sp.method} ({sp.tokens} tokens a step, draft {sp.draft or 'none'}): draft KV "
            f"{sp.draft_kv_bytes_per_token} B a token ({sp.draft_layers} layers); without it {without} KV tokens, "
            f"{sp.max_concurrency_without}x ({sp.source})"
        )
    t = r.traffic
    if t is not None:
        lines.append(
            f"traffic {t.source} ({t.form}, {t.steps:,.0f} steps, largest size {t.largest}); front rows: {t.shown}; "
            f"pads: {t.cost}" + "".join(f"; {n}" for n in t.notes)
        )
    for c in r.size_costs:
        cost = "unknown" if c.tokens_cost is None else f"{c.tokens_cost:,}"
        runs = f" {','.join(map(str, c.sizes))}" if c.name.startswith("traffic front") else ""
        line = f"sizes {c.name} ({len(c.sizes)}){runs}: graph {_gib(c.graph_bytes)}, costs {cost} KV tokens"
        if t is not None:
            no = "no graphs" if not c.sizes else f"steps above {max(c.sizes)} run without graphs"
            line += f", pads {f'{c.padding_pct:.2f}%' if c.padding_pct is not None else f'n/a ({no})'}"
        lines.append(line)
    lines += [f"note: {n}" for n in r.notes]
    if not r.fits:
        lines.append(f"does not fit: {r.overflow}; fixes: {' | '.join(r.fixes) or NO_FIX}")
    return "\n".join(lines) + "\n"
