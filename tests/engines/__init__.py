"""Engine-faithful capture runners, adopted onto ``capture_loop`` (tests and, later, engine plugins).

``sglang_runner``: SGLang 0.5.23's decode runner, its EAGLE draft runners and
``FullCudaGraphBackend``; ``vllm_runner``: vLLM 0.33.0's ``ModelCudaGraphManager``
with its piecewise wrappers and profiling pass. Each cites the released file and
function it follows; the code is this repository's own. ``adoption`` reads a
runner's source as its two versions (before and after the adoption) and counts
the diff; ``plans`` makes plans with graph keys for them.
"""
