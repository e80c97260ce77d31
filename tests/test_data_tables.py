"""Phase kinds are typed data: a kind that allocates like an existing one is a
table in phase_kinds.toml and nothing else."""

from __future__ import annotations

import functools
import json
import subprocess
import sys

import pytest

from capture_plan.planner import BuildOptions, build_plan, plan_bytes, resources
from capture_plan.schemas.errors import InputError

# allocates like target_verify (the target over every token, hidden state returned)
NEW = b"""
[kinds.mtp_verify]
description = "a kind added by data alone"
program = "target"
returns_hidden = true
settings = ["layers"]
"""

PHASE = '[[phases]]\nname = "v"\nkind = "{kind}"\nsizes = [1, 4, 16]\ntokens_per_request = 4\nlayers = 2\n'


@pytest.fixture
def kinds_toml(data_file):
    """Replace phase_kinds.toml's bytes with the shipped ones plus ``extra``."""
    return functools.partial(data_file, "phase_kinds.toml")


def _spec(tmp_path, text: str):
    path = tmp_path / "spec.toml"
    path.write_text(text)
    return path


def test_a_phase_kind_added_by_a_data_file_alone_builds_like_the_kind_it_copies(kinds_toml, tmp_path, cli):
    kinds_toml(NEW)
    rule = (
        '[[rules]]\nid = "mtp-smallest"\nwhy = "test"\nwhen = { phase_kind = ["mtp_verify"] }\n'
        'require = [{ order = "smallest-first" }]\n'
    )
    plan = build_plan(BuildOptions(backend="fa3", spec=_spec(tmp_path, PHASE.format(kind="mtp_verify") + rule)))
    assert plan.phases[0].kind == "mtp_verify" and plan.phases[0].strategy.order == "smallest-first"
    same = build_plan(
        BuildOptions(
            backend="fa3",
            spec=_spec(tmp_path, PHASE.format(kind="target_verify") + rule.replace("mtp_verify", "target_verify")),
        )
    )
    assert plan.predicted.timeline == same.predicted.timeline and plan.predicted.pool_bytes > 0
    # the plan it writes loads again (the shared plan type takes any kind the planner accepted)
    from capture_plan.schemas.codec import decode_plan

    assert decode_plan(plan_bytes(plan), "p.json").phases[0].kind == "mtp_verify"
    # a setting the new kind does not list is refused, the fix naming the kinds that take it
    bad = _spec(tmp_path, PHASE.format(kind="mtp_verify") + "steps = 3\n")
    with pytest.raises(InputError, match=r"steps = 3 has no meaning for a mtp_verify phase") as err:
        build_plan(BuildOptions(backend="fa3", spec=bad))
    assert err.value.fix == "set steps on draft_decode phases only"
    # the spec's JSON Schema offers it, with its description
    code, out, _ = cli("schema", "spec")
    kind = json.loads(out)["$defs"]["Phase"]["properties"]["kind"]
    assert code == 0 and "mtp_verify" in kind["enum"]
    assert "mtp_verify: a kind added by data alone" in kind["description"]


def test_returns_hidden_is_read_from_the_data(kinds_toml, tmp_path):
    """The same kind without the hidden state returned predicts decode's pool, not target_verify's."""
    kinds_toml(NEW.replace(b"returns_hidden = true", b"returns_hidden = false"))
    spec = PHASE.replace("sizes = [1, 4, 16]", 'sizes = [1, 4, 16]\noutput_lifetime = "across-phases"')
    new, dec, ver = (
        build_plan(BuildOptions(backend="fa3", spec=_spec(tmp_path, spec.format(kind=k))))
        for k in ("mtp_verify", "decode", "target_verify")
    )
    assert new.predicted.timeline == dec.predicted.timeline != ver.predicted.timeline


def test_an_unknown_key_in_a_kind_table_names_file_and_key(kinds_toml, tmp_path):
    kinds_toml(NEW.replace(b"returns_hidden = true", b'returns_hidden = true\nlogits = "last"'))
    with pytest.raises(InputError, match=r"planner/data/phase_kinds.toml: \$\.kinds\.mtp_verify.*logits"):
        build_plan(BuildOptions(backend="fa3", spec=_spec(tmp_path, PHASE.format(kind="mtp_verify"))))


def test_an_unknown_program_or_setting_names_file_and_key(kinds_toml, tmp_path):
    kinds_toml(NEW.replace(b'program = "target"', b'program = "prefill"'))
    with pytest.raises(
        InputError,
        match=r"phase_kinds.toml: \$\.kinds\.mtp_verify\.program: unknown program "
        r"'prefill'",
    ) as err:
        build_plan(BuildOptions(backend="fa3", spec=_spec(tmp_path, PHASE.format(kind="mtp_verify"))))
    assert "draft_decode, draft_extend, hidden, piecewise, target" in err.value.fix
    kinds_toml(NEW.replace(b'settings = ["layers"]', b'settings = ["layers", "depth"]'))
    with pytest.raises(
        InputError, match=r"phase_kinds.toml: \$\.kinds\.mtp_verify: \$\.settings\[1\]: Invalid enum value 'depth'"
    ):
        build_plan(BuildOptions(backend="fa3", spec=_spec(tmp_path, PHASE.format(kind="mtp_verify"))))


def test_an_unknown_phase_kind_in_a_spec_is_located_and_lists_the_kinds(tmp_path, cli):
    code, _, err = cli("build", "-b", "fa3", "--spec", str(_spec(tmp_path, PHASE.format(kind="mtp_verify"))))
    assert code == 1 and "$.phases[0].kind: unknown phase kind 'mtp_verify'" in err
    assert "decode, draft_decode, draft_extend, full, piecewise, target_verify" in err
    rule = '[[rules]]\nid = "r"\nwhy = "w"\nwhen = { phase_kind = ["decode", "verify"] }\n'
    code, _, err = cli("build", "-b", "fa3", "--spec", str(_spec(tmp_path, PHASE.format(kind="decode") + rule)))
    assert code == 1 and "$.rules[0].when.phase_kind[1]: unknown phase kind 'verify'" in err


def test_the_speculative_presets_name_only_shipped_kinds():
    kinds = resources.phase_kinds()
    for name in ("eagle",):
        for phase in resources.data("presets.toml")["speculative"][name]["phases"]:
            assert phase["kind"] in kinds
    for phase in resources.data("presets_vllm.toml")["phases"]:
        assert phase["kind"] in kinds
    assert set(kinds) == {"decode", "target_verify", "draft_extend", "draft_decode", "full", "piecewise"}


def test_phase_kinds_schema_is_strict(cli):
    code, out, _ = cli("schema", "phase-kinds")
    schema = json.loads(out)["$defs"]
    assert code == 0 and schema["PhaseKind"]["additionalProperties"] is False
    assert schema["PhaseKind"]["properties"]["settings"]["items"]["enum"] == ["layers", "model", "steps", "topk"]
    code, out, _ = cli("schema", "plan")
    assert json.loads(out)["$defs"]["PhasePlan"]["properties"]["kind"]["enum"] == list(resources.phase_kinds())


def test_the_shared_schemas_still_import_without_the_planner():
    out = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys, capture_plan.schemas.codec, capture_plan.schemas.spec, "
            "capture_plan.schemas.plan\n"
            "print('capture_plan.planner' in sys.modules)",
        ],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert out.strip() == "False"


def test_a_new_kind_leaves_the_checked_in_plans_up_to_date(kinds_toml, cli, tmp_path):
    """phase_kinds.toml is not in the rules digest: adding a kind changes no existing plan.

    Every plan records the same rules digest, so the checked-in fa3-ci.json (one
    phase, 36 captures) fails as the speculative ones would with the file in the
    digest; the predictions of every shipped kind are held by an EAGLE plan at
    --max-bs 4, built with the shipped kinds before the new one is added (the
    checked-in EAGLE plans are such builds: `.ci/run` checks them)."""
    from pathlib import Path

    assert cli("build", "-b", "fa3", "--ci", "--speculative", "eagle", "--max-bs", "4")[0] == 0
    assert cli("build", "-b", "fa3", "--preset", "vllm", "--max-bs", "4")[0] == 0
    eagle, vllm = tmp_path / "plans" / "fa3-eagle-ci.json", tmp_path / "plans" / "fa3-vllm.json"
    assert {p["kind"] for f in (eagle, vllm) for p in json.loads(f.read_text())["phases"]} == set(
        resources.phase_kinds()
    )
    kinds_toml(NEW)
    plan = Path(__file__).resolve().parent.parent / "plans" / "fa3-ci.json"
    code, out, err = cli("check", str(plan), str(eagle), str(vllm))
    assert code == 0 and out.splitlines() == [f"{plan}: up to date", f"{eagle}: up to date", f"{vllm}: up to date"], err


def test_a_builtin_rule_naming_an_unknown_kind_is_located(data_file):
    """The shared Rule type takes any kind name; the planner checks its own rules.toml against the data."""
    data_file("rules.toml", b'\n[[rules]]\nid = "typo"\nwhy = "w"\nwhen = { phase_kind = ["decode", "verfy"] }\n')
    with pytest.raises(
        InputError,
        match=r"planner/data/rules.toml: \$\.rules\[\d+\]\.when\.phase_kind\[1\]: "
        r"unknown phase kind 'verfy'",
    ):
        resources.builtin_rules()
    data_file("rules.toml", b"")
    assert resources.builtin_rules()  # the shipped rules load
