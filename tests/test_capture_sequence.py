"""The capture sequence (planner/schedule/sequence.py, schemas/capture_sequence.py): one value,
built in one place, that every stage of a build reads instead of ordering captures again."""

from __future__ import annotations

import ast
from pathlib import Path

import msgspec
import pytest

from capture_plan.planner.build import BuildOptions, build_plan
from capture_plan.planner.schedule import pipeline, sequence
from capture_plan.planner.schedule.resolve import resolve
from capture_plan.schemas.capture_sequence import Capture, CaptureSequence
from capture_plan.schemas.plan import Strategy
from capture_plan.schemas.spec import Phase
from test_graph_keys import LORA_SPEC, TWIN_SPEC

ROOT = Path(__file__).resolve().parents[1]
#: a twin of a phase with variants (tests/test_graph_keys.py)
TWIN_VARIANTS = TWIN_SPEC.replace(
    'after = ["piecewise"]', 'after = ["piecewise"]\nvariants = { loras = ["0", "1"] }'
).replace('twin_of = "full"', 'twin_of = "full"\nvariants = { loras = ["0", "1"] }')


def _calls(name: str) -> list[str]:
    """The planner modules (relative paths) with a call of a function called ``name``."""
    found = []
    for path in sorted((ROOT / "planner").rglob("*.py")):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Call):
                f = node.func
                called = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else None
                if called == name:
                    found.append(path.relative_to(ROOT).as_posix())
    return found


def test_a_phases_keys_are_ordered_at_one_call_site():
    """The composition size order -> key order -> simulator key lives in the sequence's
    builder only: every other stage reads the sequence it built."""
    assert _calls("key_sequence") == ["planner/schedule/sequence.py"]
    # Capture.key spells a capture's key; keys.py asks for a size's shared program by its key alone
    assert _calls("capture_key") == ["planner/schedule/keys.py"]
    # sizes alone, without keys: the builder, and the forced orders' cycle check (planner/schedule/resolve.py)
    assert sorted(_calls("capture_order")) == ["planner/schedule/resolve.py", "planner/schedule/sequence.py"]


def test_the_build_pipeline_parses_no_step_id():
    """Labels travel in the sequence: no module that orders, predicts or prices a build's
    captures reads them back out of an id (a report's measurements are read by theirs)."""
    for path in [*(ROOT / "planner" / "schedule").glob("*.py"), ROOT / "planner" / "sizes" / "pricing.py"]:
        text = path.read_text()
        assert "parse_step_id" not in text, path
        assert 'id.partition("/")' not in text, path


def _build(tmp_path, text: str, **kw):
    spec = tmp_path / "s.toml"
    spec.write_text(text)
    return BuildOptions(backend="fa3", spec=spec, output=tmp_path / "p.json", **kw)


@pytest.mark.parametrize(
    "spec,kw",
    [
        (None, {"speculative": "eagle"}),
        (LORA_SPEC, {}),
        (LORA_SPEC, {"strategies": ["order=smallest-first"]}),
        (TWIN_SPEC, {"strategies": ["warmup=every-size"]}),
        (TWIN_VARIANTS, {}),
    ],
    ids=["eagle", "lora", "lora-smallest-first", "twin", "twin-variants"],
)
def test_the_plan_captures_its_sequence_built_once(tmp_path, monkeypatch, spec, kw):
    """A build makes its plan's sequence once (the optimizer's per pool and the engines' loop
    are other strategies or sizes), and the plan's capture steps, sizes and per-key
    predictions are that sequence, in its order."""
    if spec is None:
        opts = BuildOptions(backend="fa3", ci=True, output=tmp_path / "p.json", **kw)
    else:
        opts = _build(tmp_path, spec, **kw)
    built: list[CaptureSequence] = []
    made = pipeline._build

    def counting(r, sol):
        b = made(r, sol)
        built.append(b.sequence)
        return b

    monkeypatch.setattr(pipeline, "_build", counting)
    plan = build_plan(opts)
    assert len(built) == 1
    (seq,) = built
    assert [s.id for s in plan.steps if s.op == "capture"] == list(seq.ids)
    for p in plan.phases:
        assert p.sizes == list(seq.sizes[p.name])
        assert {c.pool for c in seq.phase(p.name)} == {p.pool}
    if plan.predicted.keys:
        assert [k.step for k in plan.predicted.keys] == list(seq.ids)
    # each warm-up runs right before a capture the sequence says has one, at its size
    steps = plan.steps
    warmed = [c for c in seq.captures if c.warmup is not None]
    runs = [s for s in steps if s.op == "warmup"]
    assert [s.bs for s in runs] == [c.warmup for c in warmed]


def test_a_twin_and_its_stream_are_in_the_sequence(tmp_path):
    r = resolve(_build(tmp_path, TWIN_SPEC))
    b = pipeline._build(r, pipeline._optimize(r))
    twin = b.sequence.phase("full_ubatch")
    assert {c.stream for c in twin} == {"ubatch"}
    assert all(c.stream is None for c in b.sequence.phase("full"))
    keys = [(c.phase, c.bs) for c in b.sequence.captures if c.phase != "piecewise"]
    assert keys[:4] == [("full", 64), ("full_ubatch", 64), ("full", 48), ("full_ubatch", 48)]
    # the engines' loop: the twin after its phase
    loop = sequence.capture_sequence([r.by_name[n] for n in r.sequence], b.strategies, twins=False)
    assert [c.phase for c in loop.captures if c.phase != "piecewise"][-3:] == ["full_ubatch"] * 3


def test_the_sequence_orders_sizes_keys_and_warmups():
    phase = Phase(name="d", kind="decode", sizes=[1, 4, 2], variants={"lora": ["a", "b"]})
    seq = sequence.capture_sequence(
        [phase], {"d": Strategy(order="smallest-first", warmup="once-per-phase", key_order="variant-major")}
    )
    assert [(c.bs, c.labels) for c in seq.captures] == [
        (1, (("lora", "a"),)),
        (2, (("lora", "a"),)),
        (4, (("lora", "a"),)),
        (1, (("lora", "b"),)),
        (2, (("lora", "b"),)),
        (4, (("lora", "b"),)),
    ]
    # once per phase: one warm-up, at the largest size, before the first capture
    assert [c.warmup for c in seq.captures] == [4, None, None, None, None, None]
    assert seq.sizes == {"d": (1, 2, 4)}
    assert seq.captures[0].id == "capture/d/1/lora=a"
    assert seq.captures[0].key == ("d", 1, (("lora", "a"),))
    # a value: frozen, comparable, and the same built twice
    assert seq == sequence.capture_sequence(
        [phase], {"d": Strategy(order="smallest-first", warmup="once-per-phase", key_order="variant-major")}
    )
    with pytest.raises(AttributeError):
        seq.captures[0].bs = 3  # pyright: ignore[reportAttributeAccessIssue]
    assert msgspec.json.decode(msgspec.json.encode(seq), type=CaptureSequence) == seq
    assert Capture(phase="d", bs=2).key == ("d", 2)


def test_a_forced_order_other_than_the_chosen_one_is_the_same_keys_reordered():
    """The step graph chains a forced order that is not the chosen one (a cycle, reported as
    the rules in conflict) from the phase's captures, as the sequence would order them."""
    from capture_plan.planner.schedule.graph import _reordered

    phase = Phase(name="d", kind="decode", sizes=[1, 4, 2], variants={"lora": ["a", "b"]})
    for key_order in ("size-major", "variant-major"):

        def keys(order: str, key_order: str = key_order) -> list:
            st = Strategy(order=order, key_order=key_order)  # pyright: ignore[reportArgumentType]
            return [(c.bs, c.labels) for c in sequence.capture_sequence([phase], {"d": st}).captures]

        assert _reordered(keys("largest-first"), "smallest-first", key_order) == keys("smallest-first")
        assert _reordered(keys("smallest-first"), "largest-first", key_order) == keys("largest-first")
