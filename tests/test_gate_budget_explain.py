"""The budget error names the real cheapest rule-abiding schedule, per phase
(issue 19: with a pin it named "the cheapest schedule the rules allow" at
5,232 MiB, one phase's alternative priced with the other phases still pinned,
when the rule-abiding plan was 1,412 MiB); ``explain`` prints a command that
runs from the current directory (it printed the plan-relative one)."""

from __future__ import annotations

import pytest


def _spec(cli, tmp_path, budget: int) -> None:
    out = cli("spec", "show", "--speculative", "eagle", "--max-bs", "16")[1]
    (tmp_path / "e.toml").write_text(out.replace("library_mib = 0\n", f"library_mib = 0\nbudget_mib = {budget}\n"))


def test_with_a_pin_the_budget_error_names_the_unpinned_plan_per_phase(cli, tmp_path, built):
    from capture_plan.schemas.units import mib

    free = built(backend="fa3", ci=True, speculative="eagle", max_bs=16)
    free_total = free.predicted.pool_bytes + free.predicted.hoisted_bytes
    _spec(cli, tmp_path, -(-free_total // 2**20) + 1)  # the unpinned plan fits, by under 2 MiB
    code, out, err = cli(
        "build", "-b", "fa3", "--ci", "--spec", "e.toml", "-s", "target_verify.order=smallest-first", "-o", "x.json"
    )
    assert (code, out) == (1, "") and err.count("\n") == 1
    named = "; ".join(f"{ph.name}: {ph.strategy.label()}" for ph in free.phases)
    assert (
        f"the cheapest schedule the rules allow, without the --strategy pins, takes {mib(free_total)} "
        f"(within the budget): {named}; fix: drop the --strategy pins, or raise the budget\n" in err
    )
    assert err.startswith("planner: error: e.toml: $.budget_mib: predicted ")
    # and that schedule does build within the budget
    assert cli("build", "-b", "fa3", "--ci", "--spec", "e.toml", "-o", "y.json")[0] == 0


def test_without_pins_the_plan_itself_is_named(cli, tmp_path, built):
    free = built(backend="fa3", ci=True, speculative="eagle", max_bs=16)
    _spec(cli, tmp_path, free.predicted.largest_graph_bytes // 2**20 + 1)
    code, _, err = cli("build", "-b", "fa3", "--ci", "--spec", "e.toml", "-o", "x.json")
    named = "; ".join(f"{ph.name}: {ph.strategy.label()}" for ph in free.phases)
    assert code == 1 and err.endswith(
        f"; no schedule the rules allow is cheaper than this one: {named}; fix: raise "
        "the budget, or capture fewer sizes\n"
    ), err


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
    assert (
        out.splitlines()[0] == "plan fa3, recorded command (run it in plans): planner build --backend fa3 --future-flag"
    )
