"""fit counts graph execs as the engines capture them (planner/fit/graph_count.py) and prices
them with devices.toml's per-graph figure where one is measured (planner/fit/estimate.py)."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import msgspec
import pytest

from bench_modules import bench_module
from capture_plan.planner.fit import estimate
from capture_plan.planner.fit.fit import FitRequest, fit
from capture_plan.planner.fit.graph_count import sglang_graphs, vllm_graphs
from capture_plan.planner.fit.graph_pool import Captures, Graph, _spec_model
from capture_plan.planner.fit.model import load_model
from capture_plan.planner.inputs.resources import data

ROOT = Path(__file__).resolve().parent.parent
LLAMA_CFG = "tests/data/engine_logs/configs/llama-3.1-8b-instruct.json"
LLAMA = ROOT / LLAMA_CFG
H100 = "NVIDIA H100 80GB HBM3"
#: vLLM's 51 default capture sizes (max_num_seqs 1024 on an H100: up to 512)
SIZES = [1, 2, 4, *range(8, 257, 8), *range(272, 513, 16)]


def test_vllm_captures_layers_plus_one_pieces_per_piecewise_size():
    assert len(SIZES) == 51
    both = vllm_graphs("FULL_AND_PIECEWISE", SIZES, 1024, 32)
    assert (both.whole, both.execs) == (102, 51 + 51 * 33)
    assert "51 sizes x 33 PIECEWISE pieces + 51 FULL" in both.how
    assert vllm_graphs("PIECEWISE", SIZES, 1024, 32)[:2] == (51, 51 * 33)
    assert vllm_graphs("FULL", SIZES, 8, 32)[:2] == (51, 51)
    # FULL decode graphs only for the sizes up to max_num_seqs
    decode = [s for s in SIZES if s <= 256]
    assert vllm_graphs("FULL_DECODE_ONLY", SIZES, 256, 32)[:2] == (len(decode), len(decode))
    assert vllm_graphs("FULL_AND_PIECEWISE", SIZES, 256, 32)[:2] == (51 + len(decode), 51 * 33 + len(decode))


def test_sglang_breakable_prefill_graphs_have_a_segment_per_attention_layer_and_one():
    assert sglang_graphs(36, 10, 28)[:2] == (46, 36 + 10 * 29)
    assert sglang_graphs(36, 0, 28)[:2] == (36, 36)


def _graph(monkeypatch=None, devices: dict | None = None, **settings):
    """fit's graph item for Llama-3.1-8B on an H100 under vLLM 0.19.0, with ``devices`` in
    place of planner/data/devices.toml where given."""
    if devices is not None:
        monkeypatch.setattr(estimate, "data", lambda name: devices if name == "devices.toml" else data(name))
    r = fit(FitRequest(load_model(str(LLAMA)), H100, "vllm==0.19.0", 1, {"max-model-len": 8192, **settings}))
    return next(i for i in r.items if i.name == "graph memory")


def test_without_a_per_graph_figure_the_execs_are_priced_by_their_nodes_and_fit_says_so(monkeypatch):
    devs = copy.deepcopy(data("devices.toml"))
    devs["graph_exec_per_graph"].pop("sm90", None)  # a capability nobody measured
    g = _graph(monkeypatch, devs)
    assert g.bytes and g.status == "estimated"
    assert "1734 graph execs (51 sizes x 33 PIECEWISE pieces + 51 FULL)" in g.source
    assert "per-graph cost is not measured for sm90" in g.source


@pytest.mark.parametrize("per_graph", [128 << 10, 512 << 10])
def test_a_measured_per_graph_figure_prices_every_exec_and_leaves_the_per_node_figure_without_it(
    per_graph, monkeypatch
):
    devs = copy.deepcopy(data("devices.toml"))
    devs["graph_exec_per_graph"].pop("sm90", None)
    base = _graph(monkeypatch, devs)
    devs["graph_exec_per_graph"]["sm90"] = per_graph
    got = _graph(monkeypatch, devs)
    basis = devs["graph_exec_per_node_basis"]["sm90"]
    nodes = 102 * round(estimate.nodes_per_layer(load_model(str(LLAMA))) * 32)  # the llama family a layer x 32
    # 1,734 execs at the per-graph figure; the per-node figure less what it held of it
    want = 1734 * per_graph - nodes * per_graph * basis["graphs"] / basis["nodes"]
    assert got.bytes - base.bytes == pytest.approx(want, abs=2)
    assert f"x {per_graph} B per graph" in got.source
    # piecewise pieces cost per graph: the same sizes captured whole cost less
    full = _graph(monkeypatch, devs, **{"cudagraph-mode": "FULL"})
    assert got.bytes - full.bytes > 51 * 33 * per_graph * 0.9


def test_the_per_node_basis_is_the_committed_bench_and_each_per_graph_figure_has_one():
    devs = data("devices.toml")
    for sm in devs["graph_exec_per_node_basis"]:
        assert sm in devs["graph_exec_per_node"]
    bench = json.loads((ROOT / "bench" / "results" / "graph-exec-2026-12-01.json").read_text())
    ok = [c for c in bench["cases"].values() if c.get("nodes")]
    assert devs["graph_exec_per_node_basis"]["sm90"] == {
        "graphs": sum(c["graphs"] for c in ok),
        "nodes": sum(c["nodes"] for c in ok),
    }
    assert (
        round(sum(c["instantiate_bytes"] for c in ok) / sum(c["nodes"] for c in ok))
        == devs["graph_exec_per_node"]["sm90"]
    )
    for sm in devs.get("graph_exec_per_graph", {}):
        assert sm in devs["graph_exec_per_node_basis"], f"[graph_exec_per_graph] {sm} needs its per-node basis"


def test_the_sm90_per_graph_figure_is_the_committed_overhead_bench_fit():
    """devices.toml's [graph_exec_per_graph] sm90 is the H200 overhead run's fit, rounded: the
    figure its comment names, not a typed copy that could drift from it."""
    devs = data("devices.toml")
    bench = json.loads((ROOT / "bench" / "results" / "graph-exec-overhead-2026-12-06.json").read_text())
    assert bench["mode"] == "overhead" and bench["device"] == "NVIDIA H200"
    assert devs["graph_exec_per_graph"]["sm90"] == round(bench["fit"]["per_graph_bytes"])
    # the per-node figure fit then uses stays the model graphs' one, less what the per-graph absorbed
    graph, node = estimate.per_graph("sm90")
    basis = devs["graph_exec_per_node_basis"]["sm90"]
    assert graph == devs["graph_exec_per_graph"]["sm90"]
    assert node == pytest.approx(devs["graph_exec_per_node"]["sm90"] - graph * basis["graphs"] / basis["nodes"])


def test_the_overhead_bench_fit_recovers_per_graph_and_per_node_bytes():
    fit_ = bench_module("graph_exec_bench").overhead_fit
    pts = [{"k": k, "n": n, "exec": n * 300_000 + n * k * 2_500} for k in (1, 4, 16, 64, 256) for n in (64, 256, 1024)]
    f = fit_(pts)
    assert f["per_graph_bytes"] == pytest.approx(300_000)
    assert f["per_node_bytes"] == pytest.approx(2_500)
    assert f["max_abs_residual_bytes"] < 1


def _inputs(config: str, tp: int, sm: str):
    from types import SimpleNamespace

    m = load_model(str(ROOT / config))
    return SimpleNamespace(model=m, tp=tp, device=SimpleNamespace(sm=sm))


def test_vllm_full_graphs_on_fa3_hold_split_kv_accumulators_at_each_attention_call():
    # vLLM 0.19.0 flash_attn.py: 32 splits for FULL-graph batches; FA3's float32 out_accum
    # [splits, heads, tokens, head_dim_v] and softmax_lse_accum [splits, heads, tokens]
    from capture_plan.planner.fit import graph_pool
    from capture_plan.planner.fit.vllm import split_kv_accum, vllm_captures

    inp = _inputs(LLAMA_CFG, 1, "sm90")
    per_token, why = split_kv_accum(inp)
    assert per_token == 4 * 32 * 32 * (128 + 1) and "split-KV" in why
    assert split_kv_accum(_inputs(LLAMA_CFG, 4, "sm90"))[0] == per_token // 4  # heads per rank
    assert split_kv_accum(_inputs(LLAMA_CFG, 1, "sm80")) is None  # FA2: no num_splits in graphs
    assert split_kv_accum(_inputs("planner/data/configs/deepseek-v2-lite.json", 1, "sm90")) is None  # MLA
    # vLLM's order: PIECEWISE sizes first, then FULL ones (decode sizes <= max_num_seqs), each
    # largest first; the accumulators in FULL graphs only (attention runs between pieces)
    caps = vllm_captures(inp, "FULL_AND_PIECEWISE", SIZES, 256)
    assert caps.graphs[: len(SIZES)] == [Graph(t, pieces=True) for t in sorted(SIZES, reverse=True)]
    assert caps.graphs[len(SIZES) :] == [Graph(t, t * per_token) for t in sorted(SIZES, reverse=True) if t <= 256]
    assert vllm_captures(inp, "PIECEWISE", SIZES, 256).extra_source == ""
    # in the simulated pool they add at most their block at the largest FULL size: the layer's
    # later temporaries are served from it once it is freed
    m = inp.model
    full = Captures([g for g in caps.graphs if g.extra])
    bare = Captures([Graph(g.tokens) for g in full.graphs])
    grown = graph_pool.pool_bytes(m, 1, "sm90", full)[0] - graph_pool.pool_bytes(m, 1, "sm90", bare)[0]
    assert 0 < grown <= 256 * per_token + (2 << 20)
    # and fit's graph memory holds them where vLLM captures FULL graphs
    both, piecewise = _graph(), _graph(**{"cudagraph-mode": "PIECEWISE"})
    assert "split-KV accumulators" in both.source and "split-KV" not in piecewise.source
    assert both.bytes > piecewise.bytes


def test_sglangs_graph_memory_holds_the_shared_float32_logits_buffer(monkeypatch):
    """SGLang 0.5.23's capture drop holds GraphSharedOutput's (largest decode size x vocabulary)
    float32 logits buffer: fit adds it to the estimate, not to a measured graph figure."""
    from capture_plan.planner.fit import sglang
    from capture_plan.schemas.fit import FitItem

    def graph(**flags):
        r = fit(FitRequest(load_model(str(LLAMA)), H100, "sglang==0.5.23", 1, {"context-length": 8192, **flags}))
        return next(i for i in r.items if i.name == "graph memory")

    with_buffer = graph()
    assert "shared float32 logits buffer, 256 x 128256" in with_buffer.source
    with monkeypatch.context() as m:
        m.setattr(sglang, "_with_logits_buffer", lambda item, rows, vocab: item)
        assert with_buffer.bytes - graph().bytes == 256 * 128256 * 4
    given = FitItem("graph memory", 1 << 30, 0, "given", "a calibration")
    r = fit(
        FitRequest(load_model(str(LLAMA)), H100, "sglang==0.5.23", 1, {"context-length": 8192}, measured_graph=given)
    )
    assert next(i for i in r.items if i.name == "graph memory").bytes == 1 << 30


def test_sglangs_breakable_prefill_graphs_share_its_pool_before_the_decode_graphs():
    """SGLang 0.5.23 captures its breakable prefill graphs (the CUDA default) into the one
    global pool before its decode graphs, each largest first: the transformer body in pieces,
    attention run between them, no LM head; then the decode graphs with their model-dtype
    logits. fit's graph memory holds that pool: with the prefill graphs on it is larger than
    without them by more than the decode pool alone (before: the decode sizes only, as if the
    prefill graphs took no pool)."""
    from capture_plan.planner.fit import graph_pool
    from capture_plan.planner.fit.sglang import sglang_captures
    from capture_plan.planner.fit.sizing import sglang_decode_sizes, sglang_prefill_sizes

    prefill, decode = sglang_prefill_sizes(8192), sglang_decode_sizes(256, False)
    caps = sglang_captures(prefill, decode)
    assert caps.graphs == [Graph(t, pieces=True) for t in sorted(prefill, reverse=True)] + [
        Graph(b, logits=True) for b in sorted(decode, reverse=True)
    ]
    m = load_model(str(LLAMA))
    both = graph_pool.pool_bytes(m, 1, "sm90", caps)[0]
    alone = graph_pool.pool_bytes(m, 1, "sm90", sglang_captures([], decode))[0]
    assert both > alone > 0

    def graph(**flags):
        r = fit(FitRequest(m, H100, "sglang==0.5.23", 1, {"context-length": 8192, **flags}))
        return next(i for i in r.items if i.name == "graph memory")

    on, off = graph(), graph(**{"disable-prefill-cuda-graph": True})
    assert "in pieces" in on.source and "in pieces" not in off.source
    assert on.bytes - off.bytes >= both - alone


def test_fit_simulates_each_distinct_capture_once_while_it_checks_its_fixes():
    """A result that does not fit is answered again for each fix fit checks (a larger
    utilization, --tp 2), and each prices the same capture lists: the pool simulation runs
    once per distinct (model, backend, tp, graphs), not once per answer (fails before: every
    answer simulated every list again, seconds each at thousands of capture sizes)."""
    from capture_plan.planner.fit import graph_pool

    graph_pool._simulated.cache_clear()
    m = load_model(str(ROOT / "planner/data/configs/llama-3.1-8b.json"))
    res = fit(FitRequest(m, "H100", "vllm==0.34.0", 1, {"gpu-memory-utilization": 0.1}))
    assert not res.fits and res.fixes  # a starved budget: its fixes were checked
    info = graph_pool._simulated.cache_info()
    assert info.hits > 0, info  # the fixes' answers priced lists simulated for the first answer


def test_an_eagle_draft_step_allocates_as_vllms_speculator_runs_it():
    """planner/memory/analytic.py eagle_draft_program against vLLM's code (target_dependent_ar/
    speculator.py _prefill and _decode, llama_eagle.py LlamaModel.forward, sample_draft's greedy
    path): the positions gathered, the embedding, its concatenation with the target's hidden
    states and fc; after the layers, hidden + residual, each request's last token gathered, the
    model-dtype logits of the requests alone and the argmax (0.34.0's partials per 4096 columns,
    0.33.0's torch argmax none), every tensor freed by the step's end."""
    from capture_plan.planner.inputs.resources import backend
    from capture_plan.planner.memory.analytic import eagle_draft_program
    from capture_plan.planner.memory.program import Alloc, Free

    m = msgspec.structs.replace(_spec_model(load_model("llama-3-8b")), layers=1)
    h, v, reqs, q = m.hidden, m.vocab, 2, 4
    tokens = reqs * q
    p = eagle_draft_program(m, reqs, q, 1, backend("fa3"), argmax_block=4096)
    assert [op.size for op in p.prologue if type(op) is Alloc] == [
        8 * reqs,
        8 * reqs,
        tokens * h * 2,
        tokens * 2 * h * 2,
        tokens * h * 2,
    ]
    assert type(p.prologue[-1]) is Free and p.repeats == 1 and p.carry_in == p.prologue[-2].id
    sizes = [op.size for op in p.epilogue if type(op) is Alloc]
    splits = -(-v // 4096)
    assert sizes == [tokens * h * 2, reqs * h * 2, reqs * v * 2, reqs * 8, reqs * splits * 4, reqs * splits * 4]
    made = {op.id for sec in (p.prologue, p.epilogue) for op in sec if type(op) is Alloc}
    freed = {op.id for sec in (p.prologue, p.epilogue) for op in sec if type(op) is Free}
    assert made <= freed | {p.carry_in}  # nothing outlives the step (the carry dies in the body)
    # 0.33.0's argmax keeps no partials; a decode graph of 2 fused steps runs the head twice,
    # one token a request, no gather
    old = eagle_draft_program(m, reqs, q, 1, backend("fa3"))
    assert [op.size for op in old.epilogue if type(op) is Alloc] == sizes[:4]
    dec = eagle_draft_program(m, reqs, 1, 2, backend("fa3"), argmax_block=4096)
    logits = [op for sec in (dec.prologue, dec.epilogue) for op in sec if type(op) is Alloc and op.size == reqs * v * 2]
    assert len(logits) == 2 and not any(type(op) is Alloc and op.size == 8 * reqs for op in dec.prologue)


def test_each_draft_manager_is_a_pool_of_its_own_segments():
    """vLLM captures each manager on a capture stream of its own (graph_capture makes one), and
    the caching allocator gives a stream's freed blocks to that stream alone: the draft's pool
    is the sum of each manager's, with one cuBLAS workspace per stream in the graph figure."""
    from capture_plan.planner.fit import graph_pool
    from capture_plan.planner.fit.graph_pool import DraftCaptures, DraftGraph

    target = load_model(str(LLAMA))
    head = msgspec.structs.replace(target, layers=1)
    prefill = tuple(DraftGraph(n, 4, 1) for n in (128, 64, 8))
    decode = tuple(DraftGraph(n, 1, 2) for n in (1024, 512, 8))

    def pool(*managers):
        return graph_pool.pool_bytes(target, 1, "sm90", Captures([], draft=DraftCaptures(head, managers, 4096)))[0]

    assert pool(prefill, decode) == pool(prefill) + pool(decode)
    # one stream would have served the decode graphs from the prefill graphs' freed blocks
    assert pool(prefill + decode) < pool(prefill, decode)
    assert Captures([Graph(8)], draft=DraftCaptures(head, (prefill, decode))).streams == 3
