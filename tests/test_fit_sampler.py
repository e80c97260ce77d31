"""The profiling run's dummy sampler, per release: fit's counted rule (planner/data/fit_rules.toml
[sampler], planner/fit/estimate.py sampler_phase) and the runners' stand-in
(tests/engines/vllm_runner.py Sampler for 0.33.0, vllm_runner_034.py for 0.34.0), which must
allocate what the rule counts. The CPU has no allocator peak statistics: the stand-in's
allocations are recorded by a dispatch mode (every op's outputs, their storages' bytes while a
tensor holds them), the peak and the tensors live there read from that record."""

from __future__ import annotations

import types
import weakref
from pathlib import Path

import pytest

from capture_plan.planner.fit import estimate
from capture_plan.planner.fit.fit import fit
from capture_plan.planner.fit.inputs import FitRequest
from capture_plan.planner.fit.model import FitModel, load_model
from capture_plan.planner.fit.tables import releases, sampler_rule, sampler_rules

ROOT = Path(__file__).resolve().parent.parent
LLAMA = ROOT / "planner" / "data" / "configs" / "llama-3.1-8b.json"
#: a small model whose sampler phase is above its layers' (tokens 64, 16 requests)
SMALL = FitModel(
    name="small",
    model_type="llama",
    layers=2,
    hidden=64,
    heads=4,
    kv_heads=2,
    head_dim=16,
    v_head_dim=16,
    intermediate=128,
    vocab=5000,  # padded to 5056 by vLLM's ParallelLMHead (64)
    dtype_bytes=2,
)
TOKENS, SEQS = 64, 16


def test_each_release_takes_its_sampler_row_and_a_release_not_read_the_nearest():
    """Every modelled vLLM release has a sampler row: 0.19.0, 0.33.0 and 0.34.0 were read (the
    two V2-runner releases share one), the others take the nearest read release's at or below
    (fails before: no [sampler] rows)."""
    got = {r: sampler_rule("vllm", r.split("==")[1]) for r in releases() if r.startswith("vllm==")}
    assert {v.version: (v.name, v.read) for v in got.values() if v.read} == {
        "0.19.0": ("vllm-0-19", True),
        "0.33.0": ("vllm-0-33", True),
        "0.34.0": ("vllm-0-33", True),
    }
    assert got["vllm==0.25.0"].name == "vllm-0-19" and not got["vllm==0.25.0"].read
    assert sampler_rule("vllm", "0.40.0").name == "vllm-0-33"  # a later release: the newest read
    listed = [v for r in sampler_rules().values() for v in r.releases]
    assert len(listed) == len(set(listed))  # one row per release
    for row in sampler_rules().values():  # each step names the file it follows
        assert row.sources and all(".py" in s for s in row.sources)
        assert row.vocab_padding >= 1 and row.sample_block >= 0 and row.fp32_copies >= 0


def test_fit_counts_each_releases_sampler_as_its_row_does():
    """The activation peak of a model whose sampler phase is above its layers', counted by hand
    from each release's code (fails before: one 0.19.0 figure for every release, and
    activation_peak took no row):

    0.33.0 and 0.34.0 (the V2 runner): the forward's hidden states (tokens x hidden) and the
    gathered rows (rows x hidden) held; the model-dtype logits over the vocabulary padded to 64;
    one float32 copy (apply_sampling_params); Gumbel-max's int64 and float32 per 1024-token block
    and row. 0.19.0: a random copy of the rows too, the unpadded logits and three float32 copies.
    FlashInfer's sampler (two more float32 copies, no Gumbel scratch) is the error bar's."""
    d, rows, h, v, vp = 2, SEQS, SMALL.hidden, SMALL.vocab, 5056
    layer = TOKENS * d * (4 * h + (4 + 2 * 2) * 16 + 3 * 128)
    v2 = TOKENS * h * d + rows * h * d + rows * vp * d + rows * v * 4 + rows * 5 * (8 + 4)
    v2_flashinfer = TOKENS * h * d + rows * h * d + rows * vp * d + 3 * rows * v * 4
    v19 = TOKENS * h * d + 2 * rows * h * d + rows * v * d + 3 * rows * v * 4
    assert layer < v2 < v19
    for version in ("0.33.0", "0.34.0"):
        item = estimate.activation_peak(SMALL, 1, TOKENS, SEQS, sampler_rule("vllm", version))
        assert f"vLLM {version}'s profile_run" in item.source and "[sampler.vllm-0-33]" in item.source
        assert "FlashInfer's sampler" in item.source
    # 0.34.0's stock install runs the Triton branch; 0.33.0's FlashInfer's (nothing gates it but
    # the import of flashinfer-python, a requirement): the other branch in the error bar
    item = estimate.activation_peak(SMALL, 1, TOKENS, SEQS, sampler_rule("vllm", "0.34.0"))
    assert item.bytes == v2 and item.error_bytes == v2_flashinfer - v2
    item = estimate.activation_peak(SMALL, 1, TOKENS, SEQS, sampler_rule("vllm", "0.33.0"))
    assert item.bytes == v2_flashinfer and item.error_bytes == max(v2_flashinfer // 2, v2_flashinfer - v2)
    assert "which 0.33.0's stock install runs" in item.source and "the Triton branch" in item.source
    for version in ("0.19.0", "0.25.0"):
        item = estimate.activation_peak(SMALL, 1, TOKENS, SEQS, sampler_rule("vllm", version))
        assert item.bytes == v19 and item.error_bytes == v19 // 2, version
    assert "0.25.0 not read for it" in item.source


def test_the_logits_gather_is_counted_at_tensor_parallelism():
    """tp 2, a float32 model: the head's shard (rows x padded vocab / 2), the all-gather's output
    and its movedim/reshape copy (rows x padded vocab each) outweigh the second pass (the logits
    and one float32 copy) (fails before: no gather counted)."""
    m = FitModel(**{**{f: getattr(SMALL, f) for f in SMALL.__struct_fields__}, "dtype_bytes": 4})
    d, rows, h, vp = 4, SEQS, m.hidden, 5056
    gather = rows * d * (vp // 2 + 2 * vp)
    assert gather > rows * vp * d + rows * m.vocab * 4 + rows * 5 * 12
    item = estimate.activation_peak(m, 2, TOKENS, SEQS, sampler_rule("vllm", "0.34.0"))
    assert item.bytes == TOKENS * h * d + rows * h * d + gather


def test_fit_passes_the_releases_row_and_sglang_keeps_its_figure():
    """`planner fit` takes the release's sampler row for vLLM; SGLang runs no profiling forward
    and keeps the figure it had (0.19.0's counting) (fails before: 0.19.0's for vLLM 0.34.0)."""
    model = load_model(LLAMA)
    for engine, name in (("vllm==0.34.0", "vllm-0-33"), ("vllm==0.19.0", "vllm-0-19"), ("sglang==0.5.23", "vllm-0-19")):
        r = fit(FitRequest(model, "H100", engine, 1, {}))
        (act,) = [i for i in r.items if i.name == "activation peak"]
        assert f"[sampler.{name}]" in act.source, engine


# -- the runners' stand-in -----------------------------------------------------------------------


def _recorder():
    torch = pytest.importorskip("torch")
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_flatten

    class Recorder(TorchDispatchMode):
        """Every op's outputs under it, weakly: the storages they hold that were made under it,
        their bytes summed after each op (the peak, and the tensors live there)."""

        def __init__(self):
            super().__init__()
            self.refs: list = []
            #: storages made before the record, by address, while a tensor holds them (a freed
            #: one's address, reused by a tensor made under the record, is that tensor's)
            self.before: dict[int, weakref.ref] = {}
            self.peak, self.at_peak = 0, []

        def live(self) -> dict[int, tuple]:
            out = {}
            for ref in self.refs:
                t = ref()
                if t is not None and not self._before(t.untyped_storage().data_ptr()):
                    s = t.untyped_storage()  # the first live tensor of a storage: the op that made it
                    out.setdefault(s.data_ptr(), (s.nbytes(), tuple(t.shape), str(t.dtype).split(".")[1]))
            return out

        def _before(self, ptr: int) -> bool:
            held = self.before.get(ptr)
            t = held() if held is not None else None
            return t is not None and t.untyped_storage().data_ptr() == ptr

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            made = self.live()
            for t in tree_flatten((args, kwargs or {}))[0]:
                if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in made:
                    self.before[t.untyped_storage().data_ptr()] = weakref.ref(t)  # made before the record
            out = func(*args, **(kwargs or {}))
            self.refs += [weakref.ref(t) for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
            live = self.live()
            total = sum(v[0] for v in live.values())
            if total > self.peak:
                self.peak, self.at_peak = total, sorted(live.values())
            return out

    return torch, Recorder


def _runner_module(tmp_path):
    """0.34.0's runner as the bench loads it (bench/fit_bench.py runner_034): 0.33.0's before the
    adoption, 0.34.0's files over it."""
    from engines import adoption, plugged, vllm_runner

    module = adoption.before_module(Path(vllm_runner.__file__), tmp_path, f"vllm_sampler_{tmp_path.name}")
    for path in plugged.later("vllm", "0.34.0"):
        exec(compile(path.read_text(), str(path), "exec"), vars(module))
    return module


@pytest.mark.parametrize("release, flashinfer", [("0.34.0", False), ("0.33.0", False), ("0.34.0", True)])
def test_the_runners_dummy_sampler_allocates_what_the_release_does(release, flashinfer, tmp_path):
    """The runner's _dummy_sampler_run (vllm_runner_034.py, model_runner.py 1039-1066) with the
    release's sampler stand-in, on the CPU: at its peak it holds the model-dtype logits, the
    float32 copy and Gumbel-max's per-block scratch (FlashInfer's branch: the copy, its mask and
    its probabilities), with the release's per-request vectors beside them (0.34.0: the sampled
    ids; 0.33.0: also the block argmax it gathers with), and the bytes above what stays (the
    Triton top-k/top-p scratch and tables, FlashInfer's row states, kept as the release keeps
    them) are fit's row's sampler phase less the held hidden states, plus those vectors (fails
    before: the stand-in had no release branch, and held two float32 copies, a log-softmax
    beside the float32 logits, where the release holds one)."""
    torch, Recorder = _recorder()
    module = _runner_module(tmp_path)
    sampler_cls = module.Sampler if release == "0.34.0" else module.Sampler.__base__
    rows, hidden, vocab, sms = 6, 32, 16384, 4  # vocab: Gumbel's 16 blocks outweigh the logprobs' tensors
    blocks = vocab // 1024
    hidden_states = torch.randn(rows, hidden, dtype=torch.bfloat16)
    head = torch.randn(hidden, vocab, dtype=torch.bfloat16)
    runner = types.SimpleNamespace(
        model_state=module.ModelState(),
        sampler=sampler_cls(use_flashinfer=flashinfer, num_sm=sms),
        compute_logits=lambda h: h @ head,
    )
    with Recorder() as rec:
        module.GPUModelRunner._dummy_sampler_run(runner, hidden_states)
        kept = rec.live()
    kept_bytes = sum(b for b, _, _ in kept.values())
    kept = sorted((shape, dtype) for _, shape, dtype in kept.values())
    vector = [v for v in rec.at_peak if v[1] in ((rows,), (rows, 1))]  # per-request vectors
    vectors = sum(b for b, _, _ in vector)
    vector = sorted((shape, dtype) for _, shape, dtype in vector)
    big = sorted((shape, dtype) for _, shape, dtype in rec.at_peak if shape not in ((rows,), (rows, 1)))
    # min(next_power_of_2(min(SMs, rows)), SMs) x vocab, and the two 200-entry tables
    triton = [((sms, vocab), "float32"), ((200,), "float32"), ((200,), "float32")]
    logits, copy = ((rows, vocab), "bfloat16"), ((rows, vocab), "float32")
    if flashinfer:
        assert big == sorted([logits, copy, copy, copy, ((1 << 20,), "uint8")])
        assert kept == [((1 << 20,), "uint8")]
    else:
        gumbel = [((rows, blocks), "int64"), ((rows, blocks), "float32")]
        assert big == sorted([logits, copy, *gumbel, *triton]) and kept == sorted(triton)
        ids = [((rows,), "int64")] if release == "0.34.0" else [((rows, 1), "int64")] * 2  # 0.33.0: argmax, gather
        assert vector == sorted([((rows,), "int32"), ((rows,), "float32"), *ids])  # top-k, top-p, the ids
    # fit's row, less what the rule holds outside the sampler run (the forward's hidden states)
    m = FitModel(
        name="toy", model_type="llama", layers=1, hidden=hidden, heads=1, kv_heads=1, head_dim=hidden,
        v_head_dim=hidden, intermediate=hidden, vocab=vocab, dtype_bytes=2,
    )  # fmt: skip
    default, alt = estimate.sampler_phase(m, 1, 0, rows, sampler_rule("vllm", release).rule)
    counted = (alt if flashinfer else default) - rows * hidden * 2
    assert rec.peak - kept_bytes - vectors == counted and vectors <= rows * 32


#: what the [sampler.vllm-0-33] row's figures rest on, as each wheel's code says it: (file, text)
WHEEL_FACTS = {
    "vocab_padding = 64": ("vllm/model_executor/layers/vocab_parallel_embedding.py", "DEFAULT_VOCAB_PADDING_SIZE = 64"),
    "sampled_hidden_copies = 1": (
        "vllm/v1/worker/gpu/model_runner.py",
        "sample_hidden_states = hidden_states[input_batch.logits_indices]",
    ),
    "the warm-up pass": ("vllm/v1/worker/gpu/model_runner.py", "warmup_params = SamplingParams.for_sampler_warmup()"),
    "fp32_copies = 1": (
        "vllm/v1/worker/gpu/sample/sampler.py",
        "logits = torch.empty_like(logits, dtype=torch.float32).copy_(logits)",
    ),
    "sample_block = 1024": ("vllm/v1/worker/gpu/sample/gumbel.py", "BLOCK_SIZE = 1024\n    num_blocks = triton.cdiv"),
    "Gumbel's int64 scratch": (
        "vllm/v1/worker/gpu/sample/gumbel.py",
        "local_argmax = logits.new_empty(num_tokens, num_blocks, dtype=torch.int64)",
    ),
    "the Triton scratch kept": ("vllm/v1/sample/ops/topk_topp_triton.py", "_TRITON_BUFFER_CACHE[buf_key] = buffer"),
    "gather_copies = 2": (
        "vllm/distributed/device_communicators/cuda_communicator.py",
        "output_tensor.movedim(0, dim)",
    ),
    "flashinfer_fp32_copies = 3": (
        "vllm/v1/sample/ops/topk_topp_sampler.py",
        "flashinfer.sampling.top_k_top_p_sampling_from_logits(",
    ),
}


@pytest.mark.parametrize("version", sampler_rules()["vllm-0-33"].releases)
def test_the_v2_runners_row_rests_on_the_wheels_code(version):
    """Each fact the 0.33.0/0.34.0 row counts is in that release's wheel (read with zipfile:
    nothing installed) (fails before: no such row)."""
    from test_engine_contract import wheel_source

    row = sampler_rules()["vllm-0-33"]
    assert (row.vocab_padding, row.sampled_hidden_copies, row.fp32_copies, row.sample_block) == (64, 1, 1, 1024)
    assert (row.gather_copies, row.flashinfer_fp32_copies) == (2, 3)
    for fact, (path, text) in WHEEL_FACTS.items():
        assert text in wheel_source("vllm", version, path), (version, fact, path)
