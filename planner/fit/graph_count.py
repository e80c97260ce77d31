"""How many CUDA graphs an engine instantiates, as its release's code captures them: the one
owner of that count (:func:`.estimate.graph_memory` prices it).

Two figures per capture: ``whole``, the graphs' nodes counted in whole-model graphs (a
piecewise size's pieces hold about one whole graph's nodes: the attention kernels they
leave out are a few per layer), and ``execs``, the graph execs instantiated (each a
``cudaGraphExec`` with whatever the driver takes per graph apart from its nodes,
planner/data/devices.toml ``[graph_exec_per_graph]``).

Where the engines split a size into pieces:

* vLLM (0.19.0 to 0.34.0 read; vllm/config/compilation.py
  CompilationConfig.set_splitting_ops_for_v1): with ``splitting_ops`` unset (the
  default), the attention ops (``_attention_ops``: unified_attention[_with_output],
  unified_mla_attention[_with_output], the mamba mixers, linear attention, ...) plus
  ``unified_kv_cache_update`` / ``unified_mla_kv_cache_update``; vllm/compilation/backends.py
  split_graph keeps consecutive splitting ops in one split (the KV-cache update is followed
  at once by the attention op: vllm/model_executor/layers/attention/attention.py
  Attention.forward; MLAAttention.forward in mla_attention.py has only the output's
  torch.empty between them) and _merge_empty_only_subgraphs folds such an allocation-only
  piece into the previous one, so a size has one piece before the first attention layer and one
  after each: ``layers + 1`` graphs, each a CUDAGraphWrapper capture
  (vllm/compilation/cuda_graph.py) into the one global pool. FULL graphs are one per size.
  A mode with FULL decode graphs (FULL_AND_PIECEWISE, the default, and FULL_DECODE_ONLY)
  captures them for the sizes up to max_num_seqs only.
* SGLang 0.5.23: decode graphs whole, one per size
  (sglang/srt/model_executor/runner/decode_cuda_graph_runner.py); the breakable prefill
  graphs break at every RadixAttention call (sglang/srt/layers/radix_attention.py:
  ``@eager_on_graph``), each segment a torch.cuda.CUDAGraph
  (runner_backend_utils/breakable_cuda_graph/breakable_cuda_graph.py): ``layers + 1``
  per prefill size.
"""

from __future__ import annotations

from typing import NamedTuple

__all__ = ["GraphCount", "whole_graphs", "full_graph_sizes", "vllm_graphs", "sglang_graphs"]

#: vLLM's modes whose FULL graphs cover the decode sizes only (size <= max_num_seqs)
FULL_DECODE = ("FULL_AND_PIECEWISE", "FULL_DECODE_ONLY")
PIECEWISE = ("FULL_AND_PIECEWISE", "PIECEWISE")


class GraphCount(NamedTuple):
    """``whole``: the nodes in whole-model graphs; ``execs``: the graph execs
    instantiated; ``how``: what they are, for the item's source."""

    whole: int
    execs: int
    how: str


def whole_graphs(n: int, what: str = "whole graphs") -> GraphCount:
    """``n`` whole-model graphs, one exec each (a plan's graphs: the executor captures each
    size whole)."""
    return GraphCount(n, n, f"{n} {what}")


def full_graph_sizes(mode: str, sizes: list[int], seqs: int) -> list[int]:
    """The sizes vLLM's ``mode`` captures FULL graphs of, ``max_num_seqs`` ``seqs``."""
    return [s for s in sizes if s <= seqs] if mode in FULL_DECODE else sizes if mode == "FULL" else []


def vllm_graphs(mode: str, sizes: list[int], seqs: int, layers: int) -> GraphCount:
    """The graphs vLLM's ``mode`` captures for ``sizes`` of a model of ``layers`` attention
    layers (each a split point) with ``max_num_seqs`` ``seqs``."""
    full = full_graph_sizes(mode, sizes, seqs)
    piecewise = len(sizes) if mode in PIECEWISE else 0
    parts = []
    if piecewise:
        parts.append(f"{piecewise} sizes x {layers + 1} PIECEWISE pieces")
    if full:
        parts.append(f"{len(full)} FULL")
    execs = len(full) + piecewise * (layers + 1)
    return GraphCount(len(full) + piecewise, execs, f"{execs} graph execs ({' + '.join(parts) or 'none'})")


def sglang_graphs(decode: int, prefill: int, layers: int) -> GraphCount:
    """SGLang's ``decode`` whole decode graphs and ``prefill`` breakable prefill graphs of
    ``layers + 1`` segments each."""
    execs = decode + prefill * (layers + 1)
    parts = [f"{decode} decode"] + ([f"{prefill} prefill sizes x {layers + 1} segments"] if prefill else [])
    return GraphCount(decode + prefill, execs, f"{execs} graph execs ({' + '.join(parts)})")
