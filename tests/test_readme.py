"""The README and the docs stay true: the README's quickstart is two commands (the
second is what CI runs), the spec reference's example builds, and the docs' generated
parts (measurement tables from bench/results/*.json, the CLI reference from the
commands' help) are what docs/generate.py writes now."""

from __future__ import annotations

import importlib.util
import json
import re
import shutil
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _script(name: str, path: str):
    """The checkout's script at ``path`` (not shipped: not of the installed package), imported
    from its file as module ``name``."""
    spec = importlib.util.spec_from_file_location(name, ROOT / path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _quickstart():
    """.ci/quickstart.py, the script CI runs the README's Quickstart with (not shipped)."""
    return _script("ci_quickstart", ".ci/quickstart.py")


def test_quickstart_is_two_commands_and_ci_runs_them_as_written():
    readme = (ROOT / "README.md").read_text()
    block = readme.split("## Quickstart", 1)[1].split("```sh\n", 1)[1].split("```", 1)[0]
    commands = [line for line in block.splitlines() if line.strip()]
    assert len(commands) == 2
    assert commands[0].endswith("planner build --backend fa3 --ci")
    assert "pytest" in commands[1]
    # CI runs what the README says, read from the README, before it installs anything else
    assert _quickstart().commands(readme) == commands
    ci = (ROOT / ".ci/run").read_text().splitlines()
    run = ci.index("python3 .ci/quickstart.py --run")
    installs = [i for i, line in enumerate(ci) if "pip install" in line and not line.lstrip().startswith("#")]
    assert installs and run < min(installs), "CI installs something before the Quickstart runs"


def test_the_spec_example_builds(tmp_path):
    from capture_plan.planner import BuildOptions, build_plan

    page = (ROOT / "docs/spec.md").read_text()
    example = page.split("## Spec\n", 1)[1].split("```toml\n", 1)[1].split("```", 1)[0]
    spec = tmp_path / "example.toml"
    spec.write_text(example)
    plan = build_plan(BuildOptions(backend="fa3", ci=True, spec=spec))
    (phase,) = plan.phases
    assert phase.strategy.workspace == "hoisted" or phase.strategy.order == "smallest-first"
    assert any(d.rule == "team-gate" for d in plan.decisions)


def test_the_quickstart_build_rewrites_the_checked_in_plan_it_names(tmp_path, capsys):
    """`planner build --backend fa3 --ci` in a clone replaces plans/fa3-ci.json: the
    checked-in file must be the plan of exactly that command (a calibrated one under
    that name made the quickstart refuse to replace it, exit 1)."""
    import os

    from capture_plan.planner.cli import main

    root = Path(__file__).resolve().parent.parent
    shutil.copytree(root / "plans", tmp_path / "plans")
    recorded = json.loads((tmp_path / "plans/fa3-ci.json").read_text())["command"]
    assert recorded == ["planner", "build", "--backend", "fa3", "--ci"]
    old = os.getcwd()
    os.chdir(tmp_path)
    try:
        assert main(["build", "--backend", "fa3", "--ci"]) == 0
    finally:
        os.chdir(old)
    assert (tmp_path / "plans/fa3-ci.json").read_bytes() == (root / "plans/fa3-ci.json").read_bytes()
    # and it prints the summary the README shows
    readme = (root / "README.md").read_text()
    shown = readme.split("prints a summary:\n", 1)[1].split("```\n", 1)[1].split("```", 1)[0]
    assert capsys.readouterr().out == shown


def _generator():
    """docs/generate.py, a script of the checkout (not of the installed package)."""
    return _script("docs_generate", "docs/generate.py")


def test_readme_is_short_and_its_links_resolve():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 160
    links = re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", readme)
    local = [link for link in links if not link.startswith("http")]
    assert "docs/measurements.md" in local
    missing = [link for link in local if not (ROOT / link).exists()]
    assert not missing, f"README.md links to missing files: {missing}"


def test_every_page_is_in_the_site_nav():
    nav = (ROOT / "mkdocs.yml").read_text()
    pages = sorted(p.name for p in (ROOT / "docs").glob("*.md"))
    assert [p for p in pages if f": {p}" not in nav] == []


@pytest.mark.parametrize("page", ["measurements.md", "cli.md"])
def test_generated_docs_are_current(page):
    """Fails when a table differs from its JSON (a re-run benchmark, a hand-edited
    table) or the CLI reference from the commands' help."""
    gen = _generator()
    path = ROOT / "docs" / page
    want = gen.generated()[path]
    assert path.read_text() == want, f"docs/{page} is stale; fix: python docs/generate.py"


def test_every_table_renderer_has_a_region_and_every_region_a_renderer():
    gen = _generator()
    names = [m["name"] for p in sorted((ROOT / "docs").glob("*.md")) for m in gen.REGION.finditer(p.read_text())]
    assert sorted(names) == sorted(gen.TABLES)


def test_a_changed_benchmark_json_changes_its_table(tmp_path, monkeypatch):
    """The check has teeth: a figure changed in a JSON reaches the rendered page."""
    gen = _generator()
    results = tmp_path / "results"
    shutil.copytree(ROOT / "bench/results", results)
    data = json.loads((results / gen.CAPTURE).read_text())
    data["sglang"]["pool_mib"] = 2123.0
    (results / gen.CAPTURE).write_text(json.dumps(data))
    monkeypatch.setattr(gen, "RESULTS", results)
    page = (ROOT / "docs/measurements.md").read_text()
    rendered = gen.render_tables(page, "docs/measurements.md")
    assert rendered != page
    assert f"| 2,123 | {data['sglang']['capture_s']:.2f} | 36/36 |" in rendered


def test_an_unknown_table_name_is_one_clear_error():
    gen = _generator()
    with pytest.raises(SystemExit, match=r"docs/x.md: unknown table 'nope'; known: capture"):
        gen.render_tables("<!-- table: nope -->\n<!-- /table -->\n", "docs/x.md")


_PATH = re.compile(r"`((?:tests|planner|schemas|executor|adapters|references|bench|plans|docs)/[^`\s]*)`")
#: a benchmark file named without its folder (the measurements page does this in prose)
_RESULT = re.compile(r"`([a-z][a-z0-9-]*-20\d\d-\d\d-\d\d[a-z0-9*-]*\.(?:json|log))`( at commit)?")


def _pages():
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def test_the_files_the_docs_name_exist():
    """A renamed module, test or benchmark file leaves no dangling name in the docs;
    a result file that is not checked in is named with the commit that has it."""
    missing = []
    for page in _pages():
        text = page.read_text()
        for m in _PATH.finditer(text):
            path = m[1].rstrip(".,:;)")
            if not (list(ROOT.glob(path)) if "*" in path else (ROOT / path).exists()):
                missing.append(f"{page.name}: {path}")
        for m in _RESULT.finditer(text):
            if not m[2] and not list((ROOT / "bench/results").glob(m[1])):
                missing.append(f"{page.name}: bench/results/{m[1]}")
    assert not missing, f"the docs name files that do not exist: {missing}"


def _slug(heading: str) -> str:
    # Python-Markdown's toc slugify, which mkdocs uses for heading anchors
    text = re.sub(r"[^\w\s-]", "", heading.replace("`", "")).strip().lower()
    return re.sub(r"[-\s]+", "-", text)


def test_the_readmes_links_into_the_docs_name_existing_anchors():
    """mkdocs --strict checks the site's own links; the README is not part of the site."""
    readme = (ROOT / "README.md").read_text()
    bad = []
    for page, anchor in re.findall(r"\]\((docs/[^)#]+\.md)#([^)]+)\)", readme):
        headings = re.findall(r"^#+ (.+)$", (ROOT / page).read_text(), flags=re.M)
        if anchor not in {_slug(h) for h in headings}:
            bad.append(f"{page}#{anchor}")
    assert not bad, f"README.md links to anchors that do not exist: {bad}"
