"""The small speculative reference of the planted-bug tests and benchmark, and a
planted-bug run in a process of its own.

:data:`SMALL` (2 layers: captures in seconds, the bugs behave as in the full model),
its planner spec (:func:`spec_toml`) and model (:func:`small_model`);
:func:`planted_run` captures and verifies a plan with bugs planted in a fresh Python
process, since a planted write can end the CUDA context.
"""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import msgspec

from capture_plan.schemas.spec import Model

from .speculative import SpeculativeConfig, SpeculativeModel

__all__ = ["SMALL", "spec_toml", "small_model", "PlantedRun", "planted_run", "planted_verify"]


# -- the small reference of the planted-bug tests and benchmark --------------
#: 2 layers: captures in seconds, and the bugs behave as in the full model
SMALL = Model(layers=2, hidden=1024, heads=8, kv_heads=2, head_dim=128, intermediate=2048, vocab=32000)


def spec_toml(sizes, *, steps: int = 3, topk: int = 4, num_draft_tokens: int = 4, model: Model = SMALL) -> str:
    """A planner spec (TOML text) with the four EAGLE phases of ``model`` at
    ``sizes``, each phase named after its kind (what :class:`SpeculativeModel`
    expects); target_verify's outputs live across phases, as the engines'
    draft phases read them."""
    # JSON scalars are TOML scalars (the model's fields are numbers and plain names)
    text = "[model]\n" + "".join(f"{k} = {json.dumps(v)}\n" for k, v in msgspec.to_builtins(model).items())
    phases = [
        ("decode", 1, ""),
        ("target_verify", num_draft_tokens, 'output_lifetime = "across-phases"\n'),
        ("draft_decode", 1, f"layers = 1\nsteps = {steps}\ntopk = {topk}\n"),
        ("draft_extend", steps + 1, f"layers = 1\ntopk = {topk}\n"),
    ]
    for name, tpr, extra in phases:
        text += (
            f'\n[[phases]]\nname = "{name}"\nkind = "{name}"\nsizes = {sorted(set(sizes))}\n'
            f"tokens_per_request = {tpr}\n{extra}"
        )
    return text


def small_model(
    bugs=(), *, topk: int = 4, page_size: int = 4, steps: int = 3, max_bs: int = 32, max_seqlen: int = 256
) -> SpeculativeModel:
    """The :data:`SMALL` reference on CUDA with ``bugs`` planted."""
    return SpeculativeModel(
        SpeculativeConfig(
            model=SMALL,
            max_bs=max_bs,
            max_seqlen=max_seqlen,
            topk=topk,
            num_steps=steps,
            page_size=page_size,
            bugs=frozenset(bugs),
        )
    )


# -- a planted-bug run in a process of its own ------------------------------------
@dataclass(frozen=True)
class PlantedRun:
    """What :func:`planted_run`'s child process reported.

    ``exit``: its exit code (0: verify returned; 3: verify raised
    :class:`~capture_plan.executor.errors.VerificationFailed`, a device fault). ``captured``:
    the graphs captured, None where capture did not finish. ``failed``: the
    ``FAILED <error>`` line of a device fault, else None. ``result``: verify's
    ``{"ok", "summary", "faults": [{"check", "graph", "detail", "addr",
    "nbytes"}]}``, None where verify did not return. ``output``: the tail of
    the child's stdout and stderr, for messages.
    """

    exit: int
    captured: int | None
    failed: str | None
    result: dict | None
    output: str


def planted_run(
    plan_path: str | Path,
    bugs,
    *,
    checks: tuple[str, ...] = ("interleave", "footprint"),
    record: bool = True,
    timeout: float = 600,
    **model,
) -> PlantedRun:
    """Capture the plan at ``plan_path`` with :func:`small_model` (``bugs``
    planted, ``max_bs`` the plan's largest size, ``model`` its other keyword
    arguments) and ``verify`` it with ``checks``, in a fresh Python process.

    In a process of its own because a planted write can end the CUDA context
    (the ``wild`` bug always does; an overflow that lands on a live tensor
    during an eager run can), and that must not take the caller's with it.
    The plan comes already built (the executor never imports the planner); the
    child loads it without the environment check, as the small reference picks
    its attention kernels itself. The child's command line is what
    ``sanitizer_command`` puts in a device fault's message: it re-runs as long
    as the plan file exists. Raises ``subprocess.TimeoutExpired`` after
    ``timeout`` seconds; does not interpret the faults.
    """
    root = str(Path(__file__).resolve().parent.parent)  # the folder holding the executor package
    program = (
        f"import sys; sys.path.insert(0, {root!r})\n"
        "from capture_plan.references.planted import _planted_child\n"
        f"_planted_child({str(plan_path)!r}, {tuple(bugs)!r}, {tuple(checks)!r}, {bool(record)!r}, {model!r})\n"
    )
    r = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=timeout)
    captured = failed = result = None
    for line in r.stdout.splitlines():
        word, _, rest = line.partition(" ")
        if word == "CAPTURED":
            captured = int(rest)
        elif word == "FAILED" and failed is None:
            failed = line
        elif word == "RESULT":
            result = json.loads(rest)
    return PlantedRun(
        exit=r.returncode, captured=captured, failed=failed, result=result, output=(r.stdout + r.stderr)[-3000:]
    )


def _planted_child(plan_path: str, bugs: tuple[str, ...], checks: tuple[str, ...], record: bool, model: dict) -> None:
    """The child of :func:`planted_run`: prints ``CAPTURED n``, then ``RESULT
    <json>``, or ``FAILED <error>`` and exits 3."""
    from capture_plan.executor import capture
    from capture_plan.executor.load import load_plan

    plan = load_plan(plan_path, check_env=False)
    target = small_model(bugs, max_bs=max(max(p.sizes) for p in plan.phases), **model)
    planted_verify(capture(plan, target, progress=False, record=record), checks)


def planted_verify(gs, checks: tuple[str, ...]) -> None:
    """What a planted-bug child prints for its captured ``gs``: ``CAPTURED n``,
    then ``verify``'s ``RESULT <json>``, or ``FAILED <error>`` and exit 3
    (the lines :func:`planted_run` reads)."""
    from capture_plan.executor.errors import VerificationFailed
    from capture_plan.executor.verification import verify

    print("CAPTURED", len(gs.graphs), flush=True)
    try:
        res = verify(gs, checks=checks)
    except VerificationFailed as err:
        print("FAILED", err, flush=True)
        raise SystemExit(3) from None
    faults = [dict(check=f.check, graph=f.graph, detail=f.detail, addr=f.addr, nbytes=f.nbytes) for f in res.faults]
    result = dict(ok=res.ok, summary=res.summary(), faults=faults, replays=res.replays, checks=list(res.checks))
    print("RESULT", json.dumps(result), flush=True)
