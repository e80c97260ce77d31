"""SGLang 0.5.23's decode capture, adopted onto ``capture_loop``.

Facts from the released wheel (sglang==0.5.23; this code is our own):

* ``srt/model_executor/runner/decode_cuda_graph_runner.py``,
  ``DecodeCudaGraphRunner._capture_one_stream``: sizes largest first
  (``reversed(self.capture_bs)``); per size, per LoRA variant (``("lora",
  "nolora")`` when ``record_nolora_graph``, else ``(None,)``), per
  attention-graph variant label (``attention_graph_variants.capture_labels``)
  it calls ``capture_one_shape(bs, forward, stream_idx, variant_label,
  attention_variant)``: several graphs per size.
* ``capture_one_shape``: ``num_tokens = size * self.captured_req_width``; it
  prepares the batch outside the graph, then calls
  ``self.backend.capture_one(shape_key, run_once, capture_inputs=None,
  post_warmup_hook=attn_backend.on_after_cuda_graph_warmup)``.
* ``runner_backend/full_cuda_graph_backend.py``, ``FullCudaGraphBackend``:
  ``capture_session(stream)`` binds the one global graph pool
  (``runner_utils/pool.py`` ``get_or_create_global_graph_memory_pool``) and the
  capture stream; ``capture_one(shape_key, forward_fn, capture_inputs=None,
  post_warmup_hook=None)`` runs two warm-ups, each after a device
  synchronize and a TP barrier, calling ``post_warmup_hook`` after each; with
  ``reuse_output_buffer`` it keeps warm-up step 1's output, allocates one
  output buffer like it (``_allocate_output_buffer``) and copies every
  capture's output into its leading rows (``_copy_output_to_buffer``); it
  records ``self._device_module.graph(cuda_graph=graph, pool=self._pool,
  stream=self._capture_stream)`` and stores graph and output under the shape
  key; ``cleanup`` resets and drops them.
* ``runner_utils/pool.py`` ``get_or_create_global_graph_capture_stream``: one
  process-wide capture stream, shared by the decode and prefill runners.
* ``srt/speculative/eagle_draft_cuda_graph_runner.py`` and
  ``eagle_draft_extend_cuda_graph_runner.py``: the EAGLE draft runners follow
  the same loop with their own phase, made after the target's runner, sharing
  the global pool and stream.

The adoption: each added line ends with ``# +``, each removed one stays as a
``# - `` comment (tests/engines/adoption.py counts them and runs the version
before). The loop comes in through ``capture(loop)``; every size and label
is the plan's (``loop.step`` refuses a key out of the plan's order); the
backend warms up, records and holds through the step.
"""

from __future__ import annotations

import contextlib
import enum

import torch


class ForwardMode(enum.Enum):
    """forward_batch_info.py's capture modes of the decode runner."""

    DECODE = 1
    TARGET_VERIFY = 2


_global_pool = None
_global_stream = None


def get_or_create_global_graph_memory_pool():
    """The process's one graph pool (runner_utils/pool.py)."""
    global _global_pool
    if _global_pool is None:
        _global_pool = torch.cuda.graph_pool_handle()
    return _global_pool


def get_or_create_global_graph_capture_stream():
    """The process's one capture stream (runner_utils/pool.py)."""
    global _global_stream
    if _global_stream is None:
        _global_stream = torch.cuda.Stream()
    return _global_stream


def reset_globals() -> None:
    """A fresh process's globals (tests: each engine start-up is a new process)."""
    global _global_pool, _global_stream
    _global_pool = _global_stream = None


def _allocate_output_buffer(output):
    """A buffer like the warm-up's output; None for anything but one tensor."""
    if torch.is_tensor(output) and output.ndim:
        return torch.empty_like(output)
    return None


def _copy_output_to_buffer(output, buffer):
    """``output`` copied into the buffer's leading rows (a view of them); None when it does not fit."""
    if not (torch.is_tensor(output) and output.shape[1:] == buffer.shape[1:] and output.shape[0] <= buffer.shape[0]):
        return None
    shared = buffer[: output.shape[0]]
    shared.copy_(output)
    return shared


class FullCudaGraphBackend:
    """One ``torch.cuda.CUDAGraph`` per shape key, in the global pool, on the capture stream."""

    def __init__(self, cuda_graph_runner=None, *, reuse_output_buffer: bool = False, tp_barrier=None):
        self._cuda_graph_runner = cuda_graph_runner
        self._device_module = torch.cuda  # cuda_graph_runner.device_module
        self._graphs: dict = {}
        self._outputs: dict = {}
        self._pool = None
        self._capture_stream = None
        self._reuse_output_buffer = reuse_output_buffer
        self._output_buffer = None
        self._tp_barrier = tp_barrier or (lambda: None)
        #: warm-up runs made (the tests read it)
        self.warmup_runs = 0

    @contextlib.contextmanager
    def capture_session(self, stream):
        if self._pool is None:
            self._pool = get_or_create_global_graph_memory_pool()
        self._capture_stream = stream
        try:
            yield
        finally:
            self._capture_stream = None

    # - def capture_one(self, shape_key, forward_fn, capture_inputs=None, post_warmup_hook=None):
    def capture_one(self, shape_key, forward_fn, capture_inputs=None, post_warmup_hook=None, step=None):  # +
        warmup_output = None
        # - for warmup_step in range(2):
        with step.warmup():  # +
            for warmup_step in range(step.warmups):  # + was range(2)
                self._device_module.synchronize()
                self._tp_barrier()
                output = forward_fn()
                self.warmup_runs += 1
                # - if self._reuse_output_buffer and warmup_step == 1:
                if self._reuse_output_buffer and warmup_step == step.warmups - 1:  # + the last warm-up
                    warmup_output = output
                del output
                if post_warmup_hook is not None:
                    post_warmup_hook()
        if self._reuse_output_buffer and self._output_buffer is None:
            self._output_buffer = _allocate_output_buffer(warmup_output)
            self._reuse_output_buffer = self._output_buffer is not None
        del warmup_output
        graph = torch.cuda.CUDAGraph()
        # - with self._device_module.graph(cuda_graph=graph, pool=self._pool, stream=self._capture_stream):
        with step.graph(graph, pool=self._pool, stream=self._capture_stream):  # +
            out = forward_fn()
            if self._reuse_output_buffer:
                shared = _copy_output_to_buffer(out, self._output_buffer)
                self._reuse_output_buffer = shared is not None
                if shared is not None:
                    out = shared
        self._graphs[shape_key] = graph
        # - self._outputs[shape_key] = out
        self._outputs[shape_key] = step.hold(out)  # +

    def replay(self, shape_key):
        self._graphs[shape_key].replay()
        return self._outputs[shape_key]

    def cleanup(self) -> None:
        for graph in self._graphs.values():
            graph.reset()
        self._graphs.clear()
        self._outputs.clear()
        self._output_buffer = None


class DecodeCudaGraphRunner:
    """decode_cuda_graph_runner.py's capture loop over sizes, LoRA and attention variants."""

    phase = "decode"

    def __init__(
        self,
        model,
        capture_bs,
        *,
        reuse_output_buffer: bool = False,
        record_nolora_graph: bool = False,
        attention_labels=None,
        captured_req_width: int = 1,
        phase: str | None = None,
    ):
        self.model, self.capture_bs = model, list(capture_bs)
        # its own backend (resolve_decode_backend(self)); the pool is global
        self.backend = FullCudaGraphBackend(self, reuse_output_buffer=reuse_output_buffer)
        if phase is not None:  # the target runner in verify mode (captured_req_width draft tokens a request)
            self.phase = phase
        self.capture_forward_mode = (
            ForwardMode[self.phase.upper()] if self.phase.upper() in ForwardMode.__members__ else None
        )
        self.record_nolora_graph = record_nolora_graph
        self.attention_labels = tuple(attention_labels) if attention_labels else None
        self.captured_req_width = captured_req_width
        #: LoRA batches prepared (prepare_lora_batch runs per shape)
        self.lora_prepared = 0

    # - def capture(self):
    def capture(self, loop):  # +
        stream = get_or_create_global_graph_capture_stream()
        with self.backend.capture_session(stream):
            # - self._capture_one_stream()
            self._capture_one_stream(loop)  # +

    # - def _capture_one_stream(self):
    def _capture_one_stream(self, loop):  # +
        lora_variants = ("lora", "nolora") if self.record_nolora_graph else (None,)
        # - for bs in reversed(self.capture_bs):
        for bs in loop.sizes(self.phase):  # + the plan's sizes, in its order
            attention_variants = self.attention_labels or (None,)
            for variant_label in lora_variants:
                for attention_variant in attention_variants:
                    # - self.capture_one_shape(bs, variant_label, attention_variant)
                    self.capture_one_shape(loop, bs, variant_label, attention_variant)  # +

    # - def capture_one_shape(self, size, variant_label=None, attention_variant=None):
    def capture_one_shape(self, loop, size, variant_label=None, attention_variant=None):  # +
        num_tokens = size * self.captured_req_width
        labels = {"lora": variant_label, "attention": attention_variant}
        labels = {axis: label for axis, label in labels.items() if label is not None}
        step = loop.step(self.phase, size, **labels)  # +
        if variant_label == "lora":
            self.lora_prepared += 1  # prepare_lora_batch, outside the graph

        def run_once():
            return self.model.forward(self.phase, num_tokens // self.captured_req_width, labels)

        # the attention backend's hook after each warm-up (on_after_cuda_graph_warmup)
        post_warmup_hook = getattr(self.model, "on_after_cuda_graph_warmup", None)
        self.backend.capture_one(
            (size, variant_label, attention_variant),
            run_once,
            capture_inputs=None,
            post_warmup_hook=post_warmup_hook,
            step=step,  # +
        )


class EAGLEDraftCudaGraphRunner(DecodeCudaGraphRunner):
    """eagle_draft_cuda_graph_runner.py: the draft model's decode steps, in the global pool and stream."""

    phase = "draft_decode"


class EAGLEDraftExtendCudaGraphRunner(DecodeCudaGraphRunner):
    """eagle_draft_extend_cuda_graph_runner.py: the draft model's extend after verification."""

    phase = "draft_extend"
