"""``planner spec show`` prints the embedded spec as TOML to save and edit; and
``--spec`` with --speculative or --max-bs says exactly why not and what to do
(issue 19: users copied 4 phases and 51 sizes from presets.toml by hand)."""

from __future__ import annotations

import json

import pytest


@pytest.mark.parametrize(
    "args",
    [(), ("--speculative", "eagle"), ("--max-bs", "512"), ("--speculative", "eagle", "--max-bs", "16", "--tp", "8")],
)
def test_the_toml_decodes_to_the_embedded_spec(cli, args):
    import msgspec

    from capture_plan.planner import resources
    from capture_plan.planner.specs import default_spec
    from capture_plan.schemas.codec import decode_spec

    code, out, err = cli("spec", "show", *args)
    assert (code, err) == (0, "")
    assert out.splitlines()[0] == f"# The embedded spec, from `{' '.join(('planner', 'spec', 'show') + args)}`."
    opts = dict(zip(args[::2], args[1::2]))
    want = default_spec(opts.get("--speculative"), int(opts.get("--max-bs", 256)))
    if "--tp" in opts:
        want = msgspec.structs.replace(want, tp=int(opts["--tp"]))
    assert decode_spec(out.encode(), "shown.toml", phase_kinds=resources.phase_kind_settings()) == want


def test_a_saved_spec_builds_the_same_prediction(cli, tmp_path):
    code, out, _ = cli("spec", "show", "--speculative", "eagle", "--max-bs", "16", "--tp", "8")
    (tmp_path / "mine.toml").write_text(out)
    assert cli("build", "-b", "fa3", "--ci", "--spec", "mine.toml", "-o", "a.json")[0] == 0
    assert (
        cli("build", "-b", "fa3", "--ci", "--speculative", "eagle", "--max-bs", "16", "--tp", "8", "-o", "b.json")[0]
        == 0
    )
    a, b = (json.loads((tmp_path / n).read_text()) for n in ("a.json", "b.json"))
    assert a["predicted"] == b["predicted"] and a["steps"] == b["steps"]
    assert a["inputs"]["tp"] == 8


def test_the_sizes_are_wrapped_and_every_phase_is_a_table(cli):
    out = cli("spec", "show", "--speculative", "eagle")[1]
    assert out.count("[[phases]]") == 4 and '[model]\nname = "llama-3-8b"\n' in out
    assert "sizes = [\n  1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 14, 16, 18, 20, 22, 24,\n" in out
    assert max(len(line) for line in out.splitlines()) <= 100


def test_bad_options_are_one_line(cli):
    code, out, err = cli("spec", "show", "--tp", "3")
    assert (code, out) == (1, "")
    assert err == (
        "planner: error: --tp: tp=3 does not divide heads=32, intermediate=14336, kv_heads=8; fix: use "
        "a tensor-parallel size that divides the model's heads and MLP\n"
    )
    code, _, err = cli("spec", "show", "--speculative", "medusa")
    assert code == 1 and "--speculative: unknown speculative algorithm 'medusa'; fix: use one of eagle" in err
    assert cli("spec", "show", "--max-bs", "x")[0] == 2


@pytest.mark.parametrize(
    "extra,given",
    [
        (("--max-bs", "512"), "--max-bs 512"),
        (("--speculative", "eagle", "--max-bs", "512"), "--speculative eagle and --max-bs 512"),
    ],
)
def test_spec_with_embedded_spec_options_says_why_not_and_what_to_do(cli, tmp_path, extra, given):
    (tmp_path / "x.toml").write_text('[[phases]]\nname = "decode"\nkind = "decode"\nsizes = [1, 2]\n')
    code, out, err = cli("build", "-b", "fa3", "--spec", "x.toml", *extra)
    shown = " ".join(extra)
    assert (code, out) == (1, "")
    assert err == (
        f"planner: error: --spec x.toml: {given} choose the embedded spec's phases and sizes, and x.toml "
        f"lists its own; fix: start a spec from `planner spec show {shown} > my.toml` and build with "
        "--spec my.toml, or write the phases and sizes into your spec\n"
    )


def test_spec_with_tp_applies_it(cli, tmp_path):
    (tmp_path / "x.toml").write_text('[[phases]]\nname = "decode"\nkind = "decode"\nsizes = [1, 2]\n')
    assert cli("build", "-b", "fa3", "--spec", "x.toml", "--tp", "8", "-o", "p.json")[0] == 0
    assert json.loads((tmp_path / "p.json").read_text())["inputs"]["tp"] == 8
