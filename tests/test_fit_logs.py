"""`planner fit` against the start-up logs real deployments published (tests/data/engine_logs).

Every fixture is read, and its test id says what is checked:

- ``refused-release``: a release fit does not model; fit refuses it with one line naming the
  nearest modelled release (issue 52, item 2).
- ``refused-model``: a model fit does not model; the one-line refusal names what is missing.
- ``compared``: fit is run from the log's config, device and settings alone (no figure of the
  log is given to it, except where the device has no graph figure: below) and each figure the
  log shows is held to its target: KV tokens and KV GiB within 1%, graph memory within 10%
  (the capture's own figure where the log shows it, else the engine's pre-capture estimate),
  weights within fit's stated error bar, the profiling run's activation peak within 10%.

Where fit misses a target, the miss is a gap: the error measured, why, and a bound the test
holds it to. A gap is not a pass: the test fails if the error leaves its bound, and fails too
once the error is back inside the target (the gap is closed: remove it), so the gaps always say
what fit gets wrong today. No figure is fitted to a log. The targets, gaps and refused models
are data (tests/data/fit_logs.toml), and fit's run for a log is tests/published_logs.py's
``compare``: docs/generate.py renders the same into docs/fit.md.
"""

from __future__ import annotations

import pytest

from capture_plan.planner.fit.model import load_model
from capture_plan.planner.fit.tables import GiB, rule_for
from capture_plan.schemas.errors import InputError
from published_logs import GAPS, LOGS, REFUSED, TARGETS, THEMES, compare, fixtures, kind, read

FIXTURES = fixtures()
KINDS = {path: kind(path) for path in FIXTURES}


def _of(k: str) -> list:
    return [pytest.param(p, id=f"{k}:{p.stem}") for p in FIXTURES if KINDS[p] == k]


def test_the_folder_holds_logs_of_every_kind():
    # an empty parametrization would pass vacuously
    counts = {k: sum(v == k for v in KINDS.values()) for k in ("refused-release", "refused-model", "compared")}
    assert min(counts.values()) >= 1 and counts["compared"] >= 10, counts


@pytest.mark.parametrize("path", _of("refused-release"))
def test_a_log_of_an_unmodelled_release_is_refused_naming_the_nearest(path):
    log = read(path)
    with pytest.raises(InputError) as err:
        rule_for(f"{log['engine']}=={log['version']}")
    assert f"--engine {log['engine']}==" in err.value.fix and "\n" not in str(err.value)


@pytest.mark.parametrize("path", _of("refused-model"))
def test_a_log_of_an_unmodelled_model_is_refused_naming_what_is_missing(path):
    with pytest.raises(InputError) as err:
        load_model(str(LOGS / read(path)["config"]))
    assert all(part in str(err.value) for part in REFUSED[path.stem]) and "\n" not in str(err.value)


def _check(stem: str, figure: str, got: float, logged: float, target: float) -> None:
    """Hold fit's ``got`` to ``target`` against ``logged``, or to the figure's recorded gap."""
    error = got / logged - 1
    gap = GAPS.get((stem, figure))
    if gap is None:
        assert abs(error) <= target, f"{figure}: fit {got:.4g} against {logged:.4g} logged ({error:+.2%})"
        return
    why = THEMES[gap.theme]["title"]
    assert abs(error) > target, f"{figure}: the gap is closed ({error:+.2%}): remove it from tests/data/fit_logs.toml"
    assert abs(error) <= gap.bound, f"{figure}: {error:+.2%} is past the gap's bound {gap.bound:.0%} ({why})"
    assert error == pytest.approx(gap.error, abs=0.005), f"{figure}: now {error:+.2%}, recorded {gap.error:+.2%}"


@pytest.mark.parametrize("path", _of("compared"))
def test_fit_meets_the_published_log(path):
    logged = read(path)["logged"]
    c = compare(path)
    r = c.result
    items = {i.name: i for i in r.items}
    if c.graph is None:
        # nothing measured is near this device's graphs: fit leaves them unknown, never zero,
        # and its tokens are an upper bound; the release's other items are then checked with
        # the engine's own logged estimate in the graph item's place (compare)
        graph = next(i for i in c.first.items if i.name == "graph memory")
        assert graph.status == "unknown" and c.first.kv_bytes / GiB >= logged["kv_cache_gib"]
    else:
        assert c.logged_graph is not None, "a compared log shows graph memory"
        _check(path.stem, "graph", c.graph / GiB, c.logged_graph, TARGETS["graph"])
    if "total_gpu_gib" in logged:  # the device table's total is the one the engine saw
        assert items["device total"].bytes / GiB == pytest.approx(logged["total_gpu_gib"], abs=0.005)
    if "weights_gib" in logged:  # within fit's own error bar (and the log's 0.01 GiB print)
        w = items["weights"]
        bar = (w.error_bytes + 0.005 * GiB) / (logged["weights_gib"] * GiB)
        _check(path.stem, "weights", w.bytes / GiB, logged["weights_gib"], bar)
    if "activation_peak_gib" in logged:
        got = items["activation peak"].bytes / GiB
        _check(path.stem, "activation_peak_gib", got, logged["activation_peak_gib"], TARGETS["activation_peak_gib"])
    _check(path.stem, "kv_cache_gib", r.kv_bytes / GiB, logged["kv_cache_gib"], TARGETS["kv_cache_gib"])
    if "kv_tokens" in logged:  # not where a block override set the count (the log's notes say)
        _check(path.stem, "kv_tokens", r.kv_tokens, logged["kv_tokens"], TARGETS["kv_tokens"])


def test_every_gap_names_a_compared_log_a_checked_figure_and_a_theme():
    stems = {p.stem for p in FIXTURES if KINDS[p] == "compared"}
    for (stem, figure), gap in GAPS.items():
        assert stem in stems, stem
        assert figure in {"graph", "weights", *TARGETS}, figure
        assert gap.theme in THEMES and THEMES[gap.theme]["title"] and THEMES[gap.theme]["text"], gap
    assert set(REFUSED) <= {p.stem for p in FIXTURES if KINDS[p] == "refused-model"}


def test_the_docs_show_the_gaps_this_test_holds():
    """docs/fit.md's recorded gaps are generated from tests/data/fit_logs.toml (docs/generate.py
    fit_log_gaps; `docs/generate.py --check` keeps them current). Before: hand copies of this
    test's GAPS text, which no check compared."""
    from pathlib import Path

    page = (Path(__file__).resolve().parent.parent / "docs" / "fit.md").read_text(encoding="utf-8")
    region = page.split("<!-- table: fit-log-gaps -->")[1].split("<!-- /table -->")[0]
    for theme in THEMES.values():
        assert f"**{theme['title']}**" in region and " ".join(theme["text"].split()) in region, theme["title"]
    for stem in REFUSED:
        assert stem in region
