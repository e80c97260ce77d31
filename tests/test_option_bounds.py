"""One declaration per option (issue 50, item 2): an option's bounds are its row's in
schemas/build_flags.py, and every check of them reads the row: the commands' (planner sizes,
planner build --sizes auto), the plan's BuildRecord and the spec's field of the same name."""

from __future__ import annotations

import subprocess
import sys

import msgspec
import msgspec.inspect as mi
import pytest

from capture_plan.planner.build import BuildOptions, build_spec, check_tp
from capture_plan.planner.inputs.build_options import SizeChoiceOptions
from capture_plan.planner.sizes.command import choose_sizes
from capture_plan.planner.sizes.sizes import SizesOptions
from capture_plan.schemas import build_flags
from capture_plan.schemas.build_flags import BUILD_FLAG, BUILD_OPTIONS, Bounds, msgspec_bounds, out_of_bounds
from capture_plan.schemas.errors import InputError
from capture_plan.schemas.plan import BuildRecord
from capture_plan.schemas.spec import Spec
from test_sizes_auto import SKEWED

BOUNDED = [row.field for row in BUILD_OPTIONS if row.bounds is not None]


def _constraints(struct, field: str) -> dict:
    (f,) = [f for f in mi.type_info(struct).fields if f.name == field]
    t = f.type
    if isinstance(t, mi.UnionType):  # X | None
        (t,) = [x for x in t.types if not isinstance(x, mi.NoneType)]
    names = ("gt", "ge", "lt", "le")
    return {n: getattr(t, n) for n in names if getattr(t, n, None) is not None}


def test_every_row_declares_its_type_and_default_and_the_record_has_them():
    assert {"max_bs", "tp", "max_size", "context", "budget_mib", "max_graphs", "max_padding"} <= set(BOUNDED)
    record = BuildRecord(backend="fa3")
    for row in BUILD_OPTIONS:
        assert row.type in (bool, int, float, str)
        assert row.default == (False if row.kind == "switch" else () if row.kind == "repeat" else None)
        if row.field not in ("backend", "output"):  # the one required; a path the record shortens
            got = getattr(record, row.field)
            assert (tuple(got) if row.kind == "repeat" else got) == row.default, row.field


@pytest.mark.parametrize("field", BOUNDED)
def test_the_records_field_declares_the_rows_bounds(field):
    assert _constraints(BuildRecord, field) == msgspec_bounds(field)


def test_the_specs_budget_is_the_options_bound():
    assert _constraints(Spec, "budget_mib") == msgspec_bounds("budget_mib") == {"gt": 0, "lt": float(2**30)}


def test_a_value_is_refused_on_the_side_it_breaks():
    assert out_of_bounds("budget_mib", 0) == "must be more than 0 MiB, got 0"
    assert out_of_bounds("budget_mib", 2.0**30).startswith("must be below 2**30 MiB")  # pyright: ignore[reportOptionalMemberAccess]
    assert out_of_bounds("budget_mib", float("nan")) == "must be a finite number of MiB, got nan"
    assert out_of_bounds("max_padding", float("nan")) == "must be a percentage from 0 to below 1e6, got nan"
    assert out_of_bounds("max_size", 65537) == "must be 1..65536, got 65537"
    assert out_of_bounds("max_bs", 0) == "must be 1..65536, got 0"
    assert out_of_bounds("max_graphs", 1) is None and out_of_bounds("max_graphs", None) is None


def _rebound(monkeypatch, field: str, **bound) -> None:
    """Option ``field``'s row with ``bound`` (``lo=3``) changed, for this test."""
    row = BUILD_FLAG[field]
    new = row._replace(bounds=row.bounds._replace(**bound))  # pyright: ignore[reportOptionalMemberAccess]
    monkeypatch.setitem(build_flags.BUILD_FLAG, field, new)


def test_changing_a_rows_bound_changes_the_commands_check(monkeypatch):
    """The size choice's check reads the row: a row that asks 3 or more refuses 2."""
    opts = SizesOptions(
        build=BuildOptions(backend="fa3", ci=True), choice=SizeChoiceOptions(traffic=SKEWED, max_graphs=2)
    )
    _rebound(monkeypatch, "max_graphs", lo=3)
    with pytest.raises(InputError, match=r"must be 3 or more, got 2") as e:
        choose_sizes(opts)
    assert e.value.where == "--max-graphs 2"


def test_the_tp_check_reads_its_row(monkeypatch):
    """--tp's check (check_tp) and the record's field read the row: a row that allows 1..4
    refuses 8, which divides the embedded model's heads."""
    spec = build_spec(BuildOptions(backend="fa3"))
    check_tp(spec, 8)
    assert out_of_bounds("tp", 0) == "must be 1..16384, got 0"
    _rebound(monkeypatch, "tp", hi=4)
    with pytest.raises(InputError, match=r"must be 1\.\.4, got 8") as e:
        check_tp(spec, 8)
    assert e.value.where == "--tp"


def test_changing_a_rows_bound_changes_the_records_check():
    """The record's field reads the row when the schema is made (a fresh interpreter)."""
    code = (
        "import msgspec\n"
        "from capture_plan.schemas import build_flags as bf\n"
        "row = bf.BUILD_FLAG['max_graphs']\n"
        "bf.BUILD_FLAG['max_graphs'] = row._replace(bounds=row.bounds._replace(lo=3))\n"
        "from capture_plan.schemas.plan import BuildRecord\n"
        "msgspec.convert({'backend': 'fa3', 'max_graphs': 3}, BuildRecord)\n"
        "try:\n"
        "    msgspec.convert({'backend': 'fa3', 'max_graphs': 2}, BuildRecord)\n"
        "except msgspec.ValidationError as e:\n"
        "    print(e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert "Expected `int` >= 3" in out
    with pytest.raises(msgspec.ValidationError, match=">= 1"):
        msgspec.convert({"backend": "fa3", "max_graphs": 0}, BuildRecord)
    assert Bounds(1, None).limits() == (1, None)
