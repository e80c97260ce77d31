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
* Before any runner: ``runtime_context.py`` ``publish`` projects the resolved server
  args into config bags in the scheduler process; ``get_exec().graph.cuda_graph_config``
  (``cuda_graph_config.py`` ``CudaGraphConfig``) holds the decode phase's configured sizes
  (``PhaseConfig.bs``). ``model_runner.py`` ``ModelRunner.__init__`` ends in
  ``initialize()``, which loads the weights (``load_model``); the KV cache and the request
  pool (``req_to_token_pool.size``) come next, then the runners, whose sizes
  ``base_cuda_graph_runner.py`` ``get_batch_sizes_to_capture`` makes from the configured
  ones: aligned (``get_cuda_graph_batch_size_alignment``), none above the pool's size, the
  pool's size added where it is below the largest.

The adoption: each added line ends with ``# +``, each removed one stays as a
``# - `` comment (tests/engines/adoption.py counts them and runs the version
before). The loop comes in through ``capture(loop)``; every size and label
is the plan's (``loop.step`` refuses a key out of the plan's order); the
backend warms up, records and holds through the step.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import types

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


# -- the start-up before the runners: the published config and the model runner ------------------


class Backend:
    """cuda_graph_config.py: the capture backends a phase can use."""

    FULL = "full"
    BREAKABLE = "breakable"
    DISABLED = "disabled"


@dataclasses.dataclass
class PhaseConfig:
    """cuda_graph_config.py: one phase's settings (its backend and configured sizes)."""

    backend: str = Backend.DISABLED
    bs: list[int] | None = None


@dataclasses.dataclass
class CudaGraphConfig:
    """cuda_graph_config.py: one PhaseConfig per phase (the decode one here)."""

    decode: PhaseConfig = dataclasses.field(default_factory=lambda: PhaseConfig(backend=Backend.FULL))


_exec = None
_alignment = 1


def publish(decode_bs, *, alignment: int = 1, backend: str = Backend.FULL) -> None:
    """runtime_context.publish: the scheduler's resolved config (here: the decode phase's
    backend and configured sizes, and the alignment the parallel settings give)."""
    global _exec, _alignment
    config = CudaGraphConfig(PhaseConfig(backend=backend, bs=list(decode_bs)))
    _exec = types.SimpleNamespace(graph=types.SimpleNamespace(cuda_graph_config=config))
    _alignment = alignment


def get_exec():
    """runtime_context.get_exec: the published exec config bag."""
    if _exec is None:
        raise ValueError("exec config bag not published")
    return _exec


def get_cuda_graph_batch_size_alignment(*, gathered_buffer_required=None):
    """utils/common.py: the alignment a runner's sizes must keep (two-batch overlap, attention TP/CP)."""
    return _alignment


def get_batch_sizes_to_capture(model_runner, captured_req_width=1, *, gathered_buffer_required=None):
    """base_cuda_graph_runner.py: (capture_bs, compile_bs) from the configured decode sizes."""
    capture_bs = list(get_exec().graph.cuda_graph_config.decode.bs)
    mul_base = get_cuda_graph_batch_size_alignment(gathered_buffer_required=gathered_buffer_required)
    num_max_requests = -(-model_runner.req_to_token_pool.size // mul_base) * mul_base
    if max(capture_bs) > num_max_requests:
        capture_bs += [num_max_requests]
    capture_bs = [bs for bs in capture_bs if bs * captured_req_width % mul_base == 0]
    capture_bs = [bs for bs in capture_bs if bs <= num_max_requests]
    return sorted(set(capture_bs)), []


class ModelRunner:
    """model_runner.py: made once the config is published; ``initialize`` loads the weights
    (minutes for a large model), then the KV cache sizes the request pool; the graph runners
    come after (``init_cuda_graphs``)."""

    def __init__(self, model, *, max_running_requests: int, is_draft_worker: bool = False):
        self.model, self.is_draft_worker = model, is_draft_worker
        self.max_running_requests = max_running_requests
        self.weights_loaded = False
        self.req_to_token_pool = None
        self.initialize()
        self.init_memory_pool()

    def initialize(self):
        self.load_model()

    def load_model(self):
        self.weights_loaded = True

    def init_memory_pool(self):
        self.req_to_token_pool = types.SimpleNamespace(size=self.max_running_requests)

    def capture_bs(self, captured_req_width: int = 1) -> list[int]:
        """What the runners' ``__init__`` computes (``get_batch_sizes_to_capture(self, ...)``)."""
        return get_batch_sizes_to_capture(self, captured_req_width)[0]
