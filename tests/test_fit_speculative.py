"""`planner fit` under speculative decoding (issue 52 Deliver 1: the draft model's weights and KV).

The expected figures are computed here by hand from the configs (planner/data/configs) and the
rules as planner/data/fit_rules.toml [speculative] reads them from the wheels, not by fit's own
functions: an EAGLE head's weights (its layer, its fc, its rotary cache; the target's embedding
and lm_head shared), the KV cache less exactly the draft's bytes, and the tokens it holds with
the draft's layer in every block (vLLM) or in every cell (SGLang).
"""

from __future__ import annotations

import json
import math
import shlex
from pathlib import Path

import msgspec
import pytest

from capture_plan.planner.cli import main

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "planner/data/configs"
TARGET = str(CONFIGS / "llama-3.1-8b.json")
EAGLE = str(CONFIGS / "eagle-llama-3.1-8b.json")
H = 4096  # both configs' hidden_size
PATH = ("--speculative-draft-model-path", EAGLE)


#: the published config.json each EAGLE head's file copies, as read from the file its _source
#: names (repository, path at a commit): what the test holds the committed copy to
_LLAMA3_HEAD = {
    "architectures": ["LlamaForCausalLM"],
    "bos_token_id": 128000,
    "eos_token_id": 128001,
    "hidden_act": "silu",
    "hidden_size": 4096,
    "initializer_range": 0.02,
    "intermediate_size": 14336,
    "max_position_embeddings": 2048,
    "model_type": "llama",
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "num_hidden_layers": 1,
    "pad_token_id": 0,
    "rms_norm_eps": 1e-05,
    "tie_word_embeddings": False,
    "torch_dtype": "float16",
    "transformers_version": "4.28.1",
    "use_cache": True,
    "vocab_size": 128256,
}
PUBLISHED = {
    "eagle-llama-3.1-8b.json": (
        "SafeAILab/EAGLE/blob/f872b7fe099672e48a6d4fb7fdabe7cea2bda767/eagle/train/EAGLE-LLaMA3-Instruct-8B.json",
        {**_LLAMA3_HEAD, "rope_theta": 500000.0, "bias": False},
    ),
    "eagle3-llama-3.1-8b.json": (
        "SafeAILab/EAGLE/blob/9666a8182d9bed8b5b637fd4a126c90d9b9c3db2/eagle/traineagle3/config.json",
        {**_LLAMA3_HEAD, "draft_vocab_size": 32000},
    ),
}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_the_eagle_heads_configs_are_the_published_ones(name):
    """Each head's config.json is the published one its _source names, no field changed or
    added (eagle-llama-3.1-8b.json was written from memory: max_position_embeddings 8192 where
    yuhuili's heads publish 2048), and the source says what it did not verify."""
    cfg = json.loads((CONFIGS / name).read_text())
    source = cfg.pop("_source")
    where, published = PUBLISHED[name]
    assert where in source and cfg == published
    if name == "eagle-llama-3.1-8b.json":  # the Llama-3.1 head's own file was not found
        assert "assumed, not verified" in source


def run(*args: str, capsys) -> tuple[int, str, str]:
    code = main(list(args))
    out = capsys.readouterr()
    return code, out.out, out.err


def fit_json(engine: str, *more: str, capsys) -> dict:
    code, out, err = run(
        "fit", "--model", TARGET, "--device", "H100", "--engine", engine, *more, "--json", capsys=capsys
    )
    assert code == 0, err
    return json.loads(out)


def item(res: dict, name: str) -> dict:
    return next(i for i in res["items"] if i["name"] == name)


def eagle_head_bytes(rotary_element: int, fc_bias: bool) -> int:
    """eagle-llama-3.1-8b.json by hand: one Llama layer (q, k, v, o; gate, up, down; its
    post-attention RMS norm alone: both engines' llama_eagle.py delete the first layer's input
    norm), no final norm (neither builds one), fc (2 x hidden -> hidden), the rotary cos/sin
    cache of 8192 positions (the target's 8192 tokens, past its own 2048: vLLM raises them,
    SGLang under SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN) x head_dim 128; float16. No
    embedding, no lm_head (the target's, shared)."""
    attn = H * (32 + 2 * 8) * 128 * 2 + 32 * 128 * H * 2
    mlp = 3 * H * 14336 * 2
    norms = 1 * H * 2
    fc = 2 * H * H * 2 + (H * 2 if fc_bias else 0)
    return attn + mlp + norms + fc + 8192 * 128 * rotary_element


#: the V2 runner's buffers that grow with 3 speculative tokens at the H100's 1024 sequences
#: (fit_rules.toml [buffers.vllm-0-33]): RequestState.draft_tokens (1024 x 3 int64), and the
#: structured outputs' logits indices and bitmask over 1024 x (1 + 3) rows (int32, the bitmask
#: cdiv(128256, 32) = 4008 words a row) instead of 1024
SPEC_BUFFERS = 1024 * 3 * 8 + 1024 * 3 * 4 + 1024 * 3 * 4008 * 4


def spec(method: str, model: str | None = EAGLE, n: int = 3) -> str:
    d = {"method": method, "num_speculative_tokens": n}
    if model is not None:
        d["model"] = model
    return json.dumps(d)


@pytest.mark.parametrize("engine", ["vllm==0.34.0", "vllm==0.33.0"])
def test_vllm_eagle_head_weights_and_its_layer_in_every_block(engine, capsys):
    """Llama-3.1-8B + its EAGLE head on an H100, no graphs (enforce-eager: the graph figure is 0
    either way, so the comparison is exact): the cache is smaller by the head's bytes, and a
    block is one 16-token page of the 32 target layers and the head's one layer (4096 B a token
    each: 8 KV heads x (128 + 128) x 2), and by the runner's buffers that grow with the 3
    speculative tokens (:data:`SPEC_BUFFERS`; the speculator's own are not counted)."""
    base = ("--max-model-len", "8192", "--enforce-eager")
    alone = fit_json(engine, *base, capsys=capsys)
    res = fit_json(engine, *base, "--speculative-config", spec("eagle"), capsys=capsys)
    head = eagle_head_bytes(2, fc_bias=False)  # vLLM keeps the rotary cache in the model's dtype
    assert item(res, "draft weights")["bytes"] == head
    assert item(res, "weights")["bytes"] == item(alone, "weights")["bytes"]
    assert item(res, "engine buffers")["bytes"] == item(alone, "engine buffers")["bytes"] + SPEC_BUFFERS
    assert "speculator's own buffers not counted" in item(res, "engine buffers")["source"]
    assert res["kv_bytes"] == alone["kv_bytes"] - head - SPEC_BUFFERS
    block = 16 * (32 * 4096 + 1 * 4096)
    blocks = res["kv_bytes"] // block
    assert res["kv_blocks"] == blocks
    assert res["kv_tokens"] == int(blocks / math.ceil(8192 / 16) * 8192)
    sp = res["speculative"]
    assert sp["draft_layers"] == 1 and sp["draft_kv_bytes_per_token"] == 4096 and sp["tokens"] == 3
    assert sp["kv_tokens_without"] == alone["kv_tokens"] > res["kv_tokens"]
    assert sp["max_concurrency_without"] == alone["max_concurrency"]


def test_vllm_eagle_graphs_are_priced_as_the_speculator_captures_them(capsys):
    """An EAGLE head's graphs, after the target's, on capture streams of their own: the prefill
    manager's (PIECEWISE at the 51 sizes, FULL at the 49 request counts of 4 tokens) and the
    decode manager's FULL ones (0.34.0: its grid to max_num_seqs; 0.33.0: the shared sizes). The
    largest decode graph holds the draft's model-dtype logits of 1024 requests, so the graph
    memory grows by more than those; and with the plan's sizes alone, no figure is near."""
    base = ("--max-model-len", "8192")
    eagle = ("--speculative-config", spec("eagle"))
    for release, decode in (("vllm==0.34.0", 64), ("vllm==0.33.0", 51)):
        # n-gram: the target's graphs at the same verify-width sizes, no draft's
        alone = item(
            fit_json(release, *base, "--speculative-config", spec("ngram", None), capsys=capsys), "graph memory"
        )
        res = fit_json(release, *base, *eagle, capsys=capsys)
        g = item(res, "graph memory")
        assert g["status"] == "estimated" and f"(100 PIECEWISE and FULL + {decode} FULL" in g["source"]
        assert g["bytes"] - alone["bytes"] > 1024 * 128256 * 2
        assert not any("graph memory unknown" in n for n in res["notes"])
    only_decode = fit_json("vllm==0.34.0", *base, *eagle, "--cudagraph-mode", "FULL_DECODE_ONLY", capsys=capsys)
    assert "(49 FULL + 64 FULL" in item(only_decode, "graph memory")["source"]


def test_vllm_draft_graphs_not_modelled_are_unknown_never_zero(capsys):
    """An EAGLE3 head's graphs, and an EAGLE head's under cudagraph mode FULL (token-keyed FULL
    draft graphs): not modelled, so unknown, and the KV figures say they exclude them."""
    base = ("vllm==0.34.0", "--max-model-len", "8192")
    eagle3 = ("--speculative-config", spec("eagle3", str(CONFIGS / "eagle3-llama-3.1-8b.json")))
    for extra in (eagle3, ("--speculative-config", spec("eagle"), "--cudagraph-mode", "FULL")):
        res = fit_json(*base, *extra, capsys=capsys)
        g = item(res, "graph memory")
        assert g["bytes"] is None and g["status"] == "unknown" and "draft" in g["source"]
        assert any("graph memory unknown" in n for n in res["notes"])


def test_the_draft_graphs_sizes_are_the_releases():
    """vLLM 0.34.0's request grid (vllm/config/compilation.py decode_cudagraph_capture_grid: 64
    sizes at 1024, its docstring says) and the EAGLE managers' request counts at the bench's
    sizes: the prefill manager's up to 512 / 4, the decode manager's grid or shared sizes."""
    from capture_plan.planner.fit import sizing

    grid = sizing.vllm_request_grid(1024)
    assert len(grid) == 64 and grid[:8] == [1, 2, 3, 4, 5, 6, 8, 10] and grid[-1] == 1024
    shared = sizing.vllm_default_sizes(1024, 8192)
    prefill, decode = sizing.vllm_draft_graphs(shared, 1024, 3, "request-grid")
    assert len(prefill) == 49 and prefill[0] == 128 and decode == grid[::-1]
    assert sizing.vllm_draft_graphs(shared, 1024, 3, "capture-sizes")[1] == shared[::-1]
    assert sizing.vllm_draft_graphs(shared, 1024, 1, "request-grid")[1] == []  # one step: no decode graphs
    # the sizes vLLM resolves under 3 speculative tokens (the uniform decode sizes appended)
    verify = sizing.vllm_default_sizes(1024, 8192, None, ["max-num-seqs"], 4)
    assert sizing.vllm_draft_graphs(verify, 1024, 3, "request-grid")[0][0] == 128
    # a count past max_num_seqs: 0.34.0 clamps it, 0.33.0 (token-keyed) drops it
    assert sizing.vllm_draft_graphs([1, 4, 8, 20], 4, 3, "request-grid")[0] == [4, 2, 1]
    assert sizing.vllm_draft_graphs([1, 4, 8, 20], 4, 3, "capture-sizes", "tokens")[0] == [2, 1]


def test_vllm_ngram_has_no_draft_weights_nor_kv(capsys):
    """n-gram: no draft weights or KV; the runner keeps its requests' token history on the device
    for it (RequestState.all_token_ids, 1024 x 8192 int32: pinned host memory otherwise) beside
    the buffers that grow with its 3 tokens: the cache is smaller by those alone."""
    base = ("--max-model-len", "8192", "--enforce-eager")
    alone = fit_json("vllm==0.34.0", *base, capsys=capsys)
    res = fit_json("vllm==0.34.0", *base, "--speculative-config", spec("ngram", None), capsys=capsys)
    d = item(res, "draft weights")
    assert d["bytes"] == 0 and d["status"] == "exact" and "[speculative.vllm-0-33]" in d["source"]
    history = 1024 * 8192 * 4
    assert res["kv_bytes"] == alone["kv_bytes"] - history - SPEC_BUFFERS
    assert alone["kv_tokens"] == res["speculative"]["kv_tokens_without"] > res["kv_tokens"]


def test_vllm_ngram_takes_a_sliding_window_target(capsys):
    """n-gram keeps no draft KV, so the target's sliding window is priced as without it (it was
    refused: the draft-layer check ran on the target before the method was known to have none)."""
    gemma = str(Path(TARGET).parent / "gemma-2-9b.json")
    base = ("--model", gemma, "--device", "H100", "--engine", "vllm==0.34.0", "--max-model-len", "4096", "--json")
    code, out, err = run("fit", *base, "--speculative-config", spec("ngram", None), capsys=capsys)
    assert code == 0, err
    code, alone, err = run("fit", *base, capsys=capsys)
    assert code == 0, err
    assert json.loads(out)["speculative"]["kv_tokens_without"] == json.loads(alone)["kv_tokens"]


def test_vllm_capture_sizes_add_the_uniform_decode_widths(capsys):
    """_set_cudagraph_sizes with 2 speculative tokens (query length 3) and max-num-seqs 10: the
    largest size min(10 x 3 x 2, 512) = 60; the grid [1, 2, 4] + 8..56; the uniform decode
    sizes n x 3 for n in 1, 2, 4, 8, 10: 3, 6, 12, 24, 30."""
    res = fit_json(
        "vllm==0.34.0", "--max-num-seqs", "10", "--speculative-config", spec("ngram", None, 2), capsys=capsys
    )
    grid = {1, 2, 4, *range(8, 57, 8)}
    assert res["settings"]["cudagraph-capture-sizes"] == ",".join(map(str, sorted(grid | {3, 6, 12, 24, 30})))


@pytest.fixture
def long_draft(monkeypatch):
    """SGLang runs the EAGLE head (2048 positions) at the target's 8192 tokens only under
    SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN, as a deployment of it at 8192 must set it."""
    monkeypatch.setenv("SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN", "1")


def test_sglang_eagle_head_grows_the_cell_by_its_share(long_draft, capsys):
    """SGLang 0.5.23: both workers load before the pool is sized, so the pool is smaller by the
    head's bytes (its rotary cache float32, its fc with a bias); the target's cell of 32 x 4096
    B grows by int(cell x 1 / 32); mem-fraction-static is the one without speculative decoding;
    a LlamaForCausalLM target gets steps 5, topk 4, 8 draft tokens and 48 running requests."""
    base = ("--context-length", "8192")
    alone = fit_json("sglang==0.5.23", *base, capsys=capsys)
    more = ("--speculative-algorithm", "EAGLE", "--speculative-draft-model-path", EAGLE)
    res = fit_json("sglang==0.5.23", *base, *more, capsys=capsys)
    head = eagle_head_bytes(4, fc_bias=True)
    assert item(res, "draft weights")["bytes"] == head
    assert res["kv_bytes"] == alone["kv_bytes"] - head
    cell = 32 * 4096
    assert res["kv_tokens"] == res["kv_bytes"] // (cell + cell * 1 // 32)
    assert res["speculative"]["kv_tokens_without"] == alone["kv_tokens"]
    s = res["settings"]
    assert s["mem-fraction-static"] == alone["settings"]["mem-fraction-static"]
    assert (s["speculative-num-steps"], s["speculative-eagle-topk"], s["speculative-num-draft-tokens"]) == (5, 4, 8)
    assert s["max-running-requests"] == 48
    assert s["cuda-graph-bs"].startswith("1,2,3,4,5,6,7,8,10,12,")  # the speculative list


def test_sglang_nextn_is_eagle_and_topk_one_sets_the_draft_tokens(long_draft, capsys):
    more = ("--speculative-algorithm", "NEXTN", "--speculative-draft-model-path", EAGLE)
    steps = ("--speculative-num-steps", "3", "--speculative-eagle-topk", "1", "--speculative-num-draft-tokens", "9")
    res = fit_json("sglang==0.5.23", "--context-length", "8192", *more, *steps, capsys=capsys)
    assert res["speculative"]["method"] == "EAGLE" and res["settings"]["speculative-num-draft-tokens"] == 4


def _refused(args: list[str], says: str, capsys) -> dict:
    """A one-line refusal naming ``says`` whose fix (its command between backticks) runs clean."""
    code, _, err = run("fit", "--model", TARGET, "--device", "H100", *args, capsys=capsys)
    assert code == 1 and err.count("\n") == 1 and says in err, err
    argv = shlex.split(err.split("`")[1])
    code, out, fixed = run(*argv[1:], "--json", capsys=capsys)
    assert code == 0, fixed
    return msgspec.json.decode(out)


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (
            ["--engine", "vllm==0.34.0", "--speculative-config", "{"],
            "--speculative-config: --speculative-config is not",
        ),
        (["--engine", "vllm==0.34.0", "--speculative-config", "[1]"], "must be a JSON object"),
        (["--engine", "vllm==0.34.0", "--speculative-config", spec("mtp", None)], "'mtp' is not modelled"),
        (["--engine", "vllm==0.34.0", "--speculative-config", spec("deepseek_mtp", None)], "'mtp' is not modelled"),
        (["--engine", "vllm==0.34.0", "--speculative-config", spec("eagle", None)], "the draft model is not given"),
        (["--engine", "vllm==0.34.0", "--speculative-config", spec("eagle", "missing.json")], "draft model 'missing"),
        (["--engine", "vllm==0.34.0", "--speculative-config", spec("eagle", EAGLE, 0)], "num_speculative_tokens"),
        (
            [
                "--engine",
                "vllm==0.34.0",
                "--speculative-config",
                json.dumps({"model": EAGLE, "num_speculative_tokens": 2}),
            ],
            "gives no method",
        ),
        (
            [
                "--engine",
                "vllm==0.34.0",
                "--speculative-config",
                '{"method": "ngram", "num_speculative_tokens": 2, "foo": 1}',
            ],
            "key 'foo'",
        ),
        (["--engine", "vllm==0.32.0", "--speculative-config", spec("eagle")], "was not read from its wheel"),
        (["--engine", "sglang==0.5.23", "--speculative-algorithm", "EAGLE"], "needs --speculative-draft-model-path"),
        (
            ["--engine", "sglang==0.5.23", "--speculative-algorithm", "EAGLE", "--speculative-draft-model-path", "no"],
            "draft model 'no'",
        ),
        (["--engine", "sglang==0.5.23", "--speculative-algorithm", "DFLASH"], "unknown --speculative-algorithm"),
        (
            ["--engine", "sglang==0.5.23", "--speculative-algorithm", "EAGLE", "--speculative-num-steps", "3", *PATH],
            "needs --speculative-eagle-topk",
        ),
        (
            ["--engine", "sglang==0.5.23", "--speculative-algorithm", "EAGLE", "--speculative-eagle-topk", "2", *PATH],
            "need --speculative-num-steps",
        ),
        (["--engine", "sglang==0.5.23", "--speculative-config", spec("ngram", None)], "sglang has no flag"),
    ],
)
def test_bad_speculative_input_is_one_located_line_whose_fix_runs(args, says, long_draft, capsys):
    _refused(args + ["--max-model-len" if args[1].startswith("vllm") else "--context-length", "8192"], says, capsys)


def test_a_draft_of_another_vocabulary_is_refused_for_draft_model(tmp_path, capsys):
    """vLLM's verify_equal_vocab_size_if_draft_model: a draft_model draft shares the target's vocabulary."""
    cfg = json.loads(Path(EAGLE).read_text())
    cfg["vocab_size"] = 32000
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    args = [
        "--engine",
        "vllm==0.34.0",
        "--max-model-len",
        "8192",
        "--speculative-config",
        spec("draft_model", str(path)),
    ]
    res = _refused(args, "is not the target's (128256)", capsys)
    assert res["speculative"]["method"] == "ngram"


def test_every_speculative_rule_field_is_read():
    """A [speculative] row's field no code reads is dead data: each is read as ``.field`` by fit's modules."""
    from capture_plan.planner.fit.tables import SpecRule

    code = "".join(p.read_text() for p in (ROOT / "planner/fit").glob("*.py"))
    code += (ROOT / "docs/generate.py").read_text()  # the sources and methods the docs' table prints
    assert [f.name for f in msgspec.structs.fields(SpecRule) if f".{f.name}" not in code] == []


def test_sglang_draft_layers_are_its_num_nextn_predict_layers(tmp_path, long_draft, capsys):
    """spec_aux_hidden_state.py _resolve_eagle_aux_hidden_state: a draft config that gives
    num_nextn_predict_layers (a NextN checkpoint keeps the target's num_hidden_layers) has that
    many layers in the cell's share, not its num_hidden_layers; its weights are those layers'."""
    cfg = json.loads(Path(EAGLE).read_text())
    cfg.update(num_hidden_layers=32, num_nextn_predict_layers=1)
    nextn = tmp_path / "nextn.json"
    nextn.write_text(json.dumps(cfg))
    base = ("--context-length", "8192", "--speculative-algorithm", "EAGLE")
    one = fit_json("sglang==0.5.23", *base, *PATH, capsys=capsys)
    res = fit_json("sglang==0.5.23", *base, "--speculative-draft-model-path", str(nextn), capsys=capsys)
    assert res["speculative"]["draft_layers"] == 1
    assert res["speculative"]["draft_kv_bytes_per_token"] == 32 * 4096 // 32
    assert item(res, "draft weights")["bytes"] == item(one, "draft weights")["bytes"]
    assert res["kv_tokens"] == one["kv_tokens"]


def test_a_draft_tp_of_neither_is_refused_with_a_fix_that_says_what(capsys):
    """_verify_and_get_draft_tp: the draft's tp is 1 or the target's; the fix names it (it read
    "fix: : `...`", an empty hint)."""
    d = {"method": "eagle", "model": EAGLE, "num_speculative_tokens": 3, "draft_tensor_parallel_size": 3}
    args = ["--engine", "vllm==0.34.0", "--tp", "2", "--max-model-len", "8192", "--speculative-config", json.dumps(d)]
    code, _, err = run("fit", "--model", TARGET, "--device", "H100", *args, capsys=capsys)
    assert code == 1 and "draft_tensor_parallel_size" in err and "fix: :" not in err, err
    assert "fix: --tp 2" in err, err


def _draft_config(tmp_path: Path, base: str, name: str, **changes) -> str:
    """``base``'s config.json with ``changes`` (a key given None is dropped), written as ``name``."""
    cfg = json.loads(Path(base).read_text())
    cfg.update(changes)
    path = tmp_path / name
    path.write_text(json.dumps({k: v for k, v in cfg.items() if v is not None}))
    return str(path)


def test_vllm_raises_an_eagle_heads_rotary_rows_to_the_max_model_len(tmp_path, capsys):
    """speculative.py _maybe_override_draft_max_position_embeddings: an EAGLE head of 2048
    positions (yuhuili's publish 2048) under --max-model-len 8192 gets a cache of 8192 rows;
    a draft_model draft keeps its own (standalone_ar: shares_target_positions = False), so two
    whole drafts 2048 positions apart differ by 2048 rows; a yarn head is not raised (its cache
    is YaRN's, original_max_position_embeddings 2048 x factor 4 = 8192 rows all the same:
    rotary_embedding/yarn_scaling_rope.py; fit counted 2048 before)."""
    short = _draft_config(tmp_path, EAGLE, "short.json", max_position_embeddings=2048)
    base = ("--max-model-len", "8192", "--enforce-eager")
    res = fit_json("vllm==0.34.0", *base, "--speculative-config", spec("eagle", short), capsys=capsys)
    assert item(res, "draft weights")["bytes"] == eagle_head_bytes(2, fc_bias=False)  # 8192 rows
    assert "raised from 2,048" in item(res, "draft weights")["source"]
    longer = _draft_config(tmp_path, EAGLE, "long.json", max_position_embeddings=4096)
    whole = [
        item(
            fit_json("vllm==0.34.0", *base, "--speculative-config", spec("draft_model", p), capsys=capsys),
            "draft weights",
        )
        for p in (short, longer)
    ]
    assert whole[1]["bytes"] - whole[0]["bytes"] == 2048 * 128 * 2
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 2048}
    y = _draft_config(tmp_path, EAGLE, "yarn.json", max_position_embeddings=2048, rope_scaling=yarn)
    res = fit_json("vllm==0.34.0", *base, "--speculative-config", spec("eagle", y), capsys=capsys)
    d = item(res, "draft weights")
    assert d["bytes"] == eagle_head_bytes(2, fc_bias=False) and "raised" not in d["source"], d["source"]
    assert "yarn: 8,192 rows x 128 x 2 B" in d["source"], d["source"]


@pytest.mark.parametrize("engine", ["vllm==0.34.0", "sglang==0.5.23"])
def test_a_draft_with_the_targets_rope_holds_no_rotary_cache_of_its_own(tmp_path, engine, capsys):
    """get_rope keeps one cache per key, process-wide (vLLM's and SGLang's _ROPE_DICT): a
    one-layer draft of the target's own config (its rope, 131072 positions, bf16) adds none;
    SGLang keys it by the draft's own dtype too, so a float16 copy holds its own float32 one."""
    same = _draft_config(tmp_path, TARGET, "same.json", num_hidden_layers=1)
    if engine.startswith("vllm"):
        flags = ("--max-model-len", "8192", "--speculative-config", spec("draft_model", same))
    else:
        flags = ("--context-length", "8192", "--speculative-algorithm", "STANDALONE", "--speculative-draft-model-path")
        flags += (same,)
    d = item(fit_json(engine, *flags, capsys=capsys), "draft weights")
    layer = 4096 * (32 + 2 * 8) * 128 * 2 + 32 * 128 * 4096 * 2 + 3 * 4096 * 14336 * 2
    assert d["bytes"] == 2 * 128256 * 4096 * 2 + layer + 3 * 4096 * 2  # embedding, lm_head, a layer, norms
    assert "rotary cache is the target's" in d["source"]
    if engine.startswith("sglang"):
        fp16 = _draft_config(tmp_path, same, "fp16.json", torch_dtype="float16")
        d16 = item(fit_json(engine, *flags[:-1], fp16, capsys=capsys), "draft weights")
        assert d16["bytes"] == d["bytes"] + 131072 * 128 * 4


def test_sglang_refuses_a_draft_shorter_than_the_targets_context(tmp_path, monkeypatch, capsys):
    """eagle_worker_v2.py: the draft worker runs at the target's context length; model_config.py
    _derive_context_length refuses one past what the draft's config derives (2048) unless
    SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN, which then sets the draft's
    max_position_embeddings to it: its rotary cache of 8192 float32 rows."""
    monkeypatch.delenv("SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN", raising=False)
    monkeypatch.delenv("SGLANG_IS_IN_CI", raising=False)
    short = _draft_config(tmp_path, EAGLE, "short.json", max_position_embeddings=2048)
    args = ["--engine", "sglang==0.5.23", "--context-length", "8192", "--speculative-algorithm", "EAGLE"]
    args += ["--speculative-draft-model-path", short]
    fixed = _refused(args, "runs the draft at the target's context length", capsys)
    assert fixed["settings"]["context-length"] == 2048
    d = item(fixed, "draft weights")
    assert d["bytes"] == eagle_head_bytes(4, fc_bias=True) - (8192 - 2048) * 128 * 4
    monkeypatch.setenv("SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN", "1")
    res = fit_json("sglang==0.5.23", *args[2:], capsys=capsys)
    d = item(res, "draft weights")
    assert (
        d["bytes"] == eagle_head_bytes(4, fc_bias=True)
        and "SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN set" in d["source"]
    )


@pytest.mark.parametrize(
    ("architecture", "algorithm", "chosen"),
    [
        ("LlamaForCausalLM", "EAGLE", (5, 4, 8)),
        ("Grok1ForCausalLM", "EAGLE", (5, 4, 8)),
        ("Grok1VForCausalLM", "EAGLE", (5, 4, 8)),
        ("MistralForCausalLM", "EAGLE", (3, 1, 4)),
        ("LlamaForCausalLM", "STANDALONE", (3, 1, 4)),
    ],
)
def test_sglang_chooses_the_steps_by_the_targets_first_architecture(
    tmp_path, architecture, algorithm, chosen, long_draft, capsys
):
    """speculative_hook.py _auto_choose_speculative_params keys on the target's
    hf_config.architectures[0] alone: Grok's two classes get Llama's (5, 4, 8) (fit gave them
    (3, 1, 4)), another class (3, 1, 4), STANDALONE (3, 1, 4) whatever the target."""
    target = _draft_config(tmp_path, TARGET, "config.json", architectures=[architecture])
    args = ("fit", "--model", target, "--device", "H100", "--engine", "sglang==0.5.23", "--context-length", "8192")
    code, out, err = run(*args, "--speculative-algorithm", algorithm, *PATH, "--json", capsys=capsys)
    assert code == 0, err
    s = json.loads(out)["settings"]
    assert (s["speculative-num-steps"], s["speculative-eagle-topk"], s["speculative-num-draft-tokens"]) == chosen


EAGLE3 = str(CONFIGS / "eagle3-llama-3.1-8b.json")


def test_an_eagle3_heads_draft_vocab_is_read_with_its_config_wherever_it_lies(tmp_path, capsys):
    """draft_vocab_size is read as the config is loaded: a config.json whose name does not end
    in .json (load_model takes any file) keeps its 32000 rows and their map (the second reading
    by suffix took the 128256 of vocab_size, silently)."""
    plain = tmp_path / "eagle3" / "config"
    plain.parent.mkdir()
    plain.write_text(Path(EAGLE3).read_text())
    base = ("--max-model-len", "8192")
    got = [
        item(fit_json("vllm==0.34.0", *base, "--speculative-config", spec("eagle3", p), capsys=capsys), "draft weights")
        for p in (EAGLE3, str(plain))
    ]
    assert got[0]["bytes"] == got[1]["bytes"] and "its lm_head of 32000 rows" in got[1]["source"]


@pytest.mark.parametrize("value", ['"32000"', "0", "true", "-1", "32000.5"])
def test_a_malformed_draft_vocab_size_is_refused_where_it_is(tmp_path, value, capsys):
    """Both engines build the head's lm_head of draft_vocab_size rows: a value that is not a
    positive integer is one located line (it was taken as the vocab_size, silently)."""
    text = Path(EAGLE3).read_text().replace('"draft_vocab_size": 32000', f'"draft_vocab_size": {value}')
    bad = tmp_path / "config.json"
    bad.write_text(text)
    args = ["--engine", "vllm==0.34.0", "--max-model-len", "8192", "--speculative-config", spec("eagle3", str(bad))]
    res = _refused(args, "$.draft_vocab_size", capsys)
    assert res["speculative"]["method"] == "ngram"


def test_an_eagle3_vocabulary_past_the_targets_is_refused(tmp_path, capsys):
    """llama_eagle3.py compute_logits (SGLang's hot_token_id likewise) puts the draft's ids into
    the target's logits: a draft vocabulary larger than the target's overruns them."""
    big = _draft_config(tmp_path, EAGLE3, "big.json", draft_vocab_size=200_000)
    args = ["--engine", "vllm==0.34.0", "--max-model-len", "8192", "--speculative-config", spec("eagle3", big)]
    _refused(args, "larger than the target's (128256)", capsys)


def test_sglang_eagle3_without_its_own_vocab_takes_the_targets_lm_head(tmp_path, long_draft, capsys):
    """SGLang's llama_eagle3.py: no draft_vocab_size (or a tied head) loads the lm_head from the
    target (set_embed_and_head): the head holds no lm_head nor map of its own; with 32000 rows
    it holds both (32000 x 4096 x 2 B and 32000 int64)."""
    base = ("--context-length", "8192", "--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path")
    absent = _draft_config(tmp_path, EAGLE3, "absent.json", draft_vocab_size=None)
    tied = _draft_config(tmp_path, EAGLE3, "tied.json", tie_word_embeddings=True)
    w = {p: item(fit_json("sglang==0.5.23", *base, p, capsys=capsys), "draft weights") for p in (EAGLE3, absent, tied)}
    assert w[EAGLE3]["bytes"] - w[absent]["bytes"] == 32000 * 4096 * 2 + 32000 * 8
    assert w[tied]["bytes"] == w[absent]["bytes"] and "the lm_head the target's" in w[absent]["source"]
    # vLLM builds its own of vocab_size rows where none is given (the checkpoint's lm_head)
    one = item(
        fit_json(
            "vllm==0.34.0", "--max-model-len", "8192", "--speculative-config", spec("eagle3", absent), capsys=capsys
        ),
        "draft weights",
    )
    assert "its lm_head of 128256 rows" in one["source"]


@pytest.mark.parametrize(
    ("method", "base", "changes", "key"),
    [
        ("eagle", EAGLE, {"hidden_size": 3584}, "$.hidden_size"),
        ("eagle3", EAGLE3, {"hidden_size": 3584}, "$.hidden_size"),
        ("eagle3", EAGLE3, {"target_hidden_size": 5120}, "$.target_hidden_size"),
    ],
)
def test_an_eagle_head_made_for_another_targets_width_is_refused(tmp_path, method, base, changes, key, capsys):
    """llama_eagle.py's fc takes the head's hidden_size x 2 (the target's state beside the
    token's embedding), llama_eagle3.py's its target_hidden_size (else hidden_size) x 3, in vLLM
    and SGLang alike: a head made for a target of another width (review3: Llama-3.1-8B's head
    on Qwen2.5-7B, 4096 against 3584) cannot load; it was accepted."""
    head = _draft_config(tmp_path, base, "head.json", **changes)
    vllm = ["--engine", "vllm==0.34.0", "--max-model-len", "8192", "--speculative-config", spec(method, head)]
    assert _refused(vllm, key, capsys)["speculative"]["method"] == "ngram"
    sglang = ["--engine", "sglang==0.5.23", "--context-length", "2048", "--speculative-algorithm", method.upper()]
    _refused([*sglang, "--speculative-draft-model-path", head], key, capsys)


def test_an_eagle3_head_whose_target_hidden_size_is_the_targets_is_taken(tmp_path, capsys):
    """target_hidden_size, where given, is the width the head reads: its own hidden_size may differ."""
    head = _draft_config(tmp_path, EAGLE3, "head.json", hidden_size=2048, target_hidden_size=4096)
    fitted = fit_json(
        "vllm==0.34.0", "--max-model-len", "8192", "--speculative-config", spec("eagle3", head), capsys=capsys
    )
    assert fitted["speculative"]["method"] == "eagle3"


#: VllmConfig._limit_max_model_len_to_draft's warning in each release (vllm/config/vllm.py:
#: 0.33.0:3044-3051, 0.34.0:3113-3120), as read from the wheels fit_rules.toml names
_LIMIT_LOG = {
    "0.33.0": "The draft model's max_model_len (2048) is smaller than the target model's (8192) and the V2 "
    "model runner can't skip speculation for longer sequences; reducing max_model_len to 2048.",
    "0.34.0": "The draft model's max_model_len (2048) is smaller than the target model's (8192) and the "
    "model runner can't skip speculation for longer sequences; reducing max_model_len to 2048.",
}


@pytest.mark.parametrize("version", sorted(_LIMIT_LOG))
def test_vllm_lowers_max_model_len_to_a_draft_that_does_not_share_its_positions(tmp_path, version, capsys):
    """vllm/config/vllm.py VllmConfig._limit_max_model_len_to_draft: a draft_model draft of 2048
    positions (standalone_ar: shares_target_positions False), or an EAGLE head whose rope is not
    cache-only (yarn: its max_position_embeddings not raised), under --max-model-len 8192 runs the
    target at 2048, logging the release's own warning; the KV tokens are those of 2048-token
    requests (the same cache as a plain --max-model-len 2048 run with the draft). An EAGLE head of
    default rope (raised), or a draft as long as the target, leaves 8192. Before: fit priced
    8192-token requests vLLM never serves."""
    engine = f"vllm=={version}"
    short = _draft_config(tmp_path, EAGLE, "short.json", max_position_embeddings=2048)
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 2048}
    y = _draft_config(tmp_path, EAGLE, "yarn.json", max_position_embeddings=2048, rope_scaling=yarn)
    base = ("--enforce-eager", "--speculative-config")
    for method, draft in (("draft_model", short), ("eagle", y)):
        res = fit_json(engine, "--max-model-len", "8192", *base, spec(method, draft), capsys=capsys)
        assert res["settings"]["max-model-len"] == 2048 and res["max_model_len"] == 2048, method
        notes = [n for n in res["notes"] if "_limit_max_model_len_to_draft" in n]
        assert len(notes) == 1 and notes[0].endswith(_LIMIT_LOG[version]), notes
        at_2048 = fit_json(engine, "--max-model-len", "2048", *base, spec(method, draft), capsys=capsys)
        assert (res["kv_tokens"], res["max_concurrency"]) == (at_2048["kv_tokens"], at_2048["max_concurrency"])
        assert not [n for n in at_2048["notes"] if "_limit_max_model_len_to_draft" in n]
    for method, draft in (
        ("eagle", short),
        ("draft_model", _draft_config(tmp_path, EAGLE, "l.json", max_position_embeddings=8192)),
    ):
        res = fit_json(engine, "--max-model-len", "8192", *base, spec(method, draft), capsys=capsys)
        assert res["settings"]["max-model-len"] == 8192, method
        assert not [n for n in res["notes"] if "_limit_max_model_len_to_draft" in n]
    # no --max-model-len: the target's default (131,072) is lowered alike
    res = fit_json(engine, *base, spec("draft_model", short), capsys=capsys)
    assert res["settings"]["max-model-len"] == 2048, res["settings"]


def test_the_draft_limit_is_vllms_alone(tmp_path, monkeypatch, capsys):
    """SGLang runs the draft at the target's context length (refused past its own unless the
    environment allows it): no lowering of the target's."""
    monkeypatch.setenv("SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN", "1")
    short = _draft_config(tmp_path, EAGLE, "short.json", max_position_embeddings=2048)
    more = ("--speculative-algorithm", "STANDALONE", "--speculative-draft-model-path", short)
    res = fit_json("sglang==0.5.23", "--context-length", "8192", *more, capsys=capsys)
    assert res["settings"]["context-length"] == 8192


def test_an_eagle_heads_dummy_propose_is_in_the_profiles_peak(capsys):
    """vLLM's profiling run proposes with the EAGLE head after the target's forward, eagerly,
    over all 8192 tokens (gpu/model_runner.py _dummy_run, target_dependent_ar/speculator.py
    propose): the head's layer at 8192 tokens with the target's hidden states and its own
    embedding held is above the target's forward and 0.34.0's Triton sampler, so it is the peak;
    0.33.0's stock FlashInfer sampler holds more, so its peak stays."""
    base = ("--max-model-len", "8192")
    eagle = ("--speculative-config", spec("eagle"))
    alone = item(fit_json("vllm==0.34.0", *base, capsys=capsys), "activation peak")
    act = item(fit_json("vllm==0.34.0", *base, *eagle, capsys=capsys), "activation peak")
    assert act["bytes"] > alone["bytes"] and "the draft's dummy propose" in act["source"]
    assert "its peak" in act["source"]
    alone = item(fit_json("vllm==0.33.0", *base, capsys=capsys), "activation peak")
    act = item(fit_json("vllm==0.33.0", *base, *eagle, capsys=capsys), "activation peak")
    assert act["bytes"] == alone["bytes"] and "below the target's" in act["source"]
