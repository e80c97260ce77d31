"""The graph-key fields (schemas/key_fields.py): declared once, in :class:`KeyFields`, and a
new one is that one declaration (docs/development.md, "A new graph-key field").

The proof is :func:`test_one_declaration_is_a_new_key_field_end_to_end`: a copy of the
package with one more field declared in ``KeyFields`` and no other edit builds a spec
that sets it, records it in the plan, answers it in every step's key, matches an engine's
graph by it and explains its prediction. It fails if the build's copy, the plan's index,
``match_keys``, the per-key prediction or ``planner show`` name ``micro_batches`` by hand.
"""

from __future__ import annotations

import difflib
import inspect
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Annotated

import msgspec
import pytest

from capture_plan.adapters.plugins import core, vllm_keys
from capture_plan.adapters.plugins.hooks import HOOKS, KNOWN
from capture_plan.planner.report import render
from capture_plan.planner.schedule import keys as schedule_keys, pipeline
from capture_plan.schemas import keys as schema_keys
from capture_plan.schemas.key_fields import KEY_FIELDS, KeyFields, engine_fields, key_fields, shown
from capture_plan.schemas.plan import PLAN_REVISION, PhasePlan
from capture_plan.schemas.spec import Phase

ROOT = Path(__file__).resolve().parents[1]


def test_every_key_field_has_its_facts_and_is_a_field_of_both_phases():
    names = [f.name for f in msgspec.structs.fields(KeyFields)]
    assert list(KEY_FIELDS) == names == ["micro_batches"]
    for cls in (Phase, PhasePlan):
        assert issubclass(cls, KeyFields) and set(names) <= set(cls.__struct_fields__)
    assert all(1 <= f.revision <= PLAN_REVISION for f in KEY_FIELDS.values())


def test_a_field_declared_without_its_facts_is_refused_at_import():
    from capture_plan.schemas import key_fields as module

    class Bare(KeyFields, frozen=True, kw_only=True):
        spare: Annotated[int, msgspec.Meta(ge=1)] | msgspec.UnsetType = msgspec.UNSET

    with pytest.raises(TypeError, match=r"KeyFields.spare needs one KeyField\(...\)"):
        module._facts(Bare)


def test_a_key_spells_a_field_at_its_unset_value_as_unset():
    assert key_fields(Phase(name="f", kind="full", sizes=[1], micro_batches=1)) == KeyFields()
    assert key_fields(Phase(name="f", kind="full", sizes=[1], micro_batches=2)) == KeyFields(micro_batches=2)
    assert engine_fields("vllm", SimpleNamespace(num_ubatches=1)) == KeyFields()
    assert engine_fields("vllm", SimpleNamespace(num_ubatches=2)) == KeyFields(micro_batches=2)
    assert engine_fields("sglang", SimpleNamespace()) == KeyFields()  # no source: its unset value
    assert shown(KeyFields(micro_batches=2)) == " x2 micro-batches" and shown(KeyFields()) == ""


def test_a_key_answers_each_field_by_name_at_its_unset_value_too():
    """What engine code reads from a LoopStep's key (``step.key.value("micro_batches")``)."""
    assert schema_keys.GraphKey("f", 8).value("micro_batches") == 1
    assert schema_keys.GraphKey("f", 8, fields=KeyFields(micro_batches=2)).value("micro_batches") == 2
    with pytest.raises(KeyError):
        schema_keys.GraphKey("f", 8).value("num_ubatches")


def test_an_engine_key_matches_however_it_spells_a_field_at_its_unset_value(tmp_path):
    """A plugin that hands ``micro_batches=1`` (not UNSET) still matches the plan's keys,
    as before the key fields were a struct (its refusal would name keys that look equal)."""
    from capture_plan.planner.build import BuildOptions, build_plan

    (tmp_path / "s.toml").write_text('[[phases]]\nname = "f"\nkind = "full"\nsizes = [8, 16]\n')
    plan = build_plan(BuildOptions(backend="fa3", spec=tmp_path / "s.toml", output=tmp_path / "p.json"))
    for spelled in (KeyFields(), KeyFields(micro_batches=1)):
        keys = tuple(core.EngineKey("f", bs, (), spelled) for bs in (8, 16))
        matched, problems = core.match_keys(plan, core.EngineFacts("vllm", keys=keys))
        assert len(matched) == 2 and problems == [], (spelled, problems)


def test_a_kind_refuses_settings_in_the_settings_order_whichever_class_declares_them(tmp_path):
    """``steps`` and ``micro_batches`` on a decode phase: the error names ``steps``, first in
    PHASE_SETTINGS, as before KeyFields (a base class, whose fields come first) declared
    ``micro_batches``."""
    from capture_plan.planner.build import BuildOptions, build_plan
    from capture_plan.schemas.errors import InputError

    phase = '[[phases]]\nname = "d"\nkind = "decode"\nsizes = [1, 2]\nsteps = 2\nmicro_batches = 2\n'
    (tmp_path / "s.toml").write_text(phase)
    with pytest.raises(InputError, match=r"steps = 2 has no meaning for a decode phase") as err:
        build_plan(BuildOptions(backend="fa3", spec=tmp_path / "s.toml", output=tmp_path / "p.json"))
    assert err.value.where.endswith("$.phases[0].steps")


def test_each_engine_attribute_of_a_key_field_is_a_hook_row_of_every_release():
    """The plugin reads the attribute as the facts name it: each release's hook table
    (checked against the wheel by tests/test_engine_contract.py) must hold it."""
    for name, facts in KEY_FIELDS.items():
        for src in facts.engines:
            for version in KNOWN[src.engine]:
                rows = {(h.file, h.name) for h in HOOKS if (h.engine, h.version) == (src.engine, version)}
                assert (src.file, src.attribute) in rows, f"{name}: {src} is no hook row of {src.engine} {version}"


#: the code that copies, lists, answers or compares the key fields: none names one
GENERIC = [
    pipeline._phase_plan_keys,
    schedule_keys.uses_keys,
    schedule_keys.key_fidelity,
    schedule_keys.key_predictions,
    schema_keys._key,
    schema_keys.uses_graph_keys,
    schema_keys.needed_revision,
    core.match_keys,
    core.EngineKey,
    vllm_keys.engine_keys,
    render._approximate_keys,
]


@pytest.mark.parametrize("code", GENERIC, ids=lambda c: c.__qualname__)
def test_the_generic_code_names_no_key_field(code):
    assert not [name for name in KEY_FIELDS if name in inspect.getsource(code)]


#: one more key field, declared as the docs say: the only edit of the copy
SPARE = """
    #: a throw-away key field (tests/test_key_fields.py)
    spare_ways: (
        Annotated[
            int,
            msgspec.Meta(ge=1, le=8),
            KeyField(
                revision=5,
                shown="with {} spare ways",
                graphs="keep {} spare ways",
                approximate="as if they kept none",
                unmodelled="the spare ways",
                engines=(EngineSource(engine="vllm", file="vllm/spare.py", attribute="Descriptor.spare_ways"),),
            ),
        ]
        | msgspec.UnsetType
    ) = msgspec.UNSET
"""

#: run in the copy: build, plan, index, engine match, planner show, bound
SCRIPT = """
import json, sys
from pathlib import Path
from types import SimpleNamespace
from typing import Annotated

from capture_plan.adapters.plugins import core
from capture_plan.executor.load import load_plan
from capture_plan.planner.build import BuildOptions, build_plan
from capture_plan.planner.report.render import device_lines
from capture_plan.schemas.codec import canonical_bytes
from capture_plan.schemas.errors import InputError
from capture_plan.schemas.keys import PlanIndex, needed_revision, uses_graph_keys
import capture_plan
import msgspec

work = Path(sys.argv[1])
assert Path(capture_plan.__file__).is_relative_to(work), capture_plan.__file__  # the copy, not the checkout
head = '[model]\\npreset = "llama-3-8b"\\nlayers = 2\\n[[phases]]\\nname = "f"\\nkind = "full"\\nsizes = [8, 16]\\n'
(work / "s.toml").write_text(head + "spare_ways = 3\\n")
built = build_plan(BuildOptions(backend="fa3", spec=work / "s.toml", output=work / "p.json"))
(work / "p.json").write_bytes(canonical_bytes(built))  # as planner build writes it
plan = load_plan(work / "p.json", check_env=False)
out = {"recorded": json.loads((work / "p.json").read_text())["phases"][0].get("spare_ways")}
out["revision"] = plan.revision
unkeyed = msgspec.structs.replace(plan, predicted=msgspec.structs.replace(plan.predicted, keys=[]))
out["uses_graph_keys"] = uses_graph_keys(unkeyed)  # by the phase's field alone
out["needed_revision"] = needed_revision(unkeyed, base=2)
out["fidelity"] = sorted((k.step, k.fidelity) for k in plan.predicted.keys)
captures = [s for s in plan.steps if s.op == "capture"]
out["keys"] = sorted((s.id, PlanIndex.of(plan).key(s).fields.spare_ways) for s in captures)
out["show"] = device_lines(plan)[-1]

def engine(spare):
    keys = tuple(
        core.EngineKey("f", s.bs, (), core.key_fields_of("vllm", SimpleNamespace(num_ubatches=1, spare_ways=spare)))
        for s in captures
    )
    matched, problems = core.match_keys(plan, core.EngineFacts("vllm", keys=keys))
    return len(matched), problems

out["engine_3"], out["engine_2"] = engine(3), engine(2)
(work / "s.toml").write_text(head + "spare_ways = 9\\n")
try:
    build_plan(BuildOptions(backend="fa3", spec=work / "s.toml", output=work / "q.json"))
except InputError as err:
    out["bound"] = str(err)
print(json.dumps(out))
"""


def _copy_with_one_more_field(dest: Path) -> Path:
    """The package copied to ``dest/capture_plan`` with :data:`SPARE` declared after the
    last field of ``KeyFields`` (its class is the module's last), and nothing else changed."""
    ignore = shutil.ignore_patterns(".*", "__pycache__", "tests", "bench", "docs", "plans", "build", "*.so")
    pkg = Path(shutil.copytree(ROOT, dest / "capture_plan", ignore=ignore))
    module = pkg / "schemas/key_fields.py"
    text = module.read_text()
    cls = text.index("class KeyFields(")
    end = text.index("\n\n\ndef ", cls)  # the class's last line, before the first function after it
    module.write_text(text[:end] + "\n" + SPARE.strip("\n") + text[end:])
    changed = [line for line in difflib.ndiff(text.splitlines(), module.read_text().splitlines()) if line[0] in "+-"]
    assert changed == ["+ " + line for line in SPARE.strip("\n").splitlines()]  # one insertion, nothing else
    return pkg


def test_one_declaration_is_a_new_key_field_end_to_end(tmp_path):
    _copy_with_one_more_field(tmp_path / "pkg")
    run = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(tmp_path)],
        capture_output=True,
        text=True,
        # the copy first: packages found only through PYTHONPATH (msgspec on the device) stay found
        env={
            "PYTHONPATH": os.pathsep.join([str(tmp_path / "pkg"), os.environ.get("PYTHONPATH", "")]),
            "PATH": "/usr/bin:/bin",
        },
        cwd=tmp_path,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    out = json.loads(run.stdout.splitlines()[-1])
    assert out["recorded"] == 3  # the build copied it from the spec's phase to the plan's
    assert out["uses_graph_keys"] is True
    # a plan that sets it is written as the field's revision at least (the copy says 5)
    assert out["needed_revision"] == out["revision"] == 5
    assert out["keys"] == [["capture/f/16", 3], ["capture/f/8", 3]]  # the index answers it in each key
    assert out["fidelity"] == [["capture/f/16", "approximate"], ["capture/f/8", "approximate"]]
    assert out["show"] == (
        "  graph keys: 2 of 2 approximate (e.g. capture/f/16): f's graphs keep 3 spare ways, "
        "each predicted as if they kept none"
    )
    assert out["engine_3"] == [2, []]  # an engine's graphs with its value match the plan's keys
    matched, problems = out["engine_2"]
    assert (
        matched == 0 and "vllm captures 2 graphs the plan does not hold (f/16 tokens with 2 spare ways" in problems[0]
    )
    assert "$.phases[0].spare_ways: spare_ways = 9 is over the limit of 8" in out["bound"]  # its bound
