"""Knowledge as typed data (planner/data/*.toml): phase kinds and vLLM's conventions (backends: tests/test_backends.py).

Phase kinds are typed data: a kind that allocates like an existing one is a
table in phase_kinds.toml and nothing else.

vLLM's conventions as data (issue 18, item 4): the ``--preset vllm`` sizes and
phases, the ``full`` and ``piecewise`` kinds' programs, and per-phase model
dimensions for drafts (``[phases.model]``)."""

from __future__ import annotations

import contextlib
import functools
import json
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest

from capture_plan.planner import BuildOptions, build_plan, plan_bytes
from capture_plan.planner.inputs import resources
from capture_plan.planner.inputs.resources import backend
from capture_plan.planner.inputs.specs import default_spec, engine_preset, engine_rules, model_presets
from capture_plan.planner.inputs.validate import decode_spec_sources
from capture_plan.planner.memory.analytic import analytic_program
from capture_plan.schemas.codec import canonical_bytes
from capture_plan.schemas.errors import InputError
from capture_plan.schemas.spec import Choice, Model, Phase

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
    assert schema["PhaseKind"]["properties"]["settings"]["items"]["enum"] == [
        "layers",
        "micro_batches",
        "model",
        "pieces",
        "steps",
        "topk",
        "twin_of",
    ]
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


ROOT = Path(__file__).resolve().parents[1]


DATA = Path(__file__).resolve().parent / "data"


def vllm_default_sizes(max_size: int) -> list[int]:
    """vLLM's VllmConfig._set_cudagraph_sizes, written out as it is there."""
    sizes = [i for i in [1, 2, 4] if i <= max_size]
    if max_size >= 8:
        sizes += list(range(8, min(max_size + 1, 256), 8))
    if max_size >= 256:
        sizes += list(range(256, max_size + 1, 16))
    return sizes


@pytest.mark.parametrize("max_bs", [None, 1, 7, 8, 255, 256, 300, 512, 1024])
def test_preset_sizes_are_vllms(max_bs):
    spec = default_spec(preset="vllm", max_bs=max_bs)
    want = vllm_default_sizes(512 if max_bs is None else max_bs)
    assert [p.name for p in spec.phases] == ["piecewise", "full_decode"]  # vLLM's capture order
    assert [p.kind for p in spec.phases] == ["piecewise", "full"]
    # max_num_seqs 1024 (an H100 / H200's default) bounds the uniform-decode sizes only above 1024
    assert sorted(spec.phases[0].sizes) == want == sorted(spec.phases[1].sizes)
    assert all(p.tokens_per_request == 1 for p in spec.phases)


def test_uniform_decode_sizes_are_bounded_by_max_num_seqs(monkeypatch):
    with _preset_edited(monkeypatch, lambda b: b.replace(b"max_num_seqs = 1024", b"max_num_seqs = 256")):
        spec = default_spec(preset="vllm")
    assert sorted(spec.phases[0].sizes) == vllm_default_sizes(512)
    assert sorted(spec.phases[1].sizes) == vllm_default_sizes(256)  # <= max_num_seqs * 1 token


def test_the_preset_file_is_strict(monkeypatch):
    with _preset_edited(monkeypatch, lambda b: b + b'\n[[phases]]\nname = "x"\nkind = "full"\ncudagraph = 1\n'):
        with pytest.raises(InputError, match=r"planner/data/presets_vllm.toml: \$\.phases\[2\].*cudagraph"):
            default_spec(preset="vllm")


@contextlib.contextmanager
def _preset_edited(monkeypatch, edit):
    """presets_vllm.toml as ``edit(bytes)`` returns it, every data cache cleared; both undone
    on leaving (the edit is never seen by another test)."""
    real = resources.data_bytes
    monkeypatch.setattr(resources, "data_bytes", lambda n: edit(real(n)) if n == "presets_vllm.toml" else real(n))
    resources.data.cache_clear()
    try:
        yield
    finally:
        monkeypatch.undo()
        resources.data.cache_clear()


def test_vllms_capture_order_is_typed_data_with_its_sources():
    facts = engine_preset("vllm").capture
    assert facts.release == "0.33.0"
    # cudagraph_utils.py CudaGraphManager.capture: `for mode in [PIECEWISE, FULL]`
    assert facts.mode_order == ["piecewise", "full"]
    # store_capture_output allocates on first use; every warm-up (PIECEWISE ones first) stores:
    # the release file's fact, which the preset reads (one owner)
    assert engine_preset("vllm").releases[facts.release].persistent_buffer == "first-warmup"
    # _init_candidates appends each FULL descriptor's twin right after it
    assert facts.micro_batch_twin == "after-its-graph"
    assert (facts.warmups_per_graph, facts.default_micro_batch_twins, facts.twin_min_tokens) == (1, False, 32)
    fields = {f.name for f in msgspec.structs.fields(facts)} - {"sources"}
    assert set(facts.sources) == fields
    for fact, source in facts.sources.items():
        assert source.startswith("vllm"), fact  # a file of the wheel


def test_a_capture_fact_without_its_source_is_refused(monkeypatch):
    with _preset_edited(monkeypatch, lambda b: b.replace(b'\ntwin_min_tokens = """', b'\nnot_a_fact = """')):
        with pytest.raises(
            InputError, match=r"presets_vllm.toml: \$\.capture.*facts without a source: twin_min_tokens"
        ):
            engine_preset("vllm")


def test_the_preset_chains_its_phases_in_vllms_mode_order():
    """vLLM captures every PIECEWISE descriptor before any FULL one, whatever each needs: the
    preset's FULL phase comes `after` the PIECEWISE one, so the planner cannot reorder them."""
    spec = default_spec(preset="vllm")
    assert [(p.name, p.after) for p in spec.phases] == [("piecewise", []), ("full_decode", ["piecewise"])]
    raw = json.loads((ROOT / "plans/fa3-vllm.json").read_bytes())
    order = next(d for d in raw["decisions"] if d["rule"] == "phase-order")
    assert order["constraint"] == "after: full_decode after piecewise"
    assert order["choice"] == "piecewise -> full_decode"


def test_preset_phases_out_of_the_mode_order_are_refused(monkeypatch):
    swap = b'name = "piecewise"\nkind = "piecewise"'
    # a full phase has no pieces: the piecewise phase's go with its kind
    full = b'name = "piecewise"\nkind = "full"'
    with _preset_edited(monkeypatch, lambda b: b.replace(swap, full, 1).replace(b'pieces = "attention"\n', b"")):
        # full, then full: in order; a piecewise kind after a full one is not
        assert [p.after for p in default_spec(preset="vllm").phases] == [[], []]
    reordered = b'mode_order = ["full", "piecewise"]'
    with _preset_edited(monkeypatch, lambda b: b.replace(b'mode_order = ["piecewise", "full"]', reordered)):
        with pytest.raises(InputError, match=r"presets_vllm.toml: \$\.phases\[1\]: a full phase after a piecewise"):
            default_spec(preset="vllm")


def test_the_keyed_vllm_spec_follows_the_capture_facts():
    """plans/specs/vllm-keys.toml against presets_vllm.toml's [capture]: the phases in the mode
    order, each after the ones before, and the persistent buffer kept by the first warm-up of
    the whole capture, which the checked-in plan records on its very first warm-up step."""
    facts = engine_preset("vllm").capture
    path = ROOT / "plans/specs/vllm-keys.toml"
    spec = decode_spec_sources(path.read_bytes(), str(path), presets=model_presets())[0]
    preset = default_spec(preset="vllm")
    assert [(p.name, p.kind, p.after, p.sizes) for p in spec.phases] == [
        (p.name, p.kind, p.after, p.sizes) for p in preset.phases
    ]
    ranks = [facts.mode_order.index(p.kind) for p in spec.phases]
    assert ranks == sorted(ranks)
    assert engine_preset("vllm").releases[facts.release].persistent_buffer == "first-warmup"
    assert [p.name for p in spec.phases if p.warmup_keeps is not msgspec.UNSET] == [spec.phases[0].name]
    raw = json.loads((ROOT / "plans/fa3-vllm-keys.json").read_bytes())
    warmups = [s for s in raw["steps"] if s["op"] == "warmup"]
    assert warmups[0]["index"] == 0 and warmups[0]["phase"] == "piecewise"
    assert [s["id"] for s in raw["steps"] if "keeps" in s] == [warmups[0]["id"]] == ["warmup/piecewise/512"]


def test_vllm_plans_warm_up_once_before_every_graph_as_vllm_does():
    """CudaGraphManager.capture runs one ``forward_fn(CUDAGraphMode.NONE)`` per descriptor
    (the fact warmups_per_graph = 1): --preset vllm's embedded spec carries the rule, the
    keyed spec repeats it word for word, and both checked-in plans put one warm-up right
    before each capture (they had one warm-up per phase: 2 for 102 captures)."""
    rules = engine_rules("vllm")
    assert default_spec(preset="vllm").rules == rules
    assert [r.require for r in rules] == [[Choice(warmup="every-size")]]
    path = ROOT / "plans/specs/vllm-keys.toml"
    spec = decode_spec_sources(path.read_bytes(), str(path), presets=model_presets())[0]
    assert spec.rules == rules
    for name in ("fa3-vllm.json", "fa3-vllm-keys.json"):
        steps = json.loads((ROOT / "plans" / name).read_bytes())["steps"]
        pairs = [
            (a["op"], b["op"], a["phase"], a["bs"]) == ("warmup", "capture", b["phase"], b["bs"])
            for a, b in zip(steps, steps[1:])
        ]
        captures = sum(s["op"] == "capture" for s in steps)
        assert sum(pairs) == captures == sum(s["op"] == "warmup" for s in steps) == 102, name
        assert all(s["runs"] == 1 for s in steps if s["op"] == "warmup")


def test_the_h200_defaults_give_51_sizes_up_to_512():
    """vllm/config/vllm.py _set_cudagraph_sizes with arg_utils.py's H100/H200 defaults (max_num_seqs
    1024; max_num_batched_tokens 8192 for the API server, 16384 for the LLM class): the largest
    size is min(1024 * 1 * 2, 512) = 512, below both token budgets (not appended), and 1024
    requests exceed it (no uniform-decode size appended): 3 + 31 + 17 sizes."""
    preset = engine_preset("vllm")
    largest = min(preset.max_num_seqs * 1 * 2, 512, 8192)
    assert preset.max_bs == largest == 512
    sizes = default_spec(preset="vllm").phases[0].sizes
    assert len(sizes) == 51 and max(sizes) == 512 and sorted(sizes) == vllm_default_sizes(512)


def test_the_checked_in_vllm_plan_records_its_command():
    raw = json.loads((ROOT / "plans/fa3-vllm.json").read_bytes())
    assert raw["command"] == ["planner", "build", "--backend", "fa3", "--preset", "vllm"]
    assert raw["inputs"]["spec"] == "embedded:default-vllm" and raw["inputs"]["max_bs"] == 512
    assert [(p["name"], p["kind"], len(p["sizes"])) for p in raw["phases"]] == [
        ("piecewise", "piecewise", 51),
        ("full_decode", "full", 51),
    ]


def test_preset_options(cli):
    assert cli("build", "-b", "fa3", "--preset", "vllm", "--max-bs", "16")[0] == 0
    raw = json.loads(Path("plans/fa3-vllm.json").read_bytes())
    assert raw["command"][-2:] == ["--max-bs", "16"]
    assert cli("check", "plans/fa3-vllm.json")[1] == "plans/fa3-vllm.json: up to date\n"
    # the preset's own default --max-bs is not recorded
    assert cli("build", "-b", "fa3", "--preset", "vllm", "--max-bs", "512", "--force")[0] == 0
    assert json.loads(Path("plans/fa3-vllm.json").read_bytes())["command"][-1] == "vllm"


@pytest.mark.parametrize(
    "args,needle",
    [
        (["--preset", "sglang"], "--preset: unknown preset 'sglang'; fix: use one of vllm"),
        (["--preset", ""], "--preset: unknown preset ''"),
        (["--preset", "vllm", "--speculative", "eagle"], "--speculative: --speculative shapes SGLang's embedded spec"),
        # --preset over --spec builds (issue 49, item 10: test_cli_spec.py); --speculative with it does not
        (
            ["--preset", "vllm", "--spec", "s.toml", "--speculative", "eagle"],
            "--speculative eagle choose the embedded spec's phases and sizes",
        ),
        (["--preset", "vllm", "--max-bs", "0"], "--max-bs: must be 1..65536"),
    ],
)
def test_bad_preset_options_are_one_line(cli, tmp_path, args, needle):
    (tmp_path / "s.toml").write_text('[[phases]]\nname = "d"\nkind = "decode"\nsizes = [1]\n')
    code, out, err = cli("build", "-b", "fa3", *args, "--dry-run")
    assert code == 1 and err.count("\n") == 1 and needle in err, err
    assert not (tmp_path / "plans").exists()


def test_vllm_programs_have_no_logits_and_piecewise_no_attention_internals():
    model, fa3 = Model(), backend("fa3")
    full = Phase(name="f", kind="full", sizes=[64])
    pw = Phase(name="p", kind="piecewise", sizes=[64])
    decode = Phase(name="d", kind="decode", sizes=[64])

    def allocs(phase):
        return [e for e in analytic_program(model, phase, 64, fa3).flatten() if e.op == "alloc"]

    f, p, d = allocs(full), allocs(pw), allocs(decode)
    vocab_sized = {64 * model.vocab * n for n in (2, 4)}
    assert not {e.size for e in f + p} & vocab_sized and {e.size for e in d} & vocab_sized
    # fa3's scheduler-metadata workspace and log-sum-exp live in the pool only when attention is in the graph
    assert any(e.kind == "workspace" for e in f) and not any(e.kind == "workspace" for e in p)
    lse = 64 * model.heads * 4
    assert sum(e.size == lse for e in f) == model.layers and not any(e.size == lse for e in p)
    # the one output: the final-normed hidden state
    assert (
        [e.size for e in f if e.kind == "output"]
        == [e.size for e in p if e.kind == "output"]
        == [64 * model.hidden * model.dtype_bytes]
    )
    # the piecewise capture is the full one without attention's own allocations
    inside = {e.size for e in f} - {e.size for e in p}
    assert inside <= {lse, *(e.size for e in f if e.kind == "workspace")} | {
        int(64 * model.heads * model.head_dim * fa3.attention_temp_factor)
    }


# per-phase model dimensions ---------------------------------------------------------------
DRAFT = """
[[phases]]
name = "draft_decode"
kind = "draft_decode"
sizes = [1, 8, 32]
steps = 3
topk = 4
layers = 1
"""


def _build(tmp_path, text: str, name: str = "s.toml"):
    path = tmp_path / name
    path.write_text(text)
    return build_plan(BuildOptions(backend="fa3", spec=path, output=tmp_path / "p.json"))


def test_a_phase_with_its_own_dimensions_predicts_as_a_model_of_them(tmp_path):
    own = _build(tmp_path, DRAFT + "model = { hidden = 2048, vocab = 32000 }\n")
    same = _build(tmp_path, '[model]\npreset = "llama-3-8b"\nhidden = 2048\nvocab = 32000\n' + DRAFT)
    target = _build(tmp_path, DRAFT)
    assert own.predicted.timeline == same.predicted.timeline
    assert own.predicted.pool_bytes < target.predicted.pool_bytes


def test_the_eagle3_example_spec_builds(tmp_path):
    spec = decode_spec_sources(
        (DATA / "eagle3.toml").read_bytes(),
        "eagle3.toml",
        presets=model_presets(),
    )[0]
    drafts = [p for p in spec.phases if p.kind.startswith("draft")]
    assert drafts and all(p.model is not msgspec.UNSET and p.model.vocab == 32000 for p in drafts)
    plan = build_plan(BuildOptions(backend="fa3", spec=DATA / "eagle3.toml", output=tmp_path / "p.json"))
    plain = build_plan(BuildOptions(backend="fa3", spec=_write_without_models(tmp_path), output=tmp_path / "q.json"))
    assert plan.predicted.pool_bytes != plain.predicted.pool_bytes


def _write_without_models(tmp_path) -> Path:
    text = "\n".join(
        line for line in (DATA / "eagle3.toml").read_text().splitlines() if not line.startswith("model = ")
    )
    path = tmp_path / "plain.toml"
    path.write_text(text)
    return path


def test_a_phase_without_its_own_dimensions_encodes_as_before():
    phase = Phase(name="d", kind="decode", sizes=[1])
    assert b"model" not in canonical_bytes(phase)
    phases = json.loads(canonical_bytes(default_spec("eagle")))["phases"]
    assert phases and not any("model" in p for p in phases)  # the embedded spec's digest is unchanged


@pytest.mark.parametrize(
    "extra,needle",
    [
        (
            '[[phases]]\nname = "d"\nkind = "decode"\nsizes = [1]\nmodel = { vocab = 32000 }\n',
            "s.toml: $.phases[1].model: model has no meaning for a decode phase; fix: set model on draft_decode or "
            "draft_extend phases only",
        ),
        ("model = {}\n", "s.toml: $.phases[0].model: model sets no dimension"),
        ("model = { layers = 1 }\n", "s.toml: $.phases[0].model: Object contains unknown field `layers`"),
        ("model = { vocab = 0 }\n", "s.toml: $.phases[0].model.vocab: Expected `int` >= 1"),
        ('model = { vocab = "32k" }\n', "s.toml: $.phases[0].model.vocab: Expected `int`"),
        ("model = { vocab = 100000000 }\n", "s.toml: $.phases[0].model.vocab: vocab = 100000000 is over the limit"),
        ("model = { heads = 12 }\n", "s.toml: $.phases[0].model.heads: heads = 12 must be a multiple of kv_heads = 8"),
        ("model = { heads = 32, kv_heads = 5 }\n", "s.toml: $.phases[0].model.kv_heads: heads = 32 must be a multiple"),
    ],
)
def test_bad_phase_models_are_one_located_line(cli, tmp_path, extra, needle):
    (tmp_path / "s.toml").write_text(DRAFT + extra)
    code, out, err = cli("build", "-b", "fa3", "--spec", "s.toml")
    assert code == 1 and err.count("\n") == 1 and needle in err, err
    assert not (tmp_path / "plans").exists()


def test_tp_must_divide_a_drafts_own_dimensions(cli, tmp_path):
    (tmp_path / "s.toml").write_text(DRAFT + "model = { heads = 24, kv_heads = 8, intermediate = 6000 }\n")
    code, out, err = cli("build", "-b", "fa3", "--spec", "s.toml", "--tp", "16")
    assert code == 1 and err.count("\n") == 1, err
    assert "--tp (phase 'draft_decode', its own model: $.phases[0].model): tp=16 does not divide heads=24" in err


def test_a_data_file_is_read_from_its_parsed_copy_only_where_the_copy_is_of_its_bytes(tmp_path, monkeypatch):
    """An installed package reads each data file's copy parsed at build time (setup.py),
    not tomllib's parse; a copy of other bytes (the file edited since) is ignored, and the
    file is parsed as it is now, so the TOML stays the one source."""
    import hashlib

    raw = b"answer = 42\n"
    (tmp_path / "x.toml").write_bytes(raw)
    copy = tmp_path / ("x.toml" + resources.PARSED_SUFFIX)
    monkeypatch.setattr(resources, "_DATA", tmp_path)
    read = resources.data.__wrapped__  # not the process's cache of the real files
    assert read("x.toml") == {"answer": 42}  # no copy: parsed here
    # a copy of these bytes is read as it is (a different value shows it was the copy)
    copy.write_text(json.dumps({"sha256": hashlib.sha256(raw).hexdigest(), "data": {"answer": 43}}))
    assert read("x.toml") == {"answer": 43}
    # the file edited after the build: its copy is of other bytes, and ignored
    (tmp_path / "x.toml").write_bytes(b"answer = 44\n")
    assert read("x.toml") == {"answer": 44}
    copy.write_text("not json")  # a broken copy is no copy
    assert read("x.toml") == {"answer": 44}
