"""The capture loop's cursor (capture_plan.executor.cursor), on checked-in plans, without torch.

Every case here needs no fixture and no torch: ``test_the_cursor_runs_without_torch``
runs them all again in a fresh interpreter and checks that torch was never imported
(this process has it: tests/conftest.py imports it to gate the GPU tests).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import msgspec
import pytest

from capture_plan.executor.cursor import Cursor, Warmups, selected
from capture_plan.executor.errors import ExecutorError
from capture_plan.executor.load import load_plan

ROOT = Path(__file__).resolve().parent.parent


def _plan(name: str):
    return load_plan(ROOT / "plans" / name, check_env=False)


def _walk(cur: Cursor) -> list[tuple[list, list, object]]:
    """Take every key the cursor captures, in its order: per capture, its provisions, warm-ups and key."""
    out = []
    for key in cur.keys():
        pp = cur.phase(key.phase, "test")
        pairs = cur.pairs(pp, dict(key.labels))
        cur.check(pp, key.bs, pairs)
        provisions, warmups, capture = cur.upcoming()
        assert capture is not None
        out.append((provisions, warmups, cur.take(capture, key.phase, key.bs, pairs)))
    return out


def case_the_cursor_walks_every_step_of_a_plan_in_order():
    plan = _plan("fa3-eagle-ci.json")
    cur = Cursor(plan)
    assert cur.phases == list(dict.fromkeys(s.phase for s in plan.steps if s.op == "capture"))
    walked = _walk(cur)
    seen = [s for prov, warm, _ in walked for s in prov + warm]
    captures = [s for s in plan.steps if s.op == "capture"]
    assert [k.id for _, _, k in walked] == [s.id for s in captures]
    assert seen == [s for s in plan.steps if s.op != "capture"]  # every provision and warm-up, once, in order
    assert cur.left() == [] and cur.unfinished() is None and cur.rest() == []
    assert cur.sizes("decode") == [s.bs for s in captures if s.phase == "decode"]
    tv = plan.phases[[p.name for p in plan.phases].index("target_verify")]
    assert all(k.tokens == k.bs * tv.tokens_per_request for k in cur.keys("target_verify"))


def case_a_key_out_of_the_plan_s_order_names_the_next_one():
    cur = Cursor(_plan("fa3-ci.json"))
    pp = cur.phase("decode", "test")
    cur.check(pp, 8, ())  # held: the plan captures it, later
    _, warmups, capture = cur.upcoming()
    assert [w.id for w in warmups] == ["warmup/decode/256"]
    with pytest.raises(ExecutorError, match=r"step 1 \(capture/decode/256\): .*decode/8 out of the plan's order"):
        cur.take(capture, "decode", 8, ())  # pyright: ignore[reportArgumentType]
    assert cur.next == 0  # nothing taken
    err = cur.unfinished()
    assert err is not None and "36 of the plan's captures not made" in str(err)


def case_keys_the_plan_does_not_hold_are_refused():
    cur = Cursor(_plan("fa3-sglang-lora.json"))
    with pytest.raises(ExecutorError, match=r"phase 'prefill' is not in the plan"):
        cur.phase("prefill", "CaptureLoop.step")
    pp = cur.phase("decode", "test")
    assert cur.labels("decode", 256) == [{"lora": "lora"}, {"lora": "nolora"}]
    with pytest.raises(ExecutorError, match=r"no label for 'lora'.*loop.step\('decode', bs, lora=...\)"):
        cur.pairs(pp, {})
    with pytest.raises(ExecutorError, match=r"no graph key decode/7/lora=lora"):
        cur.check(pp, 7, (("lora", "lora"),))


def case_a_piecewise_phase_without_a_piece_count_is_refused():
    # plans/fa3-vllm.json states its pieces since the vLLM preset models them: the same plan
    # with every piece count taken out is the one the cursor must refuse
    plan = _plan("fa3-vllm.json")
    unset = msgspec.UNSET
    plan = msgspec.structs.replace(
        plan,
        phases=[msgspec.structs.replace(p, pieces=unset) for p in plan.phases],
        steps=[msgspec.structs.replace(st, pieces=unset) for st in plan.steps],
    )
    cur = Cursor(plan)
    with pytest.raises(ExecutorError, match=r"phase 'piecewise' is 'piecewise' but the plan does not say"):
        cur.check(cur.phase("piecewise", "test"), cur.sizes("piecewise")[0], ())
    keyed = Cursor(_plan("fa3-vllm-keys.json"))
    keyed.check(keyed.phase("piecewise", "test"), keyed.sizes("piecewise")[0], ())  # its plan says 33 pieces


def case_a_profiling_pass_runs_the_first_keys_of_a_phase():
    plan = _plan("fa3-vllm-keys.json")
    steps = selected(plan, {"piecewise": 2})
    pieces = [s.id for s in steps if s.phase == "piecewise"]
    assert pieces == ["warmup/piecewise/512", "capture/piecewise/512", "warmup/piecewise/496", "capture/piecewise/496"]
    assert [s for s in steps if s.phase != "piecewise"] == [s for s in plan.steps if s.phase != "piecewise"]
    cur = Cursor(plan, {"piecewise": 2})
    assert cur.captures == len([s for s in steps if s.op == "capture"])
    _walk(cur)
    assert cur.profiled()["piecewise"] == 2
    with pytest.raises(ExecutorError, match=r"capture_loop\(profiling=\): the profiling pass names phase 'x'"):
        selected(plan, {"x": 1})


def case_warmups_are_recorded_once_each():
    plan = _plan("fa3-sglang-lora.json")
    first, other = plan.steps[0], plan.steps[3]
    w = Warmups([first])
    assert (w.runs, w.keeps, w.planned) == (1, first.keeps, (first,))
    assert w.select(None, "step 1") == [first] and w.select(first, "step 1") == [first]
    with pytest.raises(ExecutorError, match=r"step 1: capture/decode/248/lora=lora is not a warm-up of this step"):
        w.select(other, "step 1")
    w.done([first])
    assert w.pending == [] and w.select(None, "step 1") == []
    assert Warmups().keeps is None and Warmups().runs == 0


CASES = [f for name, f in sorted(globals().items()) if name.startswith("case_")]


@pytest.mark.parametrize("case", CASES, ids=[f.__name__ for f in CASES])
def test_cursor(case):
    case()


def test_the_cursor_runs_without_torch():
    """Each case again, in an interpreter that never imports torch."""
    code = (
        "import sys\n"
        f"sys.path.insert(0, {str(Path(__file__).parent)!r})\n"
        "import test_executor_cursor as t\n"
        "for case in t.CASES:\n    case()\n"
        "print(len(t.CASES), 'torch' in sys.modules)"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == [str(len(CASES)), "False"]
