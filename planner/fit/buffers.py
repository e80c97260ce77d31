"""The engine's persistent device buffers: what a release's model runner allocates after the
worker's first free-memory reading and keeps when its KV cache is sized (fit's "engine
buffers" item), as planner/data/fit_rules.toml [buffers.NAME] lists them, each tensor's file
and function named there.

vLLM counts them in the memory its profile consumed (0.33.0's ``total_consumed``) or in what
its start-up used besides the KV cache (0.34.0's ``non_kv_used``), neither in the weights
(measured around the model's load alone) nor in the profile's transient peak (a buffer made
in the profile and kept is in both its peak and what stays allocated). The figure is the
tensors' bytes, each shape evaluated from the model's config and the settings fit resolved;
its error bar holds the caching allocator's segments around them (a fresh pool, simulated:
planner/memory/allocator.py) and, where the rule has a FlashInfer branch, the other branch's
difference (FlashInfer's sampler runs by the host's installation, which fit cannot know).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from capture_plan.schemas.fit import FitItem

from .sizing import vllm_kv_groups
from .tables import BufferRule, BufferTensor, MiB, buffer_rule, buffer_rules, sampler_rule

if TYPE_CHECKING:
    from .inputs import FitInputs

__all__ = ["engine_buffers", "buffer_dims", "counted", "tensor_bytes", "NAME"]

NAME = "engine buffers"
_DTYPE_BYTES = {"bool": 1, "uint8": 1, "int32": 4, "int64": 8, "float32": 4}
#: what a release's start-up has made when it sizes the cache: before capture (0.33.0's
#: determine_available_memory), or after capture, past initialize_kv_cache (0.34.0)
_BEFORE_CAPTURE = ("init", "load", "profile")
_AFTER_CAPTURE = (*_BEFORE_CAPTURE, "kv-init")


def buffer_dims(inp: FitInputs, settings: dict, draft: bool = True) -> dict[str, int]:
    """Each dimension a [buffers] shape names (fit_rules.toml's comment), from the model's config,
    the device and the settings fit resolved (vLLM's flag names); ``draft``: the speculative
    draft's tokens counted where one is given."""
    m = inp.model
    seqs, tokens = int(settings["max-num-seqs"]), int(settings["max-num-batched-tokens"])
    mml, block = int(settings["max-model-len"]), int(settings["block-size"])
    k = inp.draft.tokens if draft and inp.draft is not None else 0
    sms = inp.device.sms
    programs = min(sms, min(seqs, tokens))  # the dummy sampler's rows
    align = 128 // math.gcd(128, block)  # get_block_table_width: the 128-token alignment
    blocks = math.ceil(mml / block)  # AttentionSpec.max_num_blocks_per_req
    return {
        "max_num_seqs": seqs,
        "max_num_seqs_plus_one": seqs + 1,
        "max_num_batched_tokens": tokens,
        "max_model_len": mml,
        "vocab": m.vocab,
        "vocab_words": -(-m.vocab // 32),
        "speculative_tokens": k,
        "decode_query_len": 1 + k,
        "topk_programs": min(1 << (programs - 1).bit_length(), sms),
        "kv_groups": vllm_kv_groups(m),
        "block_table_width": math.ceil(blocks / align) * align,
    }


def counted(rule: BufferRule, stages: tuple[str, ...], method: str, sampler: str = "triton") -> list[BufferTensor]:
    """The tensors of ``rule`` made by the stages the release's sizing follows, under the
    speculative ``method`` ("" for none) and the sampler branch, in the start-up's order."""
    return [
        t
        for t in rule.tensors
        if t.at in stages and t.sampler in ("any", sampler) and (not t.methods or method in t.methods)
    ]


def tensor_bytes(t: BufferTensor, dims: dict[str, int]) -> int:
    return math.prod(d if isinstance(d, int) else dims[d] for d in t.shape) * _DTYPE_BYTES[t.dtype]


def _segment_slack(sizes: list[int]) -> int:
    """What a fresh native pool of PyTorch's caching allocator reserves for ``sizes`` (allocated
    in order, kept) beyond their bytes: its 2 MiB and 20 MiB segments' rounding."""
    # imported here: the allocator's module is the planner's memory layer, which fit reaches
    # into for this one figure only
    from capture_plan.planner.memory.allocator import PoolSim

    pool = PoolSim()
    for n in sizes:
        if n:  # torch allocates nothing for a tensor without elements
            pool.alloc(n)
    return pool.reserved - sum(sizes)


def engine_buffers(inp: FitInputs, settings: dict, draft: bool = True) -> FitItem:
    """fit's "engine buffers" item for the release (see the module's docstring); unknown where
    the release was not read for them (its KV figures then exclude them, as before)."""
    found = buffer_rule(inp.engine, inp.version)
    if found is None:
        read = sorted({v for r in buffer_rules().values() if r.engine == inp.engine for v in r.releases})
        return FitItem(
            NAME,
            None,
            None,
            "unknown",
            f"{inp.engine} {inp.version}'s runner was not read for its persistent buffers (fit_rules.toml "
            f"[buffers] reads {', '.join(read) or 'no release'}): not counted, the KV figures exclude them",
        )
    name, rule = found
    after = inp.rule.kind == "vllm-after-capture"
    stages = _AFTER_CAPTURE if after else _BEFORE_CAPTURE
    method, branch, dims = _counting(inp, settings, draft)
    tensors = counted(rule, stages, method, branch)
    sizes = [tensor_bytes(t, dims) for t in tensors]
    b = sum(sizes)
    unbranch = "triton" if branch == "flashinfer" else "flashinfer"
    other = sum(tensor_bytes(t, dims) for t in counted(rule, stages, method, unbranch))
    err = _segment_slack(sizes) + abs(other - b)
    largest = sorted(zip(sizes, (t.name for t in tensors)), reverse=True)[:3]
    when = "through initialize_kv_cache (sized after capture)" if after else "by the profile (sized before capture)"
    source = (
        f"vLLM {inp.version}'s runner, counted: fit_rules.toml [buffers.{name}], {len(tensors)} tensors made after "
        f"the init snapshot and kept {when}; largest "
        + ", ".join(f"{t} {n / MiB:.1f} MiB" for n, t in largest)
        + "; the allocator's segments around them and FlashInfer's sampler where the host runs it (its row "
        "states in place of the Triton top-k/top-p scratch) in the error bar"
    )
    if draft and inp.draft is not None:
        source += "; the speculator's own buffers not counted"
    return FitItem(NAME, b, err, "exact", source)


def made_by_profile(inp: FitInputs, settings: dict) -> int:
    """Bytes of the release's persistent buffers its profiling run's dummy sampler makes and
    keeps (fit_rules.toml [buffers] tensors at "profile", on the branch a stock install runs:
    the Triton top-k/top-p scratch and tables, or FlashInfer's row states): made after the
    forward's peak and still allocated when memory_profiling reads what stays, so the
    transient headroom holds the forward's peak less them (0 where the release was not read)."""
    found = buffer_rule(inp.engine, inp.version)
    if found is None:
        return 0
    method, branch, dims = _counting(inp, settings)
    return sum(tensor_bytes(t, dims) for t in counted(found[1], ("profile",), method, branch))


def _counting(inp: FitInputs, settings: dict, draft: bool = True) -> tuple[str, str, dict[str, int]]:
    """How the release's buffers are counted: the speculative method (``draft`` False or none:
    ""), the sampler branch a stock install runs (its scratch), the dimensions' values."""
    method = inp.draft.method if draft and inp.draft is not None else ""
    branch = sampler_rule(inp.engine, inp.version).rule.branch(inp.version)
    return method, branch, buffer_dims(inp, settings, draft)
