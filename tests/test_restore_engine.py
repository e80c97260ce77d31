"""Engine-owned memory in a graph file (issue 51, deliverable 4): a range of memory the engine
owns outside torch's allocator (vLLM's cuMem-backed KV cache), named by the caller with its
address and size, is an ``engine:NAME`` segment of the file, checked by name and size, and
relocated by a restore to the range the restoring process names alike. Without the name the
same address is an ``outside:K`` segment that every restore refuses, and a word into the
range's unmapped part (a reservation is mapped in part while graphs are captured) is not even
taken for an address. On the CPU, with the fake driver and fake CUDA of tests/test_restore.py."""

from __future__ import annotations

import ctypes
import struct

import msgspec
import pytest

pytest.importorskip("torch")  # the executor imports torch

import test_restore
from capture_plan.executor import graph_file as gf, graph_restore as rs
from capture_plan.executor.graph_rebuild import segment_bases
from capture_plan.executor.graph_validity import check_valid
from capture_plan.executor.graph_walk import AddressResolver, walk_graph
from capture_plan.executor.restore_checks import Here, inspect_refusals
from capture_plan.executor.restore_probe import torch_segments
from capture_plan.schemas.graph_file import GRAPH_FILE_VERSION, GraphFile
from test_graph_file import OUTSIDE, SNAPSHOT, TENSOR, VALID
from test_graph_rebuild import RebuildDriver
from test_restore import WalkedTarget, _env

#: test_restore.py's fixtures: its plan (decode at 8, pool "shared") and this process on fakes
plan, faked = test_restore.plan, test_restore.faked

MiB = 1 << 20
#: the engine's range in the saving process: the fake driver maps its first MiB only (OUTSIDE's)
KV = (OUTSIDE, 4 * MiB)
#: where the restoring process has it
NEW_KV = 0x7E00_0000_0000


def _file(plan, word: int, engine=None) -> GraphFile:
    """The fake graph (a kernel whose struct parameter holds ``word`` as its third word, a
    memset, a copy, an empty node) saved for ``plan`` with the engine's ranges ``engine``."""
    d = RebuildDriver()
    d.buffers[2] = ctypes.create_string_buffer(struct.pack("<QQQ", TENSOR + 8, 7, word), 24)
    d.ptrs[2] = ctypes.addressof(d.buffers[2])
    snap = torch_segments(SNAPSHOT)
    segs = gf.Segments(
        snap, {"shared": (1, 2)}, {"model.w": (TENSOR, 4096)}, AddressResolver(d, known=snap), engine=engine
    )
    valid = msgspec.structs.replace(VALID, plan_digest=plan.digest)
    return gf.build_file([("decode", 8, walk_graph(0x1, d))], segs, valid, d)


def _word(file: GraphFile) -> tuple[str, int] | None:
    """(segment name, offset) the kernel's struct word at byte 32 is relocated into, or None
    where it was not taken for an address."""
    k = file.graphs[0].nodes[0].kernel
    assert k is not None
    r = next((r for r in k.relocations if r.position == 32), None)
    return None if r is None else (file.segments[r.segment].name, r.offset)


def test_an_address_in_a_named_engine_range_is_a_segment_of_that_name(plan):
    bare = _file(plan, OUTSIDE + 16)
    assert _word(bare) == ("outside:0", 16)  # unnamed: outside torch's allocator, refused by every restore
    assert any("point into outside:0" in line for line in check_valid(bare, _env(plan), later=("workspace", "pool")))
    named = _file(plan, OUTSIDE + 16, engine={"kv": KV})
    assert _word(named) == ("engine:kv", 16)
    seg = next(s for s in named.segments if s.kind == "engine")
    assert (seg.name, seg.owner, seg.size, seg.address) == ("engine:kv", "kv", KV[1], KV[0])
    assert check_valid(named, _env(plan, engine={"kv": KV[1]}), later=("workspace", "pool")) == []
    # the file alone says nothing against it: whether the range is there is the restoring process's
    assert inspect_refusals(named) == []
    assert "not relocatable: none" in gf.describe(named)


def test_a_word_into_the_ranges_unmapped_part_is_relocated_only_where_the_range_is_named(plan):
    """The driver resolves only the first MiB of the range (what is mapped while capturing):
    a word 3 MiB in is no address to it, and, unnamed, would be rebuilt unrelocated."""
    deep = KV[0] + 3 * MiB
    assert _word(_file(plan, deep)) is None
    assert _word(_file(plan, deep, engine={"kv": KV})) == ("engine:kv", 3 * MiB)


@pytest.mark.parametrize(
    "here, said",
    [
        ({}, "engine memory kv is missing in this process (1 address(es) point into it, first at graph decode/8"),
        ({"kv": 2 * MiB}, "engine memory kv is resized: the file was saved with 4194304 B, this process has 2097152 B"),
    ],
)
def test_an_engine_range_missing_or_sized_otherwise_is_refused(plan, here, said):
    got = check_valid(
        _file(plan, OUTSIDE + 16, engine={"kv": KV}), _env(plan, engine=here), later=("workspace", "pool")
    )
    assert len(got) == 1 and got[0].startswith(said), got


def test_the_bases_name_each_engine_range_here():
    f = GraphFile(valid_for=VALID, segments=[gf.Segment(name="engine:kv", kind="engine", size=KV[1], owner="kv")])
    assert segment_bases(f, {}, {}, {}, {"kv": NEW_KV}) == [NEW_KV]
    assert segment_bases(f, {}, {}, {}) == [None]


def test_a_restore_relocates_an_engine_range_to_the_one_the_restoring_process_names(faked, plan):
    f = _file(plan, OUTSIDE + 16, engine={"kv": KV})
    here = Here(
        device=faked.here.device,
        env=_env(plan, engine={"kv": KV[1]}),
        tensors=faked.here.tensors,
        engine={"kv": (NEW_KV, KV[1])},
    )
    report = rs.RestoreReport("g.cpgraphs")
    gs = rs._restore(plan, WalkedTarget(), f, here, report, 0.0, {"model.w": faked.weights})
    kernel = next(n for n in faked.driver.nodes.values() if n["type"] == "kernel")
    words = struct.unpack("<QiiQQQ", kernel["args"][:40])
    assert (words[3], words[4], words[5]) == (faked.weights.data_ptr() + 8, 7, NEW_KV + 16)
    assert gs.restored.segments == 3 and gs.restored.moved == 3  # the pool's, the tensor, the engine's range
    gs.release()


def test_a_file_of_version_3_is_refused_by_its_version(tmp_path):
    """A reader of version 3 took an ``engine`` segment for a damaged file: version 4 names it."""
    from capture_plan.schemas.errors import InputError
    from capture_plan.schemas.graph_file import read_graph_file

    path = tmp_path / "old.cpgraphs"
    path.write_bytes(msgspec.msgpack.encode({"kind": "capture-plan graph file", "version": 3}))
    with pytest.raises(InputError, match=f"graph file version 3, this capture-plan reads version {GRAPH_FILE_VERSION}"):
        read_graph_file(path)
