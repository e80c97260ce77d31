"""fit against the published start-up logs (tests/data/engine_logs), one owner for the test and
the docs: tests/test_fit_logs.py holds each figure to its target or recorded gap, and
docs/generate.py renders the same comparison and the same gaps into docs/fit.md (importing
this module by its file's location: tests/ is not a package). What fit is held to is data,
tests/data/fit_logs.toml (targets, the refused models, the gaps and why)."""

from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

from capture_plan.planner.fit.fit import FitRequest, fit
from capture_plan.planner.fit.model import load_model
from capture_plan.planner.fit.tables import GiB, rule_for
from capture_plan.schemas.documents import toml_parser
from capture_plan.schemas.errors import InputError
from capture_plan.schemas.fit import FitItem, FitResult

__all__ = ["LOGS", "Gap", "EXPECTED", "TARGETS", "GAPS", "THEMES", "REFUSED", "read", "kind", "fixtures", "compare"]

LOGS = Path(__file__).resolve().parent / "data" / "engine_logs"
EXPECTED = toml_parser().loads((LOGS.parent / "fit_logs.toml").read_text(encoding="utf-8"))
#: |fit / logged - 1| at most this, per figure
TARGETS: dict[str, float] = EXPECTED["targets"]
#: fixture -> what the one-line refusal of its model must name
REFUSED: dict[str, list[str]] = {stem: r["names"] for stem, r in EXPECTED["refused"].items()}
#: theme -> {title, text}: why fit misses a target
THEMES: dict[str, dict[str, str]] = EXPECTED["themes"]


class Gap(NamedTuple):
    """A figure fit misses against one log: ``error`` as recorded, ``bound`` and its ``theme``."""

    error: float
    bound: float
    theme: str


#: (fixture, figure) -> the gap recorded
GAPS: dict[tuple[str, str], Gap] = {
    (g["log"], g["figure"]): Gap(g["error"], g["bound"], g["theme"]) for g in EXPECTED["gaps"]
}


def read(path: Path) -> dict:
    return toml_parser().loads(path.read_text(encoding="utf-8"))


def kind(path: Path) -> str:
    """``refused-release`` (a release fit does not model), ``refused-model`` or ``compared``."""
    log = read(path)
    try:
        rule_for(f"{log['engine']}=={log['version']}")
    except InputError:
        return "refused-release"
    return "refused-model" if path.stem in REFUSED else "compared"


def fixtures() -> list[Path]:
    return sorted(LOGS.glob("*.toml"))


class Compared(NamedTuple):
    """fit run from a log's config, device and settings alone."""

    result: FitResult
    #: fit's graph memory (bytes) from its own estimate; None: unknown on the device (the
    #: engine's logged estimate was then given to fit in its place, and ``result`` is that run)
    graph: int | None
    #: the graph figure the log shows: what the capture took, else the engine's estimate (GiB)
    logged_graph: float | None
    #: fit's result before the logged estimate was given (``result`` where the graph is known)
    first: FitResult


def compare(path: Path) -> Compared:
    """fit for a compared log (no figure of the log given to it, but where the device has no
    graph figure: the engine's own logged estimate, printed to 0.01 GiB, then stands in for it)."""
    log = read(path)
    model = load_model(str(LOGS / log["config"]))
    settings = {k: v for k, v in log["settings"].items() if k not in EXPECTED["not_sizing"]}
    args = (model, log["device"], f"{log['engine']}=={log['version']}", log["tp"], settings)
    first = fit(FitRequest(*args))
    graph = next(i for i in first.items if i.name == "graph memory").bytes
    logged = log["logged"]
    shown = logged.get("graph_gib", logged.get("graph_estimate_gib"))
    result = first
    if graph is None:
        given = FitItem("graph memory", int(logged["graph_estimate_gib"] * GiB), int(0.005 * GiB), "given", path.name)
        result = fit(FitRequest(*args, measured_graph=given))
    return Compared(result, graph, shown, first)
