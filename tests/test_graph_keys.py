"""Graph keys (issue 28): a plan step captures a phase, a size and one label per variant
axis; step ids spell the key; the plan codec refuses keys that do not fit their phase."""

from __future__ import annotations

import json
from pathlib import Path

import msgspec
import pytest

from capture_plan.schemas.codec import canonical_bytes, decode_plan, plan_digest
from capture_plan.schemas.errors import InputError
from capture_plan.schemas.keys import (
    capture_memory,
    expand_labels,
    needed_revision,
    order_labels,
    step_id,
    uses_graph_keys,
)
from capture_plan.schemas.plan import INPUTS_REVISION, PhasePlan, Strategy, VariantAxis

ROOT = Path(__file__).resolve().parents[1]


def _phase(**kw) -> PhasePlan:
    return PhasePlan(
        name="decode",
        kind="decode",
        sizes=[2, 1],
        tokens_per_request=1,
        output_lifetime="next-replay",
        strategy=Strategy(),
        pool="shared",
        **kw,
    )


def test_step_ids_spell_every_axis_in_declared_order():
    assert step_id("capture", "decode", 64) == "capture/decode/64"
    labels = (("lora", "nolora"), ("attention", "a"))
    assert step_id("capture", "decode", 64, labels) == "capture/decode/64/lora=nolora,attention=a"


def test_labels_expand_first_axis_outermost_in_label_order():
    combos = expand_labels([("lora", ["lora", "nolora"]), ("attention", ["a", "b"])])
    assert combos == [
        (("lora", "lora"), ("attention", "a")),
        (("lora", "lora"), ("attention", "b")),
        (("lora", "nolora"), ("attention", "a")),
        (("lora", "nolora"), ("attention", "b")),
    ]
    assert expand_labels([]) == [()]


def test_an_engine_call_is_put_in_the_phase_axis_order_and_checked():
    ph = _phase(variants=[VariantAxis(name="lora", labels=["lora", "nolora"]), VariantAxis(name="attn", labels=["a"])])
    assert order_labels(ph, {"attn": "a", "lora": "nolora"}) == (("lora", "nolora"), ("attn", "a"))
    with pytest.raises(ValueError, match="no variant axis 'tp'"):
        order_labels(ph, {"attn": "a", "lora": "nolora", "tp": "x"})
    with pytest.raises(ValueError, match="no label for 'attn'"):
        order_labels(ph, {"lora": "nolora"})
    with pytest.raises(ValueError, match=r"lora='dense' is not a label"):
        order_labels(ph, {"attn": "a", "lora": "dense"})
    with pytest.raises(ValueError, match="it has no variant axes"):
        order_labels(_phase(), {"lora": "lora"})


def _resealed(raw: dict) -> bytes:
    raw = {**raw, "digest": ""}
    raw["digest"] = plan_digest(raw)
    return canonical_bytes(raw)


def test_a_checked_in_plan_uses_no_graph_keys():
    plan = decode_plan((ROOT / "plans/fa3-ci.json").read_bytes(), "fa3-ci.json")
    assert not uses_graph_keys(plan)
    # graph keys need no more than revision 2; its model and rules records need 4
    assert needed_revision(plan) == 2 and plan.revision == INPUTS_REVISION == 4


def test_labels_on_a_phase_without_variants_are_refused_located():
    raw = json.loads((ROOT / "plans/fa3-ci.json").read_bytes())
    i = next(i for i, s in enumerate(raw["steps"]) if s["op"] == "capture")
    raw["steps"][i]["labels"] = ["lora"]
    with pytest.raises(InputError) as err:
        decode_plan(_resealed(raw), "p.json")
    assert err.value.where == f"p.json: $.steps[{i}].labels"
    assert "has no variant axes" in err.value.what


def test_a_profiling_pass_gets_the_whole_capture_with_its_items():
    plan = decode_plan((ROOT / "plans/fa3-ci-h200.json").read_bytes(), "p.json")
    mem = capture_memory(plan)
    assert plan.predicted.device is not None
    assert [i.name for i in mem.items] == [i.name for i in plan.predicted.device.items]
    known = [i.bytes for i in mem.items if i.bytes is not None]
    assert mem.bytes == (plan.predicted.device.total_bytes if mem.complete else sum(known))
    assert mem.bytes >= plan.predicted.pool_bytes
    assert msgspec.json.decode(msgspec.json.encode(mem))["items"][0]["name"] == "pool"


# --- planner side: spec, expansion, order, per-key prediction, bad input -------------

LORA_SPEC = """\
name = "keys"
[model]
preset = "llama-3-8b"
layers = 2
[[phases]]
name = "decode"
kind = "decode"
sizes = [1, 2, 4]
variants = { lora = ["lora", "nolora"], attention = ["b", "a"] }
"""


def _build(tmp_path, text: str, **kw):
    from capture_plan.planner.build import BuildOptions, build_plan

    spec = tmp_path / "s.toml"
    spec.write_text(text)
    return build_plan(BuildOptions(backend="fa3", spec=spec, output=tmp_path / "p.json", **kw))


def test_variant_axes_keep_the_order_written_and_expand_per_size(tmp_path):
    plan = _build(tmp_path, LORA_SPEC)
    phase = plan.phases[0]
    assert phase.variants is not msgspec.UNSET
    assert [(a.name, a.labels) for a in phase.variants] == [("lora", ["lora", "nolora"]), ("attention", ["b", "a"])]
    captures = [s.id for s in plan.steps if s.op == "capture"]
    # size-major (the default): per size, largest first, every variant in the order written
    assert captures[:5] == [
        "capture/decode/4/lora=lora,attention=b",
        "capture/decode/4/lora=lora,attention=a",
        "capture/decode/4/lora=nolora,attention=b",
        "capture/decode/4/lora=nolora,attention=a",
        "capture/decode/2/lora=lora,attention=b",
    ]
    assert len(captures) == 3 * 2 * 2
    assert plan.revision == 4 and phase.strategy.key_order == "size-major"
    # the plan reads back through the codec (ids, labels, every key captured once)
    decode_plan(canonical_bytes(plan), "p.json")


def test_a_rule_sets_the_key_order_and_two_that_disagree_conflict(tmp_path):
    from capture_plan.schemas.errors import ConstraintError

    rule = '[[rules]]\nid = "{id}"\nwhy = "w"\nrequire = [{{ key_order = "{order}" }}]\n'
    plan = _build(tmp_path, LORA_SPEC + rule.format(id="per-variant", order="variant-major"))
    captures = [s.id for s in plan.steps if s.op == "capture"]
    assert captures[:3] == [
        "capture/decode/4/lora=lora,attention=b",
        "capture/decode/2/lora=lora,attention=b",
        "capture/decode/1/lora=lora,attention=b",
    ]
    assert plan.phases[0].strategy.key_order == "variant-major"
    decision = next(d for d in plan.decisions if d.choice.startswith("key_order="))
    assert decision.rule == "per-variant"
    assert any(e.rule == "per-variant" for e in plan.edges)
    with pytest.raises(ConstraintError, match="per-variant requires key_order=variant-major, per-size requires"):
        _build(
            tmp_path,
            LORA_SPEC
            + rule.format(id="per-variant", order="variant-major")
            + rule.format(id="per-size", order="size-major"),
        )


def test_keys_of_one_size_share_its_program_and_labels_the_reference_lacks_are_approximate(tmp_path):
    plain = _build(
        tmp_path, LORA_SPEC.replace('variants = { lora = ["lora", "nolora"], attention = ["b", "a"] }\n', "")
    )
    keyed = _build(tmp_path, LORA_SPEC.replace(', attention = ["b", "a"]', ""))
    keys = {k.step: k for k in keyed.predicted.keys}
    assert list(keys) == [s.id for s in keyed.steps if s.op == "capture"]
    assert keys["capture/decode/4/lora=nolora"].fidelity == "reference"
    assert keys["capture/decode/4/lora=lora"].fidelity == "approximate"
    assert keys["capture/decode/4/lora=lora"].graph_bytes == keys["capture/decode/4/lora=nolora"].graph_bytes
    # the growth where each key is captured adds up to the pool
    assert sum(k.added_bytes for k in keyed.predicted.keys) == keyed.predicted.pool_bytes
    # a plan without graph keys records none (its revision is its model record's)
    assert plain.predicted.keys == [] and plain.revision == 4 and not uses_graph_keys(plain)
    assert keyed.predicted.largest_graph_bytes == plain.predicted.largest_graph_bytes


def test_the_sglang_lora_plan_keeps_its_first_warmups_outputs_as_a_device_item():
    plan = decode_plan((ROOT / "plans/fa3-sglang-lora.json").read_bytes(), "p.json")
    assert plan.phases[0].warmup_keeps == "outputs"
    kept = [s for s in plan.steps if s.keeps is not msgspec.UNSET]
    assert [s.op for s in kept] == ["warmup"]
    # the float32 logits of the largest size (llama-3-8b: 128256 vocab)
    assert kept[0].keeps == 256 * 128256 * 4
    assert plan.predicted.device is not None
    item = next(i for i in plan.predicted.device.items if i.name == "warmup-kept")
    assert item.bytes == kept[0].keeps
    mem = capture_memory(plan)
    assert "warmup-kept" in [i.name for i in mem.items] and len(mem.keys) == 2 * 36
    assert {k.fidelity for k in mem.keys} == {"reference", "approximate"}


def test_the_vllm_preset_with_keys_predicts_per_piece_and_leaves_the_pool_unchanged():
    keyed = decode_plan((ROOT / "plans/fa3-vllm-keys.json").read_bytes(), "k.json")
    plain = decode_plan((ROOT / "plans/fa3-vllm.json").read_bytes(), "p.json")
    assert [(p.name, p.sizes) for p in keyed.phases] == [(p.name, p.sizes) for p in plain.phases]
    assert [len(p.sizes) for p in keyed.phases] == [51, 51]
    # the graph keys change no prediction of the plan without them
    assert keyed.predicted.timeline == plain.predicted.timeline
    assert keyed.predicted.pool_bytes == plain.predicted.pool_bytes
    pieces = [k for k in keyed.predicted.keys if k.step.startswith("capture/piecewise/")]
    assert len(pieces) == 51 and keyed.phases[0].pieces == 32 + 1
    for k in pieces:
        assert len(k.pieces) == 33 and sum(k.pieces) == k.graph_bytes, k.step
    full = [k for k in keyed.predicted.keys if k.step.startswith("capture/full_decode/")]
    assert len(full) == 51 and all(k.pieces == [] for k in full)
    # the FULL graphs' persistent buffer (the final-normed hidden state at 512 tokens) is kept by
    # the first warm-up of the whole capture, the largest PIECEWISE descriptor's (vLLM's
    # store_capture_output allocates on first use, and every warm-up stores its output)
    assert sum(k.kept_bytes for k in full) == 0
    assert [k.kept_bytes for k in pieces] == [512 * 4096 * 2] + [0] * 50
    first = next(s for s in keyed.steps if s.op == "warmup")
    assert (first.index, first.id, first.keeps) == (0, "warmup/piecewise/512", 512 * 4096 * 2)
    assert [s.id for s in keyed.steps if s.keeps is not msgspec.UNSET] == [first.id]


def test_a_piece_count_the_model_does_not_give_is_predicted_whole(tmp_path):
    spec = '[model]\npreset = "llama-3-8b"\nlayers = 2\n[[phases]]\nname = "p"\nkind = "piecewise"\nsizes = [8, 16]\n'
    spec += "pieces = {n}\n"
    plan = _build(tmp_path, spec.format(n=3))
    assert all(s.pieces == 3 for s in plan.steps if s.op == "capture")
    assert all(len(k.pieces) == 3 and sum(k.pieces) == k.graph_bytes for k in plan.predicted.keys)
    plan = _build(tmp_path, spec.format(n=5))
    assert all(k.pieces == [] and k.graph_bytes > 0 for k in plan.predicted.keys)


@pytest.mark.parametrize(
    "phase,where,what,fix",
    [
        (
            'kind = "draft_decode"\nvariants = { lora = ["lora", "nolora"] }',
            "$.phases[0].variants.lora",
            "a draft_decode phase cannot have the variant axis 'lora' (its axes are attention)",
            "declare lora on decode or target_verify phases only",
        ),
        (
            'kind = "decode"\nvariants = { lora = ["lora", "lora"] }',
            "$.phases[0].variants.lora[1]",
            "duplicate label 'lora' (also $.phases[0].variants.lora[0])",
            "list each label once",
        ),
        (
            'kind = "decode"\npieces = 3',
            "$.phases[0].pieces",
            "pieces = 3 has no meaning for a decode phase",
            "set pieces on piecewise phases only",
        ),
    ],
)
def test_bad_variants_are_one_located_line_with_a_fix(cli, tmp_path, phase, where, what, fix):
    (tmp_path / "s.toml").write_text(f'[[phases]]\nname = "d"\nsizes = [1, 2]\n{phase}\n')
    code, out, err = cli("build", "-b", "fa3", "--spec", "s.toml")
    assert (code, out) == (1, "")
    assert err == f"planner: error: s.toml: {where}: {what}; fix: {fix}\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s.toml"]  # nothing written


def test_too_many_keys_per_phase_is_refused_with_the_product(cli, tmp_path):
    from capture_plan.schemas.limits import MAX_KEYS_PER_PHASE

    sizes = list(range(1, 1025))
    labels = [f"l{i}" for i in range(16)]
    (tmp_path / "s.json").write_text(
        json.dumps({"phases": [{"name": "d", "kind": "decode", "sizes": sizes, "variants": {"lora": labels}}]})
    )
    code, _, err = cli("build", "-b", "fa3", "--spec", "s.json")
    assert code == 1
    assert err == (
        f"planner: error: s.json: $.phases[0].variants: 16384 graph keys (1024 sizes x 16 lora), over the limit "
        f"of {MAX_KEYS_PER_PHASE} per phase; fix: capture fewer sizes or fewer labels\n"
    )


def test_the_spec_schema_publishes_the_variant_limits():
    from capture_plan.planner.inputs.schema import json_schema
    from capture_plan.schemas.limits import MAX_KEYS_PER_PHASE, MAX_LABELS_PER_AXIS, MAX_VARIANT_AXES

    variants = json.loads(json_schema("spec"))["$defs"]["Phase"]["properties"]["variants"]
    assert variants["maxProperties"] == MAX_VARIANT_AXES
    assert variants["x-max-keys-per-phase"] == MAX_KEYS_PER_PHASE
    assert variants["additionalProperties"]["maxItems"] == MAX_LABELS_PER_AXIS


def _keyed_raw() -> dict:
    return json.loads((ROOT / "plans/fa3-sglang-lora.json").read_bytes())


@pytest.mark.parametrize(
    "edit,where,what",
    [
        (lambda r: r["steps"][1].update(labels=["dense"]), "$.steps[1].labels[0]", "'dense' is not a label"),
        (lambda r: r["steps"][1].pop("labels"), "$.steps[1].labels", "no labels for phase 'decode'"),
        (lambda r: r["steps"][1].update(pieces=3), "$.steps[1].pieces", "pieces = 3 where the plan says no pieces"),
        (lambda r: r["steps"][1].update(keeps=1), "$.steps[1].keeps", "a capture step keeps bytes"),
        (
            lambda r: r["predicted"]["keys"][0].update(step="capture/decode/1/lora=lora"),
            "$.predicted.keys[0].step",
            "key prediction for 'capture/decode/1/lora=lora'",
        ),
    ],
)
def test_a_keyed_plan_that_does_not_fit_its_phase_is_refused_located(edit, where, what):
    raw = _keyed_raw()
    edit(raw)
    with pytest.raises(InputError) as err:
        decode_plan(_resealed(raw), "p.json")
    assert err.value.where == f"p.json: {where}"
    assert what in err.value.what


def test_a_graph_key_left_out_is_named():
    raw = _keyed_raw()
    i = next(i for i, s in enumerate(raw["steps"]) if s["id"] == "capture/decode/1/lora=nolora")
    del raw["steps"][i]
    for j, s in enumerate(raw["steps"]):
        s["index"] = j
    raw["predicted"]["timeline"] = [{**m, "step": j} for j, m in enumerate(raw["predicted"]["timeline"][:-1])]
    raw["predicted"]["keys"] = [k for k in raw["predicted"]["keys"] if k["step"] != "capture/decode/1/lora=nolora"]
    raw["edges"] = [e for e in raw["edges"] if "capture/decode/1/lora=nolora" not in (e["src"], e["dst"])]
    with pytest.raises(InputError) as err:
        decode_plan(_resealed(raw), "p.json")
    assert err.value.where == "p.json: $.phases[0].sizes"
    assert "graph key(s) capture/decode/1/lora=nolora that no capture step captures" in err.value.what


def test_a_step_id_parses_back_to_its_key():
    from capture_plan.schemas.keys import parse_step_id

    labels = (("lora", "nolora"), ("attention", "a"))
    assert parse_step_id(step_id("warmup", "decode", 64, labels)) == ("warmup", "decode", 64, labels)
    assert parse_step_id("capture/decode/8") == ("capture", "decode", 8, ())
    for bad in ("capture/decode", "capture/decode/x", "capture/decode/8/lora", "capture/decode/8/a=b/c"):
        with pytest.raises(ValueError):
            parse_step_id(bad)


def test_show_lists_each_steps_key_and_says_how_many_keys_are_approximate(cli):
    code, out, _ = cli("show", str(ROOT / "plans/fa3-sglang-lora.json"))
    assert code == 0
    assert "graph keys: 36 of 72 approximate (e.g. capture/decode/256/lora=lora)" in out
    rows = [ln.split() for ln in out.splitlines() if ln.split()[:2] in (["1", "capture"], ["2", "capture"])]
    assert [r[4] for r in rows] == ["lora=lora", "lora=nolora"]
    code, out, _ = cli("show", str(ROOT / "plans/fa3.json"))
    header = next(ln.split() for ln in out.splitlines() if ln.startswith("#"))
    assert header[:4] == ["#", "op", "phase", "bs"] and "key" not in header  # no key column without keys


def _keyed_trace(tmp_path, labelled: dict[int, dict[str, str]], plain: bool = True, extra: int = 64 << 20) -> Path:
    """A trace of LORA_SPEC's decode phase (one axis) from the analytic model, with labelled
    captures (size -> labels) that allocate ``extra`` more when their label is `lora`."""
    from capture_plan.planner.inputs.resources import backend
    from capture_plan.planner.memory.analytic import analytic_capture
    from capture_plan.schemas.spec import Model, Phase
    from capture_plan.schemas.trace import Event, Trace

    model = Model(layers=2)
    phase = Phase(name="decode", kind="decode", sizes=[1, 2, 4])
    caps = [analytic_capture(model, phase, bs, backend("fa3")) for bs in (1, 2, 4)] if plain else []
    for bs, labels in labelled.items():
        cap = analytic_capture(model, phase, bs, backend("fa3"))
        events = list(cap.events)
        if labels["lora"] == "lora":  # the LoRA graph's own scratch: a temporary the plain one lacks
            n = max(e.id for e in events) + 1
            events = [Event(op="alloc", id=n, size=extra), Event(op="free", id=n), *events]
        caps.append(msgspec.structs.replace(cap, events=events, labels=labels))
    path = tmp_path / "t.json"
    path.write_bytes(msgspec.json.encode(Trace(backend="fa3", captures=caps)))
    return path


def test_a_recorded_key_is_predicted_from_its_own_program(tmp_path):
    from capture_plan.planner.build import BuildOptions, build_plan

    spec = tmp_path / "s.toml"
    spec.write_text(LORA_SPEC.replace(', attention = ["b", "a"]', ""))
    trace = _keyed_trace(tmp_path, {4: {"lora": "lora"}})
    plan = build_plan(BuildOptions(backend="fa3", spec=spec, trace=trace, output=tmp_path / "p.json"))
    keys = {k.step: k for k in plan.predicted.keys}
    own, plain = keys["capture/decode/4/lora=lora"], keys["capture/decode/4/lora=nolora"]
    assert own.fidelity == "recorded" and plain.fidelity == "recorded"
    # its 64 MiB scratch comes first, then the plain graph reuses part of it
    assert own.graph_bytes >= 64 << 20 and own.graph_bytes > plain.graph_bytes
    # a LoRA key the trace did not record: its size's program, approximate
    assert keys["capture/decode/2/lora=lora"].fidelity == "approximate"
    assert keys["capture/decode/2/lora=lora"].graph_bytes == keys["capture/decode/2/lora=nolora"].graph_bytes
    assert plan.predicted.pool_bytes >= own.graph_bytes


def test_keys_the_reference_models_stand_for_the_phase_when_a_trace_has_only_keys(tmp_path):
    from capture_plan.planner.build import BuildOptions, build_plan

    spec = tmp_path / "s.toml"
    spec.write_text(LORA_SPEC.replace(', attention = ["b", "a"]', ""))
    only_keys = {bs: {"lora": "nolora"} for bs in (1, 2, 4)}
    plan_keys = build_plan(
        BuildOptions(
            backend="fa3", spec=spec, trace=_keyed_trace(tmp_path, only_keys, plain=False), output=tmp_path / "p.json"
        )
    )
    plan_plain = build_plan(
        BuildOptions(backend="fa3", spec=spec, trace=_keyed_trace(tmp_path, {}), output=tmp_path / "p.json")
    )
    assert plan_keys.predicted.pool_bytes == plan_plain.predicted.pool_bytes
    assert [k.graph_bytes for k in plan_keys.predicted.keys] == [k.graph_bytes for k in plan_plain.predicted.keys]


def test_a_trace_key_the_spec_does_not_declare_is_refused_located(tmp_path):
    from capture_plan.planner.build import BuildOptions, build_plan

    spec = tmp_path / "s.toml"
    spec.write_text(LORA_SPEC.replace(', attention = ["b", "a"]', ""))
    trace = _keyed_trace(tmp_path, {4: {"lora": "dense"}})
    with pytest.raises(InputError) as err:
        build_plan(BuildOptions(backend="fa3", spec=spec, trace=trace, output=tmp_path / "p.json"))
    assert err.value.where == f"{trace}: $.captures[3].labels.lora"
    assert "'dense' is not a label of axis 'lora'" in err.value.what


def test_a_micro_batched_phase_on_its_own_stream_records_both_and_is_approximate(tmp_path):
    spec = '[model]\npreset = "llama-3-8b"\nlayers = 2\n[[phases]]\nname = "f"\nkind = "full"\nsizes = [8, 16]\n'
    plan = _build(tmp_path, spec + 'micro_batches = 2\nstream = "ubatch"\n')
    assert plan.phases[0].micro_batches == 2
    assert {s.stream for s in plan.steps if s.op in ("capture", "warmup")} == {"ubatch"}
    assert {k.fidelity for k in plan.predicted.keys} == {"approximate"}
    plain = _build(tmp_path, spec)
    assert {s.stream for s in plain.steps} == {"capture"} and plain.revision == 4


# -- micro-batch twins (twin_of) ------------------------------------------------------

TWIN_SPEC = """[model]
preset = "llama-3-8b"
layers = 2
[[phases]]
name = "piecewise"
kind = "piecewise"
sizes = [1, 8, 32, 48, 64]
pieces = "attention"
warmup_keeps = "outputs"
[[phases]]
name = "full"
kind = "full"
sizes = [1, 8, 32, 48, 64]
after = ["piecewise"]
[[phases]]
name = "full_ubatch"
kind = "full"
sizes = [32, 48, 64]
twin_of = "full"
micro_batches = 2
stream = "ubatch"
"""


def _captures(plan, *phases: str) -> list[tuple[str, int]]:
    return [(s.phase, s.bs) for s in plan.steps if s.op == "capture" and s.phase in phases]


def test_a_micro_batch_twin_is_captured_right_after_its_graph_of_each_size(tmp_path):
    """vLLM 0.33.0 appends each FULL descriptor's micro-batch twin right after it
    (cudagraph_utils.py CudaGraphManager._init_candidates; presets_vllm.toml [capture]):
    the twin's graphs interleave with their phase's, each warm-up just before its capture,
    rather than forming a phase captured after the FULL one."""
    from capture_plan.planner.inputs.specs import engine_preset

    assert engine_preset("vllm").capture.micro_batch_twin == "after-its-graph"
    plan = _build(tmp_path, TWIN_SPEC, strategies=["warmup=every-size"])
    assert _captures(plan, "full", "full_ubatch") == [
        ("full", 64),
        ("full_ubatch", 64),
        ("full", 48),
        ("full_ubatch", 48),
        ("full", 32),
        ("full_ubatch", 32),
        ("full", 8),
        ("full", 1),
    ]
    ids = [s.id for s in plan.steps]
    for bs in (64, 48, 32):
        i = ids.index(f"capture/full/{bs}")
        assert ids[i + 1 : i + 3] == [f"warmup/full_ubatch/{bs}", f"capture/full_ubatch/{bs}"]
    assert {s.stream for s in plan.steps if s.phase == "full_ubatch"} == {"ubatch"}
    rule = {(e.src, e.dst): e.rule for e in plan.edges}
    assert rule[("capture/full/64", "warmup/full_ubatch/64")] == "twin_of:full_ubatch"
    assert rule[("capture/full_ubatch/64", "capture/full/48")] == "twin_of:full_ubatch"
    assert [p.name for p in plan.phases] == ["piecewise", "full", "full_ubatch"]
    (decision,) = [d for d in plan.decisions if d.rule == "twin_of"]
    assert (decision.phase, decision.constraint) == ("full_ubatch", "twin_of = full")
    (order,) = [d for d in plan.decisions if d.rule == "phase-order"]
    assert order.why.startswith("the spec fixes this order (full after piecewise; full_ubatch twin of full); ")
    # the persistent buffer: the first warm-up of the whole capture keeps it, the twins' keep nothing
    assert [s.id for s in plan.steps if s.keeps is not msgspec.UNSET] == ["warmup/piecewise/64"]
    # per-key growth follows the interleaved order: it adds up to the pool
    assert sum(k.added_bytes for k in plan.predicted.keys) == plan.predicted.pool_bytes


def test_a_twin_follows_its_phase_s_order_and_refuses_another(tmp_path, cli):
    plan = _build(tmp_path, TWIN_SPEC, strategies=["full.order=smallest-first"])
    assert [p.strategy.order for p in plan.phases] == ["largest-first", "smallest-first", "smallest-first"]
    assert _captures(plan, "full", "full_ubatch") == [
        ("full", 1),
        ("full", 8),
        ("full", 32),
        ("full_ubatch", 32),
        ("full", 48),
        ("full_ubatch", 48),
        ("full", 64),
        ("full_ubatch", 64),
    ]
    own = _build(tmp_path, TWIN_SPEC, strategies=["full_ubatch.pool=own"])
    assert own.phases[2].pool != own.phases[1].pool
    assert _captures(own, "full", "full_ubatch")[:3] == [("full", 64), ("full_ubatch", 64), ("full", 48)]
    (tmp_path / "s.toml").write_text(TWIN_SPEC)
    code, out, err = cli("build", "-b", "fa3", "--spec", "s.toml", "-s", "full_ubatch.order=smallest-first")
    assert (code, out) == (1, "")
    assert err == (
        "planner: error: --strategy full_ubatch.order=smallest-first: twin phase 'full_ubatch' captures in "
        "phase 'full''s order (largest-first), not smallest-first; fix: pin full.order instead\n"
    )


def test_a_twin_built_plan_checks_up_to_date_from_its_command(tmp_path, cli):
    (tmp_path / "s.toml").write_text(TWIN_SPEC)
    assert cli("build", "-b", "fa3", "--spec", "s.toml", "-o", "p.json")[0] == 0
    assert cli("check", "p.json") == (0, "p.json: up to date\n", "")


def test_show_says_a_micro_batch_twin_is_one_and_how_its_memory_is_predicted(tmp_path, cli):
    """A twin's keys are approximate because the model runs the batch whole, not because
    of a label: ``show`` names the twin, the graph it is the twin of, and what predicts it."""
    (tmp_path / "s.toml").write_text(TWIN_SPEC)
    assert cli("build", "-b", "fa3", "--spec", "s.toml", "-o", "p.json")[0] == 0
    code, out, _ = cli("show", "p.json")
    assert code == 0 and "does not model" not in out
    assert (
        "  graph keys: 3 of 13 approximate (e.g. capture/full_ubatch/64): full_ubatch holds the micro-batch "
        "twins of full's graphs (vLLM's DBO twin: its graphs run the batch as 2 micro-batches, captured right after "
        "full's graph of its size), each predicted as full's graph of that size: the reference runs the "
        "batch whole, not split\n"
    ) in out
    keys = {k.step: k.graph_bytes for k in decode_plan((tmp_path / "p.json").read_bytes(), "p.json").predicted.keys}
    assert all(keys[f"capture/full_ubatch/{bs}"] == keys[f"capture/full/{bs}"] for bs in (32, 48, 64))


def test_show_says_how_a_micro_batched_phase_and_a_traced_twin_are_predicted(tmp_path):
    from capture_plan.planner.inputs.resources import backend
    from capture_plan.planner.memory.analytic import analytic_capture
    from capture_plan.planner.report.render import device_lines
    from capture_plan.schemas.spec import Model, Phase
    from capture_plan.schemas.trace import Trace

    spec = '[model]\npreset = "llama-3-8b"\nlayers = 2\n[[phases]]\nname = "f"\nkind = "full"\nsizes = [8, 16]\n'
    plan = _build(tmp_path, spec + "micro_batches = 2\n")
    assert device_lines(plan)[-1] == (
        "  graph keys: 2 of 2 approximate (e.g. capture/f/16): f's graphs run the batch as 2 micro-batches, "
        "each predicted as the whole batch of its size: the reference runs the batch whole, not split"
    )
    model = Model(layers=2)
    caps = [
        analytic_capture(model, Phase(name=name, kind=kind, sizes=sizes), bs, backend("fa3"))
        for name, kind, sizes in (
            ("piecewise", "piecewise", [1, 8, 32, 48, 64]),
            ("full", "full", [1, 8, 32, 48, 64]),
            ("full_ubatch", "full", [32, 48, 64]),
        )
        for bs in sizes
    ]
    trace = tmp_path / "t.json"
    trace.write_bytes(msgspec.json.encode(Trace(backend="fa3", captures=caps)))
    traced = _build(tmp_path, TWIN_SPEC, trace=trace)
    assert device_lines(traced)[-1].endswith(
        "captured right after full's graph of its size), each predicted from the trace's full_ubatch captures, "
        "approximate: the planner does not model the split"
    )


def test_after_naming_a_twin_waits_for_its_phase_and_a_cycle_through_one_is_located(tmp_path, cli):
    extra = '[[phases]]\nname = "late"\nkind = "full"\nsizes = [4]\nafter = ["full_ubatch"]\n'
    plan = _build(tmp_path, TWIN_SPEC + extra)
    assert [s.phase for s in plan.steps if s.op == "capture"][-1] == "late"
    assert [p.name for p in plan.phases] == ["piecewise", "full", "full_ubatch", "late"]
    (tmp_path / "s.toml").write_text(
        TWIN_SPEC.replace('pieces = "attention"', 'pieces = "attention"\nafter = ["full_ubatch"]')
    )
    code, out, err = cli("build", "-b", "fa3", "--spec", "s.toml")
    assert (code, out) == (1, "")
    assert err.startswith("planner: error: s.toml: $.phases[") and "rules in conflict: after:" in err, err


def test_twins_of_a_phase_with_variants_follow_each_key(tmp_path):
    spec = TWIN_SPEC.replace('after = ["piecewise"]', 'after = ["piecewise"]\nvariants = { loras = ["0", "1"] }')
    spec = spec.replace('twin_of = "full"', 'twin_of = "full"\nvariants = { loras = ["0", "1"] }')
    plan = _build(tmp_path, spec)
    keys = [s.id for s in plan.steps if s.op == "capture" and s.phase != "piecewise"][:6]
    assert keys == [
        "capture/full/64/loras=0",
        "capture/full_ubatch/64/loras=0",
        "capture/full/64/loras=1",
        "capture/full_ubatch/64/loras=1",
        "capture/full/48/loras=0",
        "capture/full_ubatch/48/loras=0",
    ]


@pytest.mark.parametrize(
    "edit,where,what,fix",
    [
        (
            ('twin_of = "full"', 'twin_of = "fulll"'),
            "$.phases[2].twin_of",
            "unknown phase 'fulll'; phases are ['full', 'full_ubatch', 'piecewise']",
            "name the phase whose graphs this one is the micro-batch twin of",
        ),
        (
            ('twin_of = "full"', 'twin_of = "full_ubatch"'),
            "$.phases[2].twin_of",
            "a phase cannot be its own twin",
            "leave twin_of out",
        ),
        (
            ("sizes = [32, 48, 64]", "sizes = [32, 40]"),
            "$.phases[2].sizes[1]",
            "size 40 is not one of phase 'full''s: a twin's graph is the twin of one of its graphs",
            "capture only sizes that 'full' captures",
        ),
        (
            ('twin_of = "full"', 'twin_of = "full"\nafter = ["piecewise"]'),
            "$.phases[2].after",
            "a twin is captured with phase 'full', so it has no `after` of its own",
            "leave after out (put it on 'full')",
        ),
        (
            ('twin_of = "full"', 'twin_of = "full"\ntokens_per_request = 2'),
            "$.phases[2].tokens_per_request",
            "tokens_per_request = 2 differs from its phase's (1): a twin runs the same batches",
            "set tokens_per_request = 1",
        ),
        (
            ('twin_of = "full"', 'twin_of = "full"\nvariants = { loras = ["0"] }'),
            "$.phases[2].variants",
            "variants differ from phase 'full''s: a twin has a graph per key of its phase",
            "give it the variants of 'full'",
        ),
        (
            ('pieces = "attention"', 'pieces = "attention"\ntwin_of = "full"'),
            "$.phases[0].twin_of",
            "twin_of has no meaning for a piecewise phase",
            "set twin_of on full phases only",
        ),
    ],
)
def test_bad_twins_are_one_located_line_with_a_fix(cli, tmp_path, edit, where, what, fix):
    (tmp_path / "s.toml").write_text(TWIN_SPEC.replace(*edit))
    code, out, err = cli("build", "-b", "fa3", "--spec", "s.toml")
    assert (code, out) == (1, "")
    assert err == f"planner: error: s.toml: {where}: {what}; fix: {fix}\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s.toml"]  # nothing written


def test_a_twin_of_a_twin_and_a_second_twin_are_refused(cli, tmp_path):
    second = '[[phases]]\nname = "again"\nkind = "full"\nsizes = [32]\ntwin_of = "{of}"\n'
    for of, what in [
        ("full", "phase 'full' already has a twin ($.phases[2]); fix: give each phase one micro-batch twin at most"),
        ("full_ubatch", "phase 'full_ubatch' is itself a twin (of 'full'); fix: name 'full', the phase whose"),
    ]:
        (tmp_path / "s.toml").write_text(TWIN_SPEC + second.format(of=of))
        code, _, err = cli("build", "-b", "fa3", "--spec", "s.toml")
        assert code == 1 and err.startswith(f"planner: error: s.toml: $.phases[3].twin_of: {what}"), err
