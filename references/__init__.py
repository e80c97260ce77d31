"""The project's reference models: what its analytic programs describe, what
tests and benchmarks capture, and the models calibrations are measured on.

- :mod:`capture_plan.references.decode` -- a 32-layer-style decode step (and
  target-verify) with FA3 or SDPA attention, static buffers and a KV cache.
- :mod:`capture_plan.references.speculative` -- EAGLE's four phases over it,
  with planted speculative bugs (deliberate out-of-bounds writes; its metadata
  kernels in :mod:`~capture_plan.references.speculative_kernels`);
  :mod:`capture_plan.references.planted` -- its small model and a subprocess
  runner for the bugs.

Torch (and Triton for the planted kernels) on import. Shipped beside the
executor, never imported by it: an engine that imports
``capture_plan.executor`` loads none of this (tests/test_import_layers.py).
"""
