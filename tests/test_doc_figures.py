"""Figures quoted in the docs' prose come from the benchmark JSON they name.

A figure in prose is an inline region that docs/generate.py renders from
``bench/results/*.json`` (``<!-- fig: NAME -->...<!-- /fig -->``); ``source FILE`` regions
name a file with its provenance (uncommitted changes or no commit said so). Checked here:
the pages are what the generator writes (so each figure agrees with its JSON), each
figure's paragraph names every file it is computed from, and in the pages held to it no
number with a unit is quoted beside a result file outside such a region.
"""

from __future__ import annotations

import importlib.util
import json
import re
import shutil
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
#: pages whose every quoted figure, in a paragraph naming a result, is generated
STRICT = ["README.md", "docs/executor.md", "docs/measurements.md", "docs/fit.md"]
#: a number with a unit: MiB, %, seconds, "x" ratios, bytes
_FIGURE = re.compile(r"(?<![\w.`/-])[-+~]?\d[\d,]*(?:\.\d+)?(?:-\d[\d,.]*)?\s?(?:MiB|GiB|MB|GB|%|ms|s|x|bytes)(?![\w])")


#: a paragraph that names a result: its path, a source region, or the file's bare name
_NAMES_RESULT = re.compile(r"bench/results/|fig: source|`[a-z][a-z0-9-]*-20\d\d-\d\d[\w.*-]*\.json`")


def _gen():
    spec = importlib.util.spec_from_file_location("docs_generate", ROOT / "docs/generate.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


gen = _gen()


def _blocks(text: str) -> list[str]:
    """Paragraphs and list items outside code fences and table regions."""
    text = re.sub(r"```.*?```", "", text, flags=re.S)
    text = gen.REGION.sub("", text)
    out: list[str] = []
    for para in re.split(r"\n\s*\n", text):
        out += [b for b in re.split(r"\n(?=- )", para) if b.strip()]
    return out


def test_every_generated_page_agrees_with_its_json():
    stale = [str(p.relative_to(ROOT)) for p, text in gen.generated().items() if p.read_text() != text]
    assert stale == [], f"stale: {stale}; fix: python docs/generate.py"


def test_the_readme_and_docs_quote_figures_through_the_generator():
    pages = [p for p in gen.generated() if gen.FIG.search(p.read_text())]
    assert {"README.md", "docs/executor.md", "docs/measurements.md"} <= {str(p.relative_to(ROOT)) for p in pages}
    used = {m["name"] for p in pages for m in gen.FIG.finditer(p.read_text())}
    assert used == {"source", *gen.FIGURES}, "a figure renderer no page uses, or the reverse"


def test_each_figure_names_the_json_it_comes_from():
    missing = []
    for page in gen.generated():
        for block in _blocks(page.read_text()):
            named = {m["arg"] for m in gen.FIG.finditer(block) if m["name"] == "source"}
            for m in gen.FIG.finditer(block):
                if m["name"] != "source":
                    missing += [
                        f"{page.name}: {m['name']} reads {f}" for f in gen.FIGURES[m["name"]].files if f not in named
                    ]
    assert missing == [], "a figure whose paragraph does not name its file through <!-- fig: source FILE -->"


@pytest.mark.parametrize("page", STRICT)
def test_no_hand_written_figure_beside_a_result(page):
    found = []
    for block in _blocks((ROOT / page).read_text()):
        if not _NAMES_RESULT.search(block):
            continue
        bare = gen.FIG.sub("", block)
        bare = re.sub(r"`[^`]*`|\]\([^)]*\)", "", bare)
        found += [f"{m[0]!r} in: {block[:80]!r}" for m in _FIGURE.finditer(bare)]
    assert found == [], f"{page}: figures quoted by hand beside a result file (make them <!-- fig: --> regions)"


def test_a_changed_json_changes_the_quoted_figure(tmp_path, monkeypatch):
    results = tmp_path / "results"
    shutil.copytree(ROOT / "bench/results", results)
    name = gen.CAPTURE
    data = json.loads((results / name).read_text())
    data["sglang"]["pool_mib"] = 3000.0
    data["git_commit"], data["git_dirty"], data["git_diff_sha256"] = "ab" * 20, True, "cd" * 32
    (results / name).write_text(json.dumps(data))
    monkeypatch.setattr(gen, "RESULTS", results)
    page = (ROOT / "README.md").read_text()
    out = gen.render_figures(page, "README.md")
    assert "<!-- fig: capture-loop-pool -->3,000 MiB<!-- /fig -->" in out
    assert f"`bench/results/{name}`, measured from uncommitted changes to `abababa`, diff sha256 `cdcdcdcdcdcd`" in out


def test_unknown_figures_and_sources_are_one_clear_error():
    with pytest.raises(SystemExit, match=r"docs/x.md: unknown figure 'nope'; known: source, "):
        gen.render_figures("<!-- fig: nope -->1<!-- /fig -->", "docs/x.md")
    with pytest.raises(SystemExit, match=r"docs/x.md: figure source 'gone.json': no such file"):
        gen.render_figures("<!-- fig: source gone.json -->1<!-- /fig -->", "docs/x.md")


def test_provenance_says_what_is_known_of_a_results_code():
    assert gen.provenance({"git_commit": "a" * 40, "git_dirty": False}) == ""
    assert gen.provenance({}) == "no commit recorded"
    assert gen.provenance({"git_commit": "a" * 40, "git_dirty": True}) == (
        "measured from uncommitted changes to `aaaaaaa`, the diff not recorded"
    )
    assert "not recorded whether" in gen.provenance({"git_commit": "a" * 40})
    # a claimed run on a device's copy records the copy's tree, not a diff
    claimed = {"git_commit": "a" * 40, "git_dirty": True, "git_tree": "b" * 40}
    assert gen.provenance(claimed) == "the measured copy held files beyond commit `aaaaaaa` (its tree `bbbbbbb`)"


def test_a_figure_row_whose_path_the_file_lacks_is_one_clear_error(monkeypatch):
    row = gen.PathFigure("nope-row", gen.CAPTURE, "executor/no_such_key", "{}")
    monkeypatch.setitem(gen.FIGURES, row.name, gen.Figure((row.file,), gen._path_render(row)))
    with pytest.raises(
        SystemExit,
        match=rf"figure nope-row: bench/results/{re.escape(gen.CAPTURE)} has no "
        r"'executor/no_such_key' \(executor has no key 'no_such_key'\); fix: point the row of PATH_FIGURES",
    ):
        gen.render_figures("<!-- fig: nope-row -->1<!-- /fig -->", "docs/x.md")
    ok = gen.PathFigure("ok-row", gen.CAPTURE, "executor/pool_mib", "{:,.0f} MiB")
    assert gen._path_render(ok)(gen._load(gen.CAPTURE)) == gen.FIGURES["capture-executor-pool"].render(
        gen._load(gen.CAPTURE)
    )


@pytest.mark.parametrize(
    ("path", "template", "says"),
    [
        (
            "executor/pool_mib/x",
            "{}",
            r"has no 'executor/pool_mib/x' \(executor/pool_mib is a (int|float) \(.*\), not an object",
        ),
        ("executor/0", "{}", r"has no 'executor/0' \(executor has no key '0'\)"),
        ("executor", "{r}", r"the template '\{r\}' does not fit the value at 'executor', an object \(KeyError: 'r'\)"),
        ("executor/pool_mib", "{a[b]}", r"the template '\{a\[b\]\}' does not fit the value at 'executor/pool_mib', a "),
        ("executor", "{:.1f}", r"the template '\{:.1f\}' does not fit the value at 'executor', an object \(IndexError"),
        ("", "{executor[pool_mib][0]}", r"does not fit the value at '\(the whole file\)', an object \(TypeError"),
    ],
    ids=[
        "through-a-scalar",
        "missing-key",
        "missing-field",
        "field-of-a-scalar",
        "positional-on-object",
        "index-a-scalar",
    ],
)
def test_a_figure_row_that_does_not_fit_its_file_is_one_located_line(monkeypatch, path, template, says):
    row = gen.PathFigure("bad-row", gen.CAPTURE, path, template)
    with pytest.raises(SystemExit) as err:
        gen._path_render(row)(gen._load(gen.CAPTURE))
    line = str(err.value.code)
    assert "\n" not in line and line.startswith(f"figure bad-row: bench/results/{gen.CAPTURE}")
    assert re.search(says, line) and "; fix: " in line and "PATH_FIGURES in docs/generate.py" in line


def test_single_value_figures_are_path_rows():
    rows = {f.name for f in gen.PATH_FIGURES}
    assert {"moe-predicted", "build-ns-per-op"} <= rows


def test_a_planner_command_the_docs_run_that_fails_is_one_clear_error():
    with pytest.raises(SystemExit) as err:
        gen.planner_output("sizes", "-b", "fa3", "--ci", "--traffic", "no-such-traffic.csv")
    line = str(err.value)
    assert "\n" not in line
    assert line.startswith("docs/generate.py: `planner sizes -b fa3 --ci --traffic no-such-traffic.csv` exited 1: ")
    assert "no-such-traffic.csv: cannot read traffic" in line and "; fix: run that command" in line


def test_the_replay_times_table_quotes_the_commands_choice():
    out = gen.planner_output(*gen.SIZES_TIMED_ARGS)
    table = "\n".join(gen.replay_times())
    chosen = [ln.strip() for ln in out.splitlines() if ln.strip().startswith(("chosen:", "against SGLang default"))]
    assert len(chosen) == 2 and all(ln in table for ln in chosen)


def test_the_vllm_figures_say_what_the_data_say_whichever_sign():
    """The prose around them no longer asserts a sign: the figures carry it, and a run where
    vLLM's estimate came out low, or no second sample was negative, is quoted as such."""

    def cases(*rows):
        return {"cases": {f"m{i}": {"vllm": {"error": e, "samples_mib": [22.0, s]}} for i, (e, s) in enumerate(rows)}}

    assert gen._vllm_estimate_error(cases((0.28, -94), (0.96, -994))) == "+28% to +96% (high for every model)"
    assert (
        gen._vllm_estimate_error(cases((-0.1, 4), (0.5, 3))) == "-10% to +50% (high for one, low for one of the models)"
    )
    assert gen._vllm_second_sample(cases((0.2, 4), (0.5, 30))) == "positive for every model (4 to 30 MiB)"
