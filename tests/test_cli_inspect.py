"""The commands that read a plan and print it: ``show``, ``explain``, ``graph``,
``simulate`` (and its --plot), ``schema``, ``report``.

``planner graph --phases``: one node per phase, legible for the EAGLE plans
(issue 19: the 210-step chain rendered as a 32,767 x 62 px image). ``explain``
prints a command that runs from the current directory (issue 19: it printed the
plan-relative one)."""

from __future__ import annotations

import json
import shutil
import struct
import subprocess
from pathlib import Path

import pytest

from cli_inputs import SPEC, one_line_error

PLANS = Path(__file__).resolve().parents[1] / "plans"


@pytest.fixture
def plans(tmp_path):
    shutil.copytree(PLANS, tmp_path / "plans")


def test_dot_phase_view_of_the_eagle_plan(cli, plans):
    code, out, _ = cli("graph", "plans/fa3-eagle-ci.json", "--phases")
    assert code == 0
    lines = out.splitlines()
    assert lines[0] == 'digraph "fa3-eagle-ci" {'
    assert lines[4] == (
        '  p0 [label="target_verify\\l51 captures, bs 256 \u2192 1\\lorder largest-first (default)\\l'
        "pool phase:target_verify, outputs view\\l1 hoisted workspace (fa3-ci-varlen-gate)\\l"
        '1 warm-up (warmup)\\l"];'
    )
    assert lines[-4:] == [
        '  p0 -> p1 [label="phase-order"];',
        '  p1 -> p2 [label="phase-order"];',
        '  p2 -> p3 [label="phase-order"];',
        "}",
    ]
    assert len(lines) == 12  # 4 nodes, 3 edges: not 210 steps


def test_mermaid_phase_view(cli, plans):
    code, out, _ = cli("graph", "plans/fa3-eagle.json", "--phases", "-f", "mermaid")
    lines = out.splitlines()
    assert code == 0 and lines[0] == "flowchart LR"
    assert lines[4] == (
        '  p3["decode<br/>51 captures, bs 256 \u2192 1<br/>order largest-first (default)<br/>'
        'pool shared, outputs view<br/>1 warm-up (warmup)"]'
    )
    assert lines[-1] == "  p2 -->|phase-order| p3"


def test_one_phase_plan(cli, plans):
    code, out, _ = cli("graph", "plans/triton.json", "--phases")
    assert code == 0
    assert (
        '"decode\\l36 captures, bs 256 \u2192 1\\lorder largest-first (default)\\lpool shared, outputs view\\l'
        '36 warm-ups (warmup-per-shape)\\l"' in out
    )


def test_a_phase_name_with_quotes_stays_one_dot_string(built):
    import msgspec

    from capture_plan.planner.report.render import graph_phases

    plan = built(backend="fa3", max_bs=4)
    odd = msgspec.structs.replace(plan, name='we"ird')
    assert graph_phases(odd, "dot").splitlines()[0] == 'digraph "we\\"ird" {'


@pytest.mark.skipif(shutil.which("dot") is None, reason="Graphviz `dot` is not installed")
def test_the_phase_view_renders_small(cli, plans, tmp_path):
    out = cli("graph", "plans/fa3-eagle-ci.json", "--phases")[1]
    png = subprocess.run(["dot", "-Tpng"], input=out.encode(), capture_output=True, check=True).stdout
    width, height = struct.unpack(">II", png[16:24])
    assert width < 2000 and height < 400, (width, height)


def test_show_explain_graph_simulate_schema(cli, tmp_path, built):
    from capture_plan.planner import plan_bytes

    plan = "plans/fa3-eagle-ci.json"  # the bytes `planner build -b fa3 --ci --speculative eagle --max-bs 16` writes
    (tmp_path / "plans").mkdir()
    # --max-bs 16: the full preset's gate and hoisting with a quarter of its captures (shared with test_build)
    (tmp_path / plan).write_bytes(plan_bytes(built(backend="fa3", ci=True, speculative="eagle", max_bs=16)))
    code, out, _ = cli("show", plan)
    assert code == 0 and "provision  target_verify  16" in out
    code, out, _ = cli("explain", plan)
    assert code == 0 and "[target_verify] fa3-ci-varlen-gate: workspace=hoisted" in out
    assert "- provision/target_verify/16 -> capture/target_verify/16: fa3-ci-varlen-gate" in out
    code, out, _ = cli("graph", plan, "--format", "mermaid")
    assert code == 0 and out.startswith("flowchart LR") and "-->|fa3-ci-varlen-gate|" in out
    code, out, _ = cli("graph", plan)
    assert code == 0 and out.startswith('digraph "fa3-eagle-ci"')
    code, _, err = cli("graph", plan, "--format", "svg")
    assert code == 1 and "--format: unknown format 'svg'" in err
    code, out, _ = cli("simulate", plan, "--plot", "t.png")
    assert code == 0 and "peak reserved" in out and (tmp_path / "t.png").read_bytes()[:4] == b"\x89PNG"
    code, out, _ = cli("schema")
    schemas = json.loads(out)
    assert set(schemas) == {"spec", "plan", "trace", "report", "backends", "phase-kinds", "fit"}
    from capture_plan.planner.inputs.schema import SCHEMAS

    assert set(schemas) == set(SCHEMAS)
    help_text = " ".join(cli("schema", "-h")[1].split())
    assert all(f"{name}," in help_text or f"{name} or all" in help_text for name in SCHEMAS)  # help names each
    code, out, _ = cli("schema", "backends")
    backend = json.loads(out)["$defs"]["Backend"]
    assert code == 0 and backend["additionalProperties"] is False and "attention_temp_factor" in backend["properties"]
    code, out, _ = cli("schema", "spec")
    assert code == 0 and "Spec" in json.loads(out)["$defs"]
    code, _, err = cli("schema", "nope")
    assert code == 1 and "unknown schema 'nope'" in err


def test_report_side_by_side(cli, tmp_path):
    import msgspec

    from capture_plan.schemas.report import StepMeasurement
    from reports import capture_report

    step = StepMeasurement(
        step=1, id="capture/decode/256", reserved=252 * 2**20, predicted_reserved=252 * 2**20, seconds=0.05
    )
    rep = capture_report(None, [step], plan="fa3", plan_digest="sha256:x", backend_module="fa3", pool_bytes=260 * 2**20)
    rep = msgspec.structs.replace(rep, predicted_pool_bytes=258 * 2**20)
    (tmp_path / "r.json").write_bytes(msgspec.json.encode(rep))
    code, out, _ = cli("report", "r.json")
    assert code == 0 and "capture/decode/256" in out and "pool: predicted 258.0 MiB, measured 260.0 MiB (+0.8%)" in out
    assert cli("build", "-b", "fa3")[0] == 0
    code, out, err = cli("report", "r.json", "--plan", "plans/fa3.json")  # captured from another plan
    assert (
        code == 1
        and out == ""
        and err.startswith(
            "planner: error: r.json: $.plan_digest: report was captured "
            "from plan 'fa3' (sha256:x), not from plans/fa3.json"
        )
    )


@pytest.mark.parametrize("target", ["plans/fa3.json", "s.toml"])
def test_simulate_plot_refuses_to_replace_a_file_that_is_not_a_png(cli, tmp_path, target):
    # before: `planner simulate plans/fa3.json --plot plans/fa3.json` replaced the plan with a PNG
    assert cli("build", "-b", "fa3")[0] == 0
    (tmp_path / "s.toml").write_text(SPEC)
    before = (tmp_path / target).read_bytes()
    code, out, err = cli("simulate", "plans/fa3.json", "--plot", target)
    one_line_error((code, out, err), f"--plot {target}: exists and is not a PNG image", "fix: plot to a new")
    assert out == "" and (tmp_path / target).read_bytes() == before


def test_simulate_plot_replaces_its_own_png(cli, tmp_path):
    pytest.importorskip("matplotlib")
    assert cli("build", "-b", "fa3")[0] == 0
    (tmp_path / "empty.png").write_bytes(b"")
    for _ in range(2):
        for name in ("t.png", "empty.png"):
            code, out, _ = cli("simulate", "plans/fa3.json", "--plot", name)
            assert code == 0 and out.endswith(f"wrote {name}\n")
            assert (tmp_path / name).read_bytes().startswith(b"\x89PNG\r\n\x1a\n")


def test_report_against_another_plan_exits_1(cli, tmp_path):
    # before: exit 0 with a "warning:" line in the table on stdout, which CI never sees
    import msgspec

    from reports import capture_report

    assert cli("build", "-b", "fa3")[0] == 0
    assert cli("build", "-b", "fa3", "--ci")[0] == 0
    plan = json.loads((tmp_path / "plans/fa3.json").read_bytes())
    rep = capture_report(
        None,
        plan="fa3",
        plan_digest=plan["digest"],
        device="d",
        backend_module="fa3",
        pool_bytes=1,
        predicted_pool_bytes=1,
    )
    (tmp_path / "r.json").write_bytes(msgspec.json.encode(rep))
    assert cli("report", "r.json", "--plan", "plans/fa3.json")[0] == 0
    code, out, err = cli("report", "r.json", "--plan", "plans/fa3-ci.json")
    one_line_error(
        (code, out, err),
        "r.json: $.plan_digest: report was captured from plan 'fa3'",
        "not from plans/fa3-ci.json ('fa3-ci', sha256:",
        "fix: pass the plan it was captured from",
    )
    assert out == ""


def test_dot_output_escapes_quotes_in_the_plan_name(cli, tmp_path):
    # before: `-o 'we"ird.json'` gave `digraph "we"ird" {`, which Graphviz cannot read
    import re

    assert cli("build", "-b", "fa3", "--max-bs", "2", "-o", 'we"ird\\name.json')[0] == 0
    code, out, _ = cli("graph", 'we"ird\\name.json')
    assert code == 0 and out.splitlines()[0] == r'digraph "we\"ird\\name" {'
    for line in out.splitlines():  # every quoted string closes on its line
        assert len(re.findall(r'(?<!\\)(?:\\\\)*"', line)) % 2 == 0, line


@pytest.mark.parametrize(
    "cwd,plan,runnable",
    [
        (".", "plans/mine.json", "planner build --backend fa3 --spec specs/mine.toml -o plans/mine.json"),
        ("plans", "mine.json", "planner build --backend fa3 --spec ../specs/mine.toml -o mine.json"),
        ("specs", "../plans/mine.json", "planner build --backend fa3 --spec mine.toml -o ../plans/mine.json"),
    ],
)
def test_explain_prints_the_command_for_the_current_directory(cli, tmp_path, monkeypatch, cwd, plan, runnable):
    (tmp_path / "specs").mkdir()
    (tmp_path / "specs/mine.toml").write_text('[[phases]]\nname = "decode"\nkind = "decode"\nsizes = [1, 2]\n')
    assert cli("build", "-b", "fa3", "--spec", "specs/mine.toml", "-o", "plans/mine.json")[0] == 0
    monkeypatch.chdir(tmp_path / cwd)
    code, out, _ = cli("explain", plan)
    assert code == 0
    assert out.splitlines()[0] == f"plan mine, rebuilt from here by: {runnable}"
    # it runs from here, and rebuilds the same plan
    assert cli(*runnable.split()[1:], "--check")[0] == 0


def test_explain_of_a_default_plan(cli):
    assert cli("build", "-b", "fa3", "--ci")[0] == 0
    assert (
        cli("explain", "plans/fa3-ci.json")[1].splitlines()[0]
        == "plan fa3-ci, rebuilt from here by: planner build --backend fa3 --ci"
    )
    # from elsewhere the default output path is given explicitly: a plain rebuild would write ./plans/
    import os

    os.mkdir("sub")
    os.chdir("sub")
    assert (
        cli("explain", "../plans/fa3-ci.json")[1].splitlines()[0]
        == "plan fa3-ci, rebuilt from here by: planner build --backend fa3 --ci -o ../plans/fa3-ci.json"
    )


def test_explain_of_a_plan_whose_command_cannot_be_read_says_where_to_run_it(cli, tmp_path):

    from capture_plan.schemas.codec import canonical_bytes, decode_plan, seal

    assert cli("build", "-b", "fa3")[0] == 0
    plan = decode_plan((tmp_path / "plans/fa3.json").read_bytes(), "p")
    import msgspec

    # an older revision: no build record, only the command's text, which says --future-flag
    odd = seal(
        msgspec.structs.replace(
            plan,
            command=["planner", "build", "--backend", "fa3", "--future-flag"],
            inputs=msgspec.structs.replace(plan.inputs, build=msgspec.UNSET),
        )
    )
    (tmp_path / "plans/odd.json").write_bytes(canonical_bytes(odd))
    code, out, _ = cli("explain", "plans/odd.json")
    assert code == 0
    assert out.splitlines()[0] == (
        "plan fa3, recorded command (its paths relative to plans): planner build --backend fa3 --future-flag"
    )
    # a revision-1 plan whose text holds only what a build records: the command from here, to its own path
    (tmp_path / "plans/old.json").write_bytes(
        canonical_bytes(seal(msgspec.structs.replace(odd, command=["planner", "build", "--backend", "fa3", "--ci"])))
    )
    code, out, _ = cli("explain", "plans/old.json")
    assert out.splitlines()[0] == "plan fa3, rebuilt from here by: planner build --backend fa3 --ci -o plans/old.json"
