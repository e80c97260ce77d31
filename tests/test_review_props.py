"""Property: whatever a build accepts, the plan it writes checks clean at once.

A plan records its normalized command (pins sorted and deduplicated, paths
relative to the plan's folder); `planner check` rebuilds from that record. So
any accepted combination of options, typed in any order from any directory,
must give a plan that (a) `planner check` calls up to date from another
directory and (b) a second build of the same command reproduces byte for byte.
Finding R1 (an axis pinned twice: the last pin won, the sorted record rebuilt
the other one) broke (a) and is what this would have caught.

Examples: ``CAPTURE_PLAN_FUZZ_EXAMPLES`` (default 10), as tests/test_fuzz.py.
"""

from __future__ import annotations

import os
from pathlib import Path

from hypothesis import HealthCheck, given, settings, strategies as st

from capture_plan.schemas.strategy import AXIS_VALUES

EXAMPLES = int(os.environ.get("CAPTURE_PLAN_FUZZ_EXAMPLES", "10"))
PROPS = settings(
    max_examples=EXAMPLES,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)

SPEC = (
    '[[phases]]\nname = "decode"\nkind = "decode"\nsizes = [1, 2, 4, 8]\n'
    '[[phases]]\nname = "verify"\nkind = "target_verify"\nsizes = [1, 4]\ntokens_per_request = 4\n'
    'output_lifetime = "across-phases"\n'
)

PINS = st.lists(
    st.sampled_from(
        [
            f"{scope}{axis}={value}"
            for scope in ("", "decode.", "verify.")
            for axis, values in AXIS_VALUES.items()
            for value in values
        ]
    ),
    max_size=4,
)


def run(cli_main, cwd: Path, *args: str) -> tuple[int, str, str]:
    import contextlib
    import io

    out, err = io.StringIO(), io.StringIO()
    old = os.getcwd()
    os.chdir(cwd)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = cli_main(list(args))
    finally:
        os.chdir(old)
    return code, out.getvalue(), err.getvalue()


@PROPS
@given(
    pins=PINS,
    ci=st.booleans(),
    backend=st.sampled_from(["fa3", "triton"]),
    tp=st.sampled_from([None, 1, 2, 8]),
    allocator=st.sampled_from([None, "native", "expandable"]),
    out_name=st.sampled_from([None, "what-if.json"]),
)
def test_an_accepted_build_checks_clean_from_anywhere_and_rebuilds_byte_identical(
    tmp_path_factory, pins, ci, backend, tp, allocator, out_name
):
    from capture_plan.planner.cli import main

    root = tmp_path_factory.mktemp("p")
    (root / "specs").mkdir()
    (root / "specs/s.toml").write_text(SPEC)
    (root / "elsewhere").mkdir()

    def build_args(pin_order: list[str]) -> list[str]:
        args = ["build", "-b", backend, "--spec", "../specs/s.toml"]
        args += ["--ci"] * ci + [a for p in pin_order for a in ("-s", p)]
        args += ["--tp", str(tp)] if tp is not None else []
        args += ["--allocator", allocator] if allocator else []
        return args + (["-o", f"../plans/{out_name}"] if out_name else [])

    code, out, err = run(main, root / "elsewhere", *build_args(pins))  # not from the repo root
    assert code in (0, 1), err
    if code == 1:
        assert err.startswith("planner: error: ") and err.count("\n") == 1, err
        return
    plans = sorted((root / "plans" if out_name else root / "elsewhere/plans").glob("*.json"))
    assert len(plans) == 1, plans
    first = plans[0].read_bytes()
    code, out, err = run(main, root / "specs", "check", os.path.relpath(plans[0], root / "specs"))
    assert code == 0 and out.endswith(": up to date\n"), (pins, err)
    code, _, err = run(main, root / "elsewhere", *build_args(pins[::-1]))  # same pins, other order
    assert code == 0, err
    assert plans[0].read_bytes() == first
