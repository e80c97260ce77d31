"""The one table of build options (capture_plan.schemas.build_flags.BUILD_OPTIONS) says what
BuildOptions takes, what a plan's BuildRecord records and which options ``planner build`` and
``planner sizes`` have: a field added to one of them and not to the table (or the other way
round) fails here, naming it."""

from __future__ import annotations

from pathlib import Path

import click
import msgspec
import msgspec.inspect as mi

from capture_plan.planner.cli.build import command as build_command
from capture_plan.planner.cli.sizes import command as sizes_command
from capture_plan.planner.inputs.build_options import (
    BuildOptions,
    SizeChoiceOptions,
    flat,
    from_flat,
    options_from_command,
    options_from_record,
)
from capture_plan.planner.sizes.sizes import SizesOptions
from capture_plan.schemas.build_flags import BUILD_INPUTS, BUILD_OPTIONS, SIZE_CHOICE
from capture_plan.schemas.plan import BUILD_FLAGS, BuildRecord
from cli_inputs import every_size_choice

ROWS = {row.field: row for row in BUILD_OPTIONS}
#: the msgspec types a kind's value may have in BuildOptions (paths as given) and in the record
OPTION_TYPES = {
    "switch": (mi.BoolType,),
    "repeat": (mi.VarTupleType,),
    "path": (mi.CustomType,),
    "int": (mi.IntType,),
    "float": (mi.FloatType,),
    "text": (mi.StrType,),
}
RECORD_TYPES = {**OPTION_TYPES, "repeat": (mi.ListType,), "path": (mi.StrType,)}


def _types(struct) -> dict[str, mi.Type]:
    """Each field's type, its None alternative left out."""
    out = {}
    for f in mi.type_info(struct).fields:
        t = f.type
        if isinstance(t, mi.UnionType):
            (t,) = [a for a in t.types if not isinstance(a, mi.NoneType)]
        out[f.name] = t
    return out


def test_the_table_names_every_field_of_the_options_and_the_record_once():
    assert len(ROWS) == len(BUILD_OPTIONS)
    options = [f for f in BuildOptions.__struct_fields__]
    assert set(options) == set(ROWS) - set(SIZE_CHOICE[1:]), "BuildOptions' fields differ from the table's"
    assert list(SizeChoiceOptions.__struct_fields__) == list(SIZE_CHOICE[1:])
    assert set(BuildRecord.__struct_fields__) == set(ROWS), "BuildRecord's fields differ from the table's"
    # the record's command: every row but backend, in the table's order
    assert [f for f, _, _ in BUILD_FLAGS] == [r.field for r in BUILD_OPTIONS if r.field != "backend"]
    # `planner sizes` nests the same struct as `planner build --sizes auto`
    choice = _types(SizesOptions)["choice"]
    assert isinstance(choice, mi.StructType) and choice.cls is SizeChoiceOptions


def test_each_rows_kind_is_the_type_of_its_field():
    options = {**_types(BuildOptions), **_types(SizeChoiceOptions)}
    record = _types(BuildRecord)
    for row in BUILD_OPTIONS:
        if row.field == "sizes":  # "auto" in the record; the nested SizeChoiceOptions in the options
            assert isinstance(options["sizes"], mi.StructType) and options["sizes"].cls is SizeChoiceOptions
            assert isinstance(record["sizes"], mi.StrType)
            continue
        assert isinstance(options[row.field], OPTION_TYPES[row.kind]), (row.field, options[row.field])
        assert isinstance(record[row.field], RECORD_TYPES[row.kind]), (row.field, record[row.field])
        if row.kind == "path":
            assert options[row.field].cls is Path  # pyright: ignore[reportAttributeAccessIssue]


def _table_params(command: click.Command) -> dict[str, click.Option]:
    return {p.name: p for p in command.params if isinstance(p, click.Option) and p.name in ROWS}


def test_both_commands_take_the_tables_options_with_its_flags_and_help():
    build = _table_params(build_command)
    sizes = _table_params(sizes_command)
    assert set(build) == set(ROWS)
    assert set(sizes) == set(BUILD_INPUTS) | set(SIZE_CHOICE[1:])
    for params in (build, sizes):
        for name, param in params.items():
            row = ROWS[name]
            assert set(param.opts) | set(param.secondary_opts) == {row.flag, *([row.other] if row.other else [])}
            assert param.multiple == (row.kind == "repeat") and param.is_flag == (row.kind == "switch")
            if name != "backend":  # its help names the backends when shown
                assert param.help == row.help
    assert sizes["traffic"].required and not build["traffic"].required


def test_options_given_flat_read_back_alike(tmp_path):
    """Every option set: the options, their flat form, the plan's record and the command text
    say the same."""
    opts = BuildOptions(
        backend="fa3",
        ci=True,
        speculative="eagle",
        max_bs=64,
        strategies=("order=largest-first",),
        trace=tmp_path / "t.json",
        tp=2,
        allocator="expandable",
        exact=True,
        calibration=tmp_path / "c.json",
        device="NVIDIA H200",
        sizes=every_size_choice(tmp_path),
        output=tmp_path / "plans/p.json",
    )
    assert set(flat(opts)) == set(ROWS)
    assert from_flat(flat(opts)) == opts
    assert from_flat(flat(msgspec.structs.replace(opts, sizes=None))).sizes is None
    from capture_plan.planner.inputs.build_options import build_record, normalized_command

    path = tmp_path / "plans/p.json"
    assert options_from_record(build_record(opts), path) == opts
    assert options_from_command(normalized_command(opts), path) == opts
