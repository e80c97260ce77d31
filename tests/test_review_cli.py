"""Findings of the fresh-eyes robustness review of the planner as a CI tool.

Each test failed before the fix it names: bad input gives one located line and
exit 1, nothing is lost, and a plan checks clean right after it is built.
"""

from __future__ import annotations

import json

import pytest

SPEC = '[[phases]]\nname = "decode"\nkind = "decode"\nsizes = [1, 2]\n'


def one_line_error(result, *needles: str) -> str:
    code, out, err = result
    assert code == 1, (code, out, err)
    assert err.startswith("planner: error: ") and err.count("\n") == 1, err
    for needle in needles:
        assert needle in err, err
    return err


# R1. the same axis pinned twice ------------------------------------------------------------------

@pytest.mark.parametrize("pins", [("order=smallest-first", "order=largest-first"),
                                  ("decode.outputs=keep", "decode.outputs=view")])
def test_r1_an_axis_pinned_twice_is_refused(cli, tmp_path, pins):
    # before: the last pin won, but the plan records its pins sorted, so the
    # plan just written was stale for `planner check` (its command rebuilt the other pin)
    args = [a for p in pins for a in ("-s", p)]
    one_line_error(cli("build", "-b", "fa3", *args, "-o", "x.json"), "is pinned twice", "fix: pin")
    assert not (tmp_path / "x.json").exists()


def test_r1_repeated_and_phase_overriding_pins_still_build_and_check(cli, tmp_path):
    assert cli("build", "-b", "fa3", "-s", "order=largest-first", "-s", "order=largest-first",
               "-s", "decode.outputs=keep", "-s", "outputs=view", "-o", "x.json")[0] == 0
    assert cli("check", "x.json")[0] == 0
