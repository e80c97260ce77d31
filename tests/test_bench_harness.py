"""The benchmarks' shared harness (bench/harness.py) on the CPU: the result header and
writer, the file naming the committed results follow, the engines' loop on the faked
CUDA, and the bench package itself (every module parses ``--help`` without a GPU, none
edits ``sys.path``, only the harness captures with ``torch.cuda.graph``)."""

from __future__ import annotations

import ast
import contextlib
import datetime as dt
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from bench_modules import bench_module

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "bench"
RESULTS = BENCH / "results"
h = bench_module("harness")
#: every script of bench/ (the package's modules less the shared ones and __init__)
#: the bench's scripts: every module but the shared ones (fit_bench_sglang: fit_bench's SGLang side)
SCRIPTS = sorted(
    p.stem for p in BENCH.glob("*.py") if p.stem not in ("__init__", "harness", "baselines", "fit_bench_sglang")
)


# -- header and writer ----------------------------------------------------------------------


def test_the_cpu_header_names_date_machine_and_commit(monkeypatch):
    for k in h.CUDA_ENV:
        monkeypatch.delenv(k, raising=False)
    head = h.header(device=False)
    assert set(head) == {"date", "git_commit", "git_dirty", "git_diff_sha256", "machine"}
    when = dt.datetime.fromisoformat(head["date"])
    assert when.utcoffset() == dt.timedelta(0) and abs(dt.datetime.now(dt.timezone.utc) - when).total_seconds() < 600
    assert re.fullmatch(r"\S+ \d+ cpus, \S+ \d+\.\d+\.\d+\S*", head["machine"])
    if (ROOT / ".git").exists():
        want = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True)
        assert head["git_commit"] == want.stdout.strip() and isinstance(head["git_dirty"], bool)
        # the digest of the uncommitted changes, where there are any
        assert (head["git_diff_sha256"] is None) == (not head["git_dirty"])


def test_the_header_records_the_cuda_environment_a_run_was_measured_under(monkeypatch):
    """A run under CUDA_MODULE_LOADING=EAGER (kernel code loaded at start, not inside a
    capture) measures other memory than one without: its JSON says so."""
    for k in h.CUDA_ENV:
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("CUDA_MODULE_LOADING", "EAGER")
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    assert h.header(device=False)["cuda_env"] == {
        "CUDA_MODULE_LOADING": "EAGER",
        "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True",
    }


def _repo(tmp_path):
    """A git checkout of one committed file, for the provenance tests."""
    git = ["git", "-C", str(tmp_path), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run([*git[:3], "init", "-q"], check=True)
    (tmp_path / "a.txt").write_text("one\n")
    subprocess.run([*git, "add", "a.txt"], check=True)
    subprocess.run([*git, "commit", "-qm", "a"], check=True)
    return tmp_path


def test_a_dirty_checkout_is_recorded_with_the_digest_of_its_diff(tmp_path, monkeypatch):
    root = _repo(tmp_path)
    monkeypatch.setattr(h, "RESULTS", root)  # this checkout's results folder, for the refusal
    assert h.git_commit(root)[1] is False
    h.refuse_dirty(False, root / "x.json", root)  # clean: nothing to refuse
    (root / "a.txt").write_text("two\n")
    assert h.git_commit(root)[1] is True
    digest = h.git_diff_digest(root)
    assert re.fullmatch(r"[0-9a-f]{64}", digest) and digest == h.git_diff_digest(root)
    (root / "a.txt").write_text("three\n")
    assert h.git_diff_digest(root) != digest  # another change, another digest
    with pytest.raises(h.DirtyTree, match=r"uncommitted changes.*fix: commit .*--allow-dirty"):
        h.refuse_dirty(False, root / "x.json", root)
    h.refuse_dirty(True, root / "x.json", root)
    h.refuse_dirty(False, tmp_path.parent / "elsewhere.json", root)  # not the committed results: recorded only
    assert h.git_diff_digest(tmp_path / "nowhere") is None


def test_a_copy_with_a_stale_git_records_the_commit_it_claims_clean_only_if_its_files_are_that_commit(
    tmp_path, monkeypatch
):
    """The lent GPU machine's copy of the tree keeps the .git of its first run: a result
    there names the commit claimed for it (CAPTURE_PLAN_COMMIT from ``python -m
    bench.harness claim``), clean only while its files, untracked ones too, are that commit's."""
    (tmp_path / "here").mkdir()
    root = _repo(tmp_path / "here")
    claimed = h.claim(root)
    commit, tree = claimed.split(":")
    copy = tmp_path / "copy"
    subprocess.run(["cp", "-a", str(root), str(copy)], check=True)
    git = ["git", "-C", str(copy), "-c", "user.name=t", "-c", "user.email=t@t"]
    (copy / "a.txt").write_text("two\n")
    subprocess.run([*git, "commit", "-qam", "b"], check=True)  # the copy's .git moves on ...
    (copy / "a.txt").write_text("one\n")  # ... and its files are the claimed commit's again
    monkeypatch.setenv(h.CLAIM_ENV, claimed)
    assert h.git_commit(copy) == (commit, False)
    (copy / "new.txt").write_text("untracked\n")  # carried to the device like the rest: measured
    assert h.git_commit(copy) == (commit, True)
    monkeypatch.chdir(copy)
    monkeypatch.setattr(h, "REPO", copy)
    head = h.header(device=False)
    assert (head["git_commit"], head["git_dirty"], head["git_diff_sha256"]) == (commit, True, None)
    assert head["git_tree"] == h.working_tree(copy) != tree  # what was measured, named exactly
    monkeypatch.setenv(h.CLAIM_ENV, commit)
    with pytest.raises(
        h.InputError, match=r"not <commit>:<tree>.*fix: set it to the output of python -m bench.harness claim"
    ):
        h.git_commit(copy)
    (root / "a.txt").write_text("changed\n")
    with pytest.raises(h.DirtyTree, match="not HEAD's"):
        h.claim(root)
    assert (
        tree
        == subprocess.run(
            ["git", "-C", str(root), "rev-parse", "HEAD^{tree}"], capture_output=True, text=True
        ).stdout.strip()
    )


def _bench_copy(at: Path) -> Path:
    """A copy of the harness (bench/ without results) at ``at``, as a copy of the tree
    without ``.git`` holds it."""
    (at / "bench").mkdir(parents=True)
    for name in ("__init__.py", "harness.py"):
        shutil.copy(BENCH / name, at / "bench" / name)
    return at


def _claim_in(root: Path, *, ceiling: Path, **env: str) -> subprocess.CompletedProcess:
    """``python -m bench.harness claim`` run from ``root`` as a user runs it, git not
    looking above ``ceiling``."""
    env = {**os.environ, "GIT_CEILING_DIRECTORIES": str(ceiling), "PYTHONDONTWRITEBYTECODE": "1", **env}
    cmd = [sys.executable, "-m", "bench.harness", "claim"]
    return subprocess.run(cmd, cwd=root, capture_output=True, text=True, env=env, timeout=120)


def _one_line(r: subprocess.CompletedProcess, start: str) -> str:
    assert (r.returncode, r.stdout) == (1, ""), (r.returncode, r.stdout, r.stderr)
    assert r.stderr.count("\n") == 1 and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.startswith(start), r.stderr
    return r.stderr


def test_claim_where_there_is_no_commit_to_claim_is_one_located_line(tmp_path):
    """Outside a git checkout (a copy of the tree without .git), without git, or in a
    folder of another checkout, ``claim`` says so in one line naming the folder and
    where to claim instead, exit 1, not a traceback or another checkout's commit."""
    copy = _bench_copy(tmp_path / "copy")
    claim_elsewhere = (
        "fix: run python -m bench.harness claim in the git checkout this tree was copied from "
        f"and export {h.CLAIM_ENV}=<what it printed> here"
    )
    err = _one_line(_claim_in(copy, ceiling=tmp_path), f"harness: {copy}: not a git checkout with a commit (git ")
    assert err.rstrip().endswith(claim_elsewhere), err
    no_git = _claim_in(copy, ceiling=tmp_path, PATH=str(Path(sys.executable).parent))
    err = _one_line(no_git, f"harness: {copy}: git cannot run (")
    assert "fix: put git on PATH (apt-get install git), or run python -m bench.harness claim" in err
    outer = _repo(tmp_path)  # tmp_path a checkout, the copy a folder of it: its commit is not the copy's
    err = _one_line(_claim_in(copy, ceiling=tmp_path.parent), f"harness: {copy}: not the top of a git checkout: ")
    assert f"inside {outer.resolve()}" in err and claim_elsewhere in err
    usage = subprocess.run([sys.executable, "-m", "bench.harness"], cwd=copy, capture_output=True, text=True)
    assert (usage.returncode, usage.stderr) == (2, "usage: python -m bench.harness claim\n")


def test_claim_at_a_committed_checkout_prints_commit_and_tree(tmp_path):
    root = _bench_copy(tmp_path / "here")
    git = ["git", "-C", str(root), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run([*git[:3], "init", "-q"], check=True)
    subprocess.run([*git, "add", "-A"], check=True)
    subprocess.run([*git, "commit", "-qm", "a"], check=True)
    r = _claim_in(root, ceiling=tmp_path)
    assert r.returncode == 0 and r.stderr == "", r.stderr
    head = subprocess.run([*git[:3], "rev-parse", "HEAD", "HEAD^{tree}"], capture_output=True, text=True)
    assert r.stdout == ":".join(head.stdout.split()) + "\n"


def test_a_bench_run_in_a_copy_without_git_records_no_commit(tmp_path, monkeypatch):
    """The lent machine may run a copy of the tree without .git: the header records the
    commit as unknown (or, with a claim, the claimed commit, dirty: nothing there can
    show the files are that commit's), and the run goes on."""
    copy = _bench_copy(tmp_path / "copy")
    monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(tmp_path))
    monkeypatch.delenv(h.CLAIM_ENV, raising=False)
    monkeypatch.setattr(h, "REPO", copy)
    head = h.header(device=False)
    assert (head["git_commit"], head["git_dirty"], head["git_diff_sha256"]) == (None, None, None)
    h.refuse_dirty(False, h.RESULTS / "x.json", copy)  # unknown is not dirty: nothing refused
    monkeypatch.setenv(h.CLAIM_ENV, "c" * 40 + ":" + "d" * 40)
    head = h.header(device=False)
    assert (head["git_commit"], head["git_dirty"], head["git_tree"]) == ("c" * 40, True, None)


def test_a_dirty_result_is_written_into_the_results_only_when_allowed(tmp_path, monkeypatch):
    monkeypatch.setattr(h, "RESULTS", tmp_path / "results")
    res = {"date": "2026-12-02T00:00:00+00:00", "git_commit": "a" * 40, "git_dirty": True, "git_diff_sha256": "b" * 64}
    path = tmp_path / "results" / "x.json"
    with pytest.raises(h.DirtyTree, match="git_dirty"):
        h.ResultFile(path).write(res)
    with pytest.raises(h.DirtyTree):
        h.ResultFile(path).write(text=h.dumps(res))
    assert not path.exists()
    h.ResultFile(path, allow_dirty=True).write(res)
    assert json.loads(path.read_text())["git_diff_sha256"] == "b" * 64
    h.ResultFile(path.with_name("y.json")).write({**res, "git_dirty": False})
    h.ResultFile(tmp_path / "scratch.json").write(res)  # outside the results: recorded, not refused


def test_a_bench_refuses_a_dirty_checkout_before_measuring(tmp_path, monkeypatch):
    monkeypatch.setattr(h, "git_commit", lambda root=h.REPO: ("c" * 40, True))
    monkeypatch.setattr(h, "RESULTS", tmp_path)
    args = h.argparse.Namespace(out=str(tmp_path), overwrite=False, allow_dirty=False)
    with pytest.raises(h.DirtyTree):
        h.result_file(args, "device", "2026-12-02")
    args.allow_dirty = True
    assert h.result_file(args, "device", "2026-12-02").allow_dirty


# -- the bench package -------------------------------------------------------------------------


def test_every_bench_module_runs_help_without_a_gpu():
    """``python -m bench.<name> --help`` from the repository's root, CUDA hidden: each
    parses its arguments before it needs a GPU (or transformers). In parallel: each
    pays its own torch import."""
    pytest.importorskip("torch")
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    procs = {
        name: subprocess.Popen(
            [sys.executable, "-m", f"bench.{name}", "--help"],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for name in SCRIPTS
    }
    for name, p in procs.items():
        out, err = p.communicate(timeout=300)
        assert p.returncode == 0, f"{name}: {err[-2000:]}"
        assert out.startswith("usage: "), name
    assert len(procs) == 19  # every bench module: ... restore_floor, torch_entry_points, fit_bench, side_stream_bench


def _sources():
    return {p.name: ast.parse(p.read_text()) for p in sorted(BENCH.glob("*.py"))}


def test_no_bench_file_edits_sys_path():
    """The benches import capture_plan from the installation and bench from the root."""
    found = []
    for name, tree in _sources().items():
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Attribute)
                and node.attr == "path"
                and isinstance(node.value, ast.Name)
                and node.value.id == "sys"
            ):
                found.append(f"{name}:{node.lineno}")
            if isinstance(node, ast.Constant) and node.value in ("PYTHONPATH",):
                found.append(f"{name}:{node.lineno}: PYTHONPATH")
    assert found == []


def test_only_the_harness_runs_the_engines_loop():
    """One copy of each engine's loop: no bench but the harness (the SGLang-shaped loop) and
    the baselines (vLLM's own capture, bench/baselines.py) calls ``torch.cuda.graph``."""
    found = [
        f"{name}:{node.lineno}"
        for name, tree in _sources().items()
        if name not in ("harness.py", "baselines.py")
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute) and ast.unparse(node) == "torch.cuda.graph"
    ]
    assert found == []


# -- the engines' loop, on the faked CUDA -----------------------------------------------------


@pytest.fixture
def loop_fake(fake, monkeypatch):
    """tests/fake_cuda.py plus ``torch.cuda.graph``: the real one enters CUDA stream
    capture; this one records into the fake graph on the given stream."""
    import torch

    @contextlib.contextmanager
    def graph(g, pool=None, stream=None):
        with torch.cuda.stream(stream):
            g.capture_begin(pool=pool)
            try:
                yield
            finally:
                g.capture_end()

    monkeypatch.setattr(torch.cuda, "graph", graph)
    return fake


def test_engine_loop_captures_largest_first_after_warmups_into_one_pool(loop_fake):
    from fake_cuda import Target

    target = Target(loop_fake)
    run = h.engine_loop(target, h.largest_first([("decode", [2, 8, 4])]), warmups=2)
    assert list(run.graphs) == [("decode", 8), ("decode", 4), ("decode", 2)]
    assert loop_fake.pools == 1 and run.pool == (0, 1)
    # per size: two eager warm-ups, then the one run that is recorded
    assert [(c[2], c[3]) for c in target.calls] == [(bs, rec) for bs in (8, 4, 2) for rec in (False, False, True)]
    assert all(run.outs[("decode", bs)] == (target.out[bs],) for bs in (8, 4, 2))
    assert set(run.phase_seconds) == {"decode"} and run.seconds >= run.phase_seconds["decode"] >= 0
    assert run.oom is None and run.free_after == []
    gen = None  # the fake target's prepare draws without a generator
    rows = h.replays_vs_eager(target, run, gen, rounds=2, eager_twice=True)
    assert [(r.phase, r.bs, r.equal, r.eager_equal, r.max_abs_diff) for r in rows] == [
        ("decode", bs, True, True, 0.0) for _ in range(2) for bs in (8, 4, 2)
    ]
    assert h.check_loop(target, run, gen) == 0
    graphs = list(run.graphs.values())
    h.release(run)
    assert run.graphs == {} and run.outs == {} and all(g.calls == [] for g in graphs)


def test_replays_that_differ_from_eager_are_counted(loop_fake):
    import torch

    from fake_cuda import Target

    class Drifting(Target):
        """Eager runs add 1 that the recorded graph does not."""

        def run(self, phase, bs, ws):
            out = super().run(phase, bs, ws)
            if self.fake.recording is None:
                out.add_(1)
            return out

    target = Drifting(loop_fake)
    run = h.engine_loop(target, [("decode", [4]), ("verify", [2])], warmups=1)
    assert list(run.graphs) == [("decode", 4), ("verify", 2)] and set(run.phase_seconds) == {"decode", "verify"}
    rows = h.replays_vs_eager(target, run, torch.Generator())
    assert [(r.phase, r.equal) for r in rows] == [("decode", False), ("verify", False)]
    assert [r.max_abs_diff for r in rows] == pytest.approx([1.0, 1.0])  # float32 sums of N(0, 1) draws
    assert h.check_loop(target, run, None) == 2


def test_engine_loop_stops_at_out_of_memory_only_when_asked(loop_fake):
    import torch

    from fake_cuda import Target

    class Oom(Target):
        def run(self, phase, bs, ws):
            if phase == "b" and bs == 4 and self.fake.recording is not None:
                raise torch.OutOfMemoryError("fake: out of memory")
            return super().run(phase, bs, ws)

    order = [("a", [8]), ("b", [8, 4, 2]), ("c", [1])]
    run = h.engine_loop(Oom(loop_fake), order, stop_at_oom=True)
    assert run.oom == "b/4" and list(run.graphs) == [("a", 8), ("b", 8)] and set(run.phase_seconds) == {"a", "b"}
    assert loop_fake.recording is None  # the failed capture was ended
    with pytest.raises(torch.OutOfMemoryError):
        h.engine_loop(Oom(loop_fake), order)


def test_engine_loop_keep_copy_and_free_after(loop_fake):
    """vLLM's FULL graphs: outputs copied into buffers of their own, made in the warm-up."""
    from fake_cuda import Target

    target = Target(loop_fake)
    run = h.engine_loop(target, [("decode", [4, 2])], warmups=1, keep_copy=True, free_after=True)
    assert run.free_after == [0, 0]  # the fake's mem_get_info
    for bs in (4, 2):
        (buf,) = run.outs[("decode", bs)]
        assert buf is not target.out[bs] and buf.shape == target.out[bs].shape
        assert bool((buf == target.out[bs]).all())  # copied at capture


def test_largest_first_keeps_the_phase_order():
    assert h.largest_first([("b", [1, 3, 2]), ("a", (5, 4))]) == [("b", [3, 2, 1]), ("a", [5, 4])]
    assert h.largest_first([("b", [3, 1, 2])], ascending=True) == [("b", [1, 2, 3])]
    assert h.outputs(1) == (1,) and h.outputs((1, 2)) == (1, 2)


# -- on the GPU ---------------------------------------------------------------------------------


@pytest.mark.gpu
def test_engine_loop_replays_equal_eager_on_the_gpu():
    """The one loop the benches run, on the small reference model: graphs in one pool whose
    replays equal eager runs, kept outputs and vLLM's copies alike."""
    import torch

    from capture_plan.executor.pool import pool_reserved
    from capture_plan.references.decode import ReferenceConfig, ReferenceModel
    from capture_plan.schemas.spec import Model

    model = ReferenceModel(ReferenceConfig(model=Model(layers=2), max_bs=32))
    gen = torch.Generator(device="cuda")
    gen.manual_seed(0)
    run = h.engine_loop(model, h.largest_first([("decode", [1, 8, 32])]))
    try:
        assert list(run.graphs) == [("decode", 32), ("decode", 8), ("decode", 1)]
        assert pool_reserved([run.pool]) > 0 and run.oom is None
        assert h.check_loop(model, run, gen) == 0
    finally:
        h.release(run)
    run = h.engine_loop(model, [("decode", [32, 8])], warmups=1, keep_copy=True, free_after=True)
    try:
        assert len(run.free_after) == 2 and run.free_after[1] <= run.free_after[0]
        rows = h.replays_vs_eager(model, run, gen, rounds=2)
        assert len(rows) == 4 and all(r.equal for r in rows)
    finally:
        h.release(run)


@pytest.mark.gpu
def test_a_gpu_bench_writes_its_header_and_result(tmp_path):
    """``python -m bench.cold_stream`` end to end on a small model: the device header, the
    result named by the convention, and no second run over it without --overwrite."""
    cmd = [sys.executable, "-m", "bench.cold_stream", "--layers", "2", "--bs", "16", "--out", str(tmp_path)]
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    (path,) = tmp_path.glob("cold-stream-*.json")
    data = json.loads(path.read_text())
    assert path == h.result_path(tmp_path, "cold-stream", data["date"])
    assert data["device"] and data["torch"] and data["cuda"] and data["layers"] == 2
    assert data["warm_stream"]["pool_mib"] > 0 and data["cold_stream"]["pool_mib"] > 0
    again = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert again.returncode == 1 and "--overwrite" in again.stderr
    assert subprocess.run([*cmd, "--overwrite"], capture_output=True, cwd=ROOT, timeout=600).returncode == 0


# -- the engines' own methods (bench/baselines.py), their arithmetic and step order -------------

b = bench_module("baselines")


def test_vllm_default_sizes_for_an_h200_are_its_51():
    sizes = b.vllm_capture_sizes()
    assert sizes == [1, 2, 4, *range(8, 256, 8), *range(256, 513, 16)] and len(sizes) == 51
    assert b.vllm_capture_sizes(blackwell=True)[-1] == 1024
    # max_num_batched_tokens off the stride is captured too; a small server caps the sizes
    assert b.vllm_capture_sizes(max_num_batched_tokens=300)[-2:] == [288, 300]
    assert b.vllm_capture_sizes(max_num_seqs=4, max_num_batched_tokens=2048) == [1, 2, 4, 8]
    # 3 tokens per request (2 draft tokens): the decode sizes n * 3 are added; with 4 they are
    # on the grid already
    spec = b.vllm_capture_sizes(decode_query_len=3)
    assert set(sizes) < set(spec) and {3, 6, 12, 24, 48, 504} <= set(spec) and max(spec) == 512
    assert b.vllm_capture_sizes(decode_query_len=4) == sizes


def test_vllm_full_decode_descriptors_round_up_to_whole_requests_largest_first():
    sizes = b.vllm_capture_sizes()
    assert b.vllm_full_decode_requests(sizes) == sorted(sizes, reverse=True)
    reqs = b.vllm_full_decode_requests(b.vllm_capture_sizes(decode_query_len=4), decode_query_len=4)
    assert reqs[0] == 128 and reqs[-1] == 1 and reqs == sorted(set(reqs), reverse=True)
    assert 3 not in reqs and 6 in reqs  # 24 tokens: 6 requests of 4
    reqs = b.vllm_full_decode_requests(b.vllm_capture_sizes(decode_query_len=3), decode_query_len=3)
    assert reqs[0] == 168 and 3 in reqs  # 504 tokens (512 rounds up past the largest); 8 tokens: 9, 3 requests
    assert b.vllm_full_decode_requests([1, 2, 4, 8], max_num_seqs=2) == [2, 1]


def test_vllm_extrapolates_from_the_two_samples_with_its_1_mib_floor():
    M = b.MiB
    assert (b.VLLM_FULL_SAMPLES, b.VLLM_MIN_PER_GRAPH_BYTES) == (2, M)
    assert b.vllm_extrapolate([100 * M, 3 * M], 51) == 100 * M + 50 * 3 * M
    assert b.vllm_extrapolate([100 * M, M // 2], 51) == 100 * M + 50 * M  # the floor
    assert b.vllm_extrapolate([100 * M, -5 * M], 51) == 150 * M  # a negative sample: the floor too
    assert b.vllm_extrapolate([100 * M], 1) == 100 * M and b.vllm_extrapolate([], 51) == 0
    # the sampled graphs' drops are swapped for the extrapolation; the rest of the drop stays
    assert b.vllm_estimate(300 * M, [100 * M, 3 * M], 51) == 300 * M - 103 * M + 250 * M
    assert b.vllm_estimate(M, [100 * M, 100 * M], 2) == M and b.vllm_estimate(5 * M, [5 * M], 1) == 5 * M
    assert b.vllm_estimate(0, [-5 * M], 1) == 0  # never below 0


def test_sglang_reserve_follows_reserve_for_graph_mb():
    prefill = b.sglang_prefill_sizes(8192)
    assert len(prefill) == 58 and prefill[:3] == [4, 8, 12] and prefill[-1] == 8192
    assert b.sglang_prefill_sizes(100) == [4, 8, 12, 16, 20, 24, 28, 32, 48, 64, 80, 96]
    # an H200 at TP 1: decode 256 x 2 MB, 58 prefill sizes x 8 MB
    assert b.sglang_reserve_mib(decode_max_bs=256) == 256 * 2 + 58 * 8
    assert b.sglang_reserve_mib(decode_max_bs=256, mla=True) == 512 + 1536
    assert b.sglang_reserve_mib(decode_max_bs=256, prefill_backend="disabled") == 512
    assert b.sglang_reserve_mib(decode_max_bs=256, attn_dp_size=4, prefill_backend="disabled") == 512 + 256 * 4 * 3
    assert b.sglang_reserve_mib(decode_max_bs=512, attn_dp_size=2, prefill_backend="disabled") == (
        1024 + 512 * 2 * 3 + 512 * 2 * 1.5
    )
    assert b.sglang_reserve_mib(decode_max_bs=256, deepep=True) == 512 + 464 + 1024
    assert b.sglang_reserve_mib(decode_max_bs=256, prefill_backend="full", deepep=True) == 512 + 464
    assert b.sglang_reserve_mib(decode_max_bs=256, disaggregation_mode="prefill") == 464
    assert b.sglang_reserve_mib(decode_max_bs=256, disaggregation_mode="decode", attn_dp_size=2) == 512 + 1536
    assert b.sglang_reserve_mib(decode_max_bs=256, decode_graphs=False, prefill_backend="disabled") == 0


class _Memory:
    """Free device memory for the fake CUDA: each recorded run takes ``cost[bs]`` MiB
    for good; every call the baseline makes is logged in order."""

    def __init__(self, fake, monkeypatch, cost):
        import torch

        self.fake, self.cost, self.free, self.log = fake, cost, 10_000 * b.MiB, []
        monkeypatch.setattr(torch.cuda, "mem_get_info", self._info)
        monkeypatch.setattr(torch.cuda, "empty_cache", lambda: self.log.append("empty_cache"))
        monkeypatch.setattr(b.gc, "collect", lambda: self.log.append("collect"))

    def _info(self, device=None):
        self.log.append("free")
        return self.free, 0

    def run(self, phase, bs, ws):
        import torch

        recording = self.fake.recording is not None
        self.log.append(f"{'record' if recording else 'warm-up'} {phase}/{bs}")
        if recording:
            self.free -= self.cost[bs] * b.MiB
        return torch.ones(bs, 2) * bs, torch.ones(bs, 3)


def test_vllm_profile_follows_profile_cudagraph_memory_step_by_step(loop_fake, monkeypatch):

    cost = {8: 100, 4: 7, 2: 5, 1: 5}
    mem = _Memory(loop_fake, monkeypatch, cost)
    pools = loop_fake.pools
    out = b.vllm_profile(mem, ("decode", [8, 4, 2, 1]), [("draft_decode", [1, 2])])
    assert loop_fake.pools == pools + 1  # ONE throwaway pool for everything
    full = [s for bs in (8, 4) for s in (f"warm-up decode/{bs}", "free", f"record decode/{bs}", "free")]
    spec = [s for bs in (2, 1) for s in (f"warm-up draft_decode/{bs}", f"record draft_decode/{bs}")]
    # collect and empty the cache; capture_model empties it again, then reads free memory; the 2
    # largest FULL descriptors, each graph block between two free-memory reads; the
    # speculator's graphs in full, largest first; free memory at the end; the teardown
    assert mem.log == ["collect", "empty_cache", "empty_cache", "free", *full, *spec, "free", "collect", "empty_cache"]
    M = b.MiB
    assert out["samples"] == [100 * M, 7 * M] and out["measured"] == (100 + 7 + 5 + 5) * M
    assert out["estimate"] == (117 - 107) * M + 100 * M + 3 * 7 * M and out["full_graphs"] == 4
    assert out["profiled_graphs"] == 4  # 2 FULL + 2 speculator


def test_vllm_capture_copies_every_size_into_one_persistent_buffer(loop_fake, monkeypatch):
    import torch

    mem = _Memory(loop_fake, monkeypatch, {8: 100, 4: 7, 2: 5})
    run = b.vllm_capture_model(mem, ("decode", [8, 4, 2]))
    assert list(run.graphs) == [("decode", 8), ("decode", 4), ("decode", 2)] and run.samples == []
    assert run.measured == 112 * b.MiB
    (hidden, aux) = run.buffers["decode"]  # made from the first (largest) warm-up's outputs
    assert hidden.shape == (8, 2) and aux.shape == (8, 3)
    assert torch.equal(hidden[:, 0], torch.tensor([2.0, 2, 4, 4, 8, 8, 8, 8]))  # each size's rows copied in
    graphs = list(run.graphs.values())
    b.vllm_release(run)
    assert run.graphs == {} and run.buffers == {} and all(g.calls == [] for g in graphs)


def test_hidden_state_outputs_swaps_the_head_and_restores_it():
    torch = pytest.importorskip("torch")

    class Hf:
        def __init__(self):
            self.model = torch.nn.Module()
            self.model.lm_head = torch.nn.Linear(2, 5)

        def run(self, phase, bs, ws):
            return self.model.lm_head(torch.ones(bs, 2))

    t = Hf()
    head = t.model.lm_head
    with b.hidden_state_outputs(t):
        assert t.run("decode", 3, None).shape == (3, 2)
    assert t.model.lm_head is head and t.run("decode", 3, None).shape == (3, 5)
    with pytest.raises(TypeError, match="no LM head"):
        with b.hidden_state_outputs(object()):
            pass


@pytest.mark.gpu
def test_vllms_method_on_the_gpu_replays_hidden_states_and_estimates_its_capture():
    """bench/baselines.py on the small reference model: vLLM's capture replays the final
    norm's hidden states (equal to an eager run's), one buffer serving every size, and its
    estimate is positive and no larger than capturing everything would suggest."""
    import torch

    from capture_plan.references.decode import ReferenceConfig, ReferenceModel
    from capture_plan.schemas.spec import Model

    model = ReferenceModel(ReferenceConfig(model=Model(layers=2), max_bs=64))
    gen = torch.Generator(device="cuda")
    gen.manual_seed(0)
    reqs = b.vllm_full_decode_requests(b.vllm_capture_sizes(max_num_seqs=64, max_num_batched_tokens=64))
    assert reqs[0] == 64
    with b.hidden_state_outputs(model):
        model.prepare("decode", 64, 64, gen)
        prof = b.vllm_profile(model, ("decode", reqs))
        assert prof["estimate"] > 0 and prof["profiled_graphs"] == 2 and len(prof["samples"]) == 2
        run = b.vllm_capture_model(model, ("decode", reqs))
        try:
            assert list(run.graphs) == [("decode", n) for n in reqs] and run.measured > 0
            (hidden,) = run.buffers["decode"]
            assert hidden.shape == (64, model.cfg.model.hidden)
            for n in (64, 8, 1):
                model.prepare("decode", n, n, gen)
                run.graphs[("decode", n)].replay()
                got = hidden[:n].clone()
                assert torch.equal(got, model.run("decode", n, None))
        finally:
            b.vllm_release(run)


def _installation(tmp_path: Path) -> Path:
    """VENV/bin/planner of a fake installation whose python imports a copy of this checkout's
    package files (what pip install . puts in site-packages that build_bench compares)."""
    site = tmp_path / "site" / "capture_plan"
    for source in [*ROOT.glob("*.py"), *(ROOT / "planner" / "data").glob("*.toml")] + [
        f for pkg in ("planner", "schemas", "executor", "adapters", "references") for f in (ROOT / pkg).rglob("*.py")
    ]:
        copy = site / source.relative_to(ROOT)
        copy.parent.mkdir(parents=True, exist_ok=True)
        copy.write_bytes(source.read_bytes())
    bin_ = tmp_path / "venv" / "bin"
    bin_.mkdir(parents=True)
    python = bin_ / "python"
    python.write_text(f'#!/bin/sh\nPYTHONPATH={site.parent} exec {sys.executable} -c "$2"\n')
    python.chmod(0o755)
    return bin_ / "planner"


def test_build_bench_refuses_an_installation_whose_data_files_are_not_the_checkouts(tmp_path):
    """--planner times an installation only where it holds this checkout's package: a data
    file edited since the install (the build reads it) is refused too, in one line."""
    bb = bench_module("build_bench")
    planner = _installation(tmp_path)
    bb._check_installed(str(planner))  # the same files: accepted
    toml = tmp_path / "site" / "capture_plan" / "planner" / "data" / "backends.toml"
    toml.write_bytes(toml.read_bytes() + b"\n# edited\n")
    with pytest.raises(SystemExit, match=r"its installation is not this checkout's code \(planner/data/backends.toml"):
        bb._check_installed(str(planner))


def test_a_timed_report_is_named_after_its_run_not_its_day_alone(tmp_path):
    """device_bench's timing mode writes a capture report per case beside its result: two
    runs of one day (another --tag, as ResultExists tells) must not write the same report,
    or the second replaces the first's (committed, quoted by the docs) unasked."""
    db = bench_module("device_bench")
    first = h.result_path(tmp_path, "device", "2026-12-02T03:00:00+00:00", "timing")
    second = h.result_path(tmp_path, "device", "2026-12-02T05:00:00+00:00", "engines")
    a, b = (db.timed_report_path(Path(p), "reference") for p in (first, second))
    assert a != b and a.parent == b.parent == tmp_path
    assert a.name == f"report-reference-timed-{Path(first).stem.removeprefix('device-')}.json"


def test_the_vllm_034_mode_builds_the_plan_for_the_graphs_vllm_captures(tmp_path):
    """device_bench's vllm-0.34 mode: vLLM 0.34.0's default graphs on an H200 for a case, and
    a plan of the same graphs (the case's spec at vLLM's sizes): the reference's 51 decode
    graphs; EAGLE's verify graphs at query length 4 and its 64 draft decode graphs to 1024."""
    pytest.importorskip("torch")  # device_bench imports the executor
    from capture_plan.planner import build_plan

    d = bench_module("device_bench")
    harness = bench_module("harness")
    for case, main, drafts in (("reference", 51, None), ("eagle", 49, 64)):
        folder = tmp_path / case
        folder.mkdir()
        full, spec, sizes, plan = d.vllm034_setup(case, build_plan(harness.case_options(case, folder)), 32, folder)
        assert len(full[1]) == main and {q for _, q in sizes.decode} == ({1} if case == "reference" else {4})
        want = {full[0]: full[1], **dict(spec)}
        assert {p.name: sorted(p.sizes, reverse=True) for p in plan.phases} == want
        # vLLM's target graph returns hidden states (logits outside it): the plan models the
        # `full` kind for it, not a decode graph with an lm_head and float32 logits
        kinds = {p.name: p.kind for p in plan.phases}
        assert kinds[full[0]] == "full"
        assert all(kinds[p] == p for p, _ in spec)
        if drafts:
            assert len(dict(spec)["draft_decode"]) == drafts and max(dict(spec)["draft_decode"]) == 1024


@pytest.mark.parametrize("case", ["llama", "gemma2", "qwen2", "mixtral", "qwen2_moe"])
def test_the_vllm_034_mode_sets_up_every_transformers_case(tmp_path, case):
    """Issue 49, item 7: the vllm-0.34 mode of a transformers case stopped at its own spec
    (``[model] names a config and also lists layers, ...``: the model read from the config
    written back beside it). Failed before for all five; the plan of vLLM's graphs is now
    built from the case's config alone, at vLLM 0.34.0's decode request counts."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from capture_plan.planner import build_plan

    d = bench_module("device_bench")
    full, spec, sizes, plan = d.vllm034_setup(case, build_plan(h.case_options(case, tmp_path)), 32, tmp_path)
    assert full[0] == "decode" and not spec
    assert {p.name: sorted(p.sizes, reverse=True) for p in plan.phases} == {"decode": full[1]}
    assert plan.predicted.pool_bytes > 0
    written = (tmp_path / f"{case}-vllm-0.34.toml").read_text()
    assert 'config = "config.json"' in written and "layers" not in written


def test_a_reference_case_sizes_its_kv_cache_for_the_device_it_runs_on():
    """Issue 49, item 7: the EAGLE case's target kept 1025 cache rows of 512 tokens over 33
    layers (about 69 GiB, sized for an H200) and ran out of memory on an H100 80GB. The cache
    length now fits KV_SHARE of the free memory: 512 where it fits (an H200), shorter on an
    H100, and a device where not even the longest phase fits is refused, saying why."""
    gib = 1 << 30
    eagle = dict(slots=1025, layers=33, kv_heads=8, head_dim=128, longest=4)
    on_h200 = h.fit_seqlen(budget=int(139 * gib * h.KV_SHARE), **eagle)
    on_h100 = h.fit_seqlen(budget=int(78 * gib * h.KV_SHARE), **eagle)
    assert on_h200 == h.REFERENCE_SEQLEN and 4 < on_h100 < h.REFERENCE_SEQLEN
    per_token = 1025 * 33 * 2 * 8 * 128 * 2
    assert on_h100 * per_token <= 78 * gib * h.KV_SHARE < (on_h100 + 1) * per_token
    assert h.fit_seqlen(budget=10 * per_token + 5, page_size=4, **{**eagle, "longest": 3}) == 8
    with pytest.raises(h.CaseDoesNotFit, match=r"needs .* MiB at the shortest cache \(5 tokens\)"):
        h.fit_seqlen(budget=3 * per_token, **eagle)


def test_a_case_that_does_not_fit_the_device_is_skipped_with_its_reason(monkeypatch):
    """A bench sizes itself for its device or skips the case saying why: the child process
    reports the case's modes as skipped (the parent prints SKIPPED and the reason) instead
    of ending in a traceback."""
    pytest.importorskip("torch")
    d = bench_module("device_bench")

    def too_big(*a, **kw):
        raise h.CaseDoesNotFit("its KV cache needs 9 MiB", where="here", fix="a larger device")

    monkeypatch.setattr(d, "case_target", too_big)
    monkeypatch.setattr(d, "free_bytes", lambda: 0)
    got = d.child("reference", ["vllm-0.34"], 32, 256)
    why = "reference does not fit this device: here: its KV cache needs 9 MiB; fix: a larger device"
    assert got["vllm-0.34"]["skipped"] == why


def test_startup_added_is_the_prediction_plus_the_capture_after_it_less_the_capture_alone():
    """device_bench's start-up cost of a first prediction: what the start-up takes beyond the
    capture alone (each in a fresh process), not the prediction over the capture after it,
    which pays the process's first-use costs the capture then skips; None without both modes."""
    d = bench_module("harness")
    row = {"executor": {"capture_s": 1.5}, "startup": {"predict_s": 0.5, "capture_s": 1.2}}
    got = d.startup_added(row)
    assert got["added_s"] == pytest.approx(0.2) and got["added_of_capture"] == pytest.approx(0.2 / 1.5)
    assert d.startup_added({"startup": row["startup"]}) is None
    assert d.startup_added({"executor": row["executor"], "startup": {"error": "OOM"}}) is None


def test_the_copies_bench_summary_compares_medians_and_says_when_driver_memory_differs():
    """bench/copies_bench.py's summary line is what the issue note quotes: the median of
    each way, their ratio, and whether both ways took the prediction's driver memory."""
    summary = bench_module("copies_bench").summary

    def run(seconds, took):
        return {"seconds": seconds, "phases": {"decode": {"took_bytes": took}}}

    same = {
        "in-turn": [run(0.2, 4), run(0.3, 4), run(0.4, 4)],
        "side-by-side": [run(0.1, 4), run(0.5, 4), run(0.15, 4)],
    }
    assert summary("reference", same) == (
        "reference: copies in turn 0.300 s, side by side 0.150 s (0.50x, medians of 3 and 3), "
        "the same driver memory per phase in every process"
    )
    differs = {"in-turn": [run(0.2, 4)], "side-by-side": [run(0.1, 6), {"error": "boom"}]}
    assert summary("eagle", differs).endswith("(0.50x, medians of 1 and 1), driver memory differs")
    assert summary("eagle", {"in-turn": [{"error": "boom"}], "side-by-side": [run(0.1, 4)]}) == (
        "eagle: a way failed in every process"
    )


def test_side_stream_summary_spans_the_runs_and_skips_failed_ones():
    """side_stream_bench's SUMMARY: per step the outside and in-torch MiB over the runs that
    finished (one figure where they agree, lo..hi where not); a run that failed is left out."""
    from bench import side_stream_bench as ss

    def run(first_out: int) -> dict:
        return {
            "default_stream": {"outside_bytes": first_out << 20, "reserved_growth_bytes": 32 << 20},
            "first_side_stream": {"outside_bytes": 0, "reserved_growth_bytes": 52 << 20},
            "second_side_stream": {"outside_bytes": 0, "reserved_growth_bytes": 52 << 20},
        }

    res = {"dtype": "bfloat16", "n": 1024, "runs": [run(66), run(68), {"error": "boom"}]}
    assert ss.summary(res) == (
        "SUMMARY 2 runs, bfloat16 1024x1024 matmul, outside torch: default stream 66..68 MiB (torch +32); "
        "first side stream 0 MiB (torch +52); second side stream 0 MiB (torch +52)"
    )
    assert ss.summary({**res, "runs": [{"error": "boom"}]}) == "SUMMARY no run finished"
    # --case: the case's decode step is named, and a case the device cannot hold is left out
    case = {**res, "case": "llama", "runs": [run(66), {"skipped": "llama does not fit this device"}]}
    assert ss.summary(case).startswith("SUMMARY 1 runs, llama decode step, outside torch: default stream 66 MiB")
    # --streams: the first torch stream's bytes over the runs, a driver stream's, torch's pool count
    streams = {
        "first_torch_stream": {"outside_bytes": 70 << 20},
        "raw_streams": {"count": 64, "outside_bytes": 34 << 20, "per_stream_bytes": (34 << 20) / 64},
        "pool_streams": 132,
    }
    assert ss.summary({"streams": 64, "runs": [streams, {"error": "boom"}]}) == (
        "SUMMARY 1 runs, outside torch: first torch.cuda.Stream() 70..70 MiB; a driver stream 544..544 KiB; "
        "torch's pools 132 streams"
    )
