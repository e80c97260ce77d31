"""The capture stream of each device, and the cuBLAS workspaces graphs bake in.

Plain functions: :func:`capture_stream` (one per device and process),
:func:`prime_stream` (its cuBLAS workspace, made outside every pool before the
first capture), :func:`primed_streams` (the streams primed so far, by name: a graph
file names the workspaces they hold, ``capture_plan.executor.graph_file``) and
:func:`init_cublas` (a serving thread's handles, before a background capture starts).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

__all__ = [
    "capture_stream",
    "prime_stream",
    "prime_streams",
    "name_stream",
    "workspace_streams",
    "primed_streams",
    "init_cublas",
]

#: the executor's capture stream of each device, made once per process: cuBLAS keeps a
#: workspace per (handle, stream) for the life of the process, so a new stream per
#: capture() would leave one more workspace behind every time
_streams: dict = {}
#: every stream prime_stream primed in this process: its ``cudaStream_t`` -> its name (the plan's
#: name of the stream, "capture" for the capture stream; else "capture" for the executor's
#: capture stream and "streamK" for the K-th other stream primed), the first name it was primed under
_primed: dict[int, str] = {}
#: streams the executor made to hold a workspace under a name a graph file gives it, per
#: (device, "NAME/K"): :func:`workspace_streams`
_named: dict[tuple[str, str], torch.cuda.Stream] = {}


def capture_stream(device) -> torch.cuda.Stream:
    """The stream every capture on ``device`` records on (one per device and process).

    Graphs captured on it bake in its cuBLAS workspace, which all of them share:
    replays of graphs from different GraphSets must not run at the same time on
    different streams (as replays within one GraphSet must not either)."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:  # "cuda" and "cuda:0" are one device
        device = torch.device("cuda", torch.cuda.current_device())
    key = str(device)
    stream = _streams.get(key)
    if stream is None:
        stream = _streams[key] = torch.cuda.Stream(device=device)
    return stream


def prime_stream(device, stream: torch.cuda.Stream | None = None, name: str | None = None) -> None:
    """Create ``stream``'s (default: the capture stream's) cuBLAS workspace, outside
    every pool, and remember the stream as ``name`` (:func:`primed_streams`).

    cuBLAS allocates a workspace per (handle, stream) at the stream's first
    GEMM and keeps it. The operands are allocated on the calling thread's
    stream without a kernel (a few bytes in blocks the engine's stream has
    cached) and filled on the capture stream, so that the capture stream
    gets no small segment of its own: the workspace is all this leaves.
    (Operands from a scratch pool left its 2 MiB segment behind: a pool
    destroyed while its blocks are alive keeps their segment cached.) In a
    process that has run no GEMM yet this also initializes cuBLAS, which took
    66 MiB outside the caching allocator on an H200.

    One dtype (bfloat16) is enough: the workspace belongs to the handle and the stream,
    and a GEMM of another dtype made on it after the priming takes no memory
    (tests/test_gpu_executor.py). A float32 GEMM here made a process whose model runs
    none (the reference decode model) load cuBLAS's float32 kernels: without it the
    reference's start-up prediction spends a fifth of the time outside its recorded
    steps (``timings``' ``record.capture.other``: docs/measurements.md, "The first
    prediction's cost"). A model that runs one loads them in its own eager run or
    warm-up either way.

    Not made here: what a GEMM with a one-dimensional bias (cuBLASLt's epilogue) adds
    at its first run on the stream. A model with such GEMMs makes it in its first
    warm-up, and the recording of a start-up prediction measures it with the stream's
    workspace (Qwen2 and Qwen2-MoE: 1 MiB more than the models without biases)."""
    stream = stream if stream is not None else capture_stream(device)
    if stream.cuda_stream not in _primed:
        _primed[stream.cuda_stream] = name or (
            "capture" if stream is capture_stream(device) else f"stream{len(_primed)}"
        )
    a = torch.empty(16, 16, device=device, dtype=torch.bfloat16)
    out = torch.empty(16, 16, device=device, dtype=torch.bfloat16)
    with torch.cuda.stream(stream):
        a.fill_(1)
        torch.addmm(a, a, a, out=out)
        torch.matmul(a, a, out=out)
        stream.synchronize()  # the operands are idle before they go back to their stream
    del a, out


def prime_streams(device, streams: dict[str, torch.cuda.Stream]) -> None:
    """:func:`prime_stream` each of ``streams`` (name -> stream: a plan's), a stream under two
    names once, under the first."""
    primed = set()
    for name, stream in streams.items():
        if stream not in primed:
            primed.add(stream)
            prime_stream(device, stream, name)


def name_stream(stream: torch.cuda.Stream, name: str) -> None:
    """Remember ``stream`` as ``name`` (:func:`primed_streams`) without priming it: a stream
    an engine records its own graphs on (vLLM 0.34's manager makes one per capture), whose
    warm-ups made its cuBLAS workspace before the recording. A graph file then names that
    workspace ``NAME/K`` instead of leaving an unnamed segment no restore relocates. A stream
    keeps the first name it was given."""
    _primed.setdefault(stream.cuda_stream, name)


def workspace_streams(device, workspaces: Iterable[tuple[str, int]]) -> None:
    """For each workspace stream name of a graph file (``workspaces``: per workspace it names,
    its stream's name and its bytes: ``("engine", 32 MiB)`` for ``engine/0``) as many streams
    primed under it as the file names workspaces of the name's largest size, made where this
    process has fewer: streams of the executor's, made once per device, name and index and
    kept for the process as cuBLAS keeps its workspace. cuBLAS makes one workspace of that
    size per stream (vLLM 0.34 makes a stream per manager's capture: a speculator's graphs
    use another workspace than the model's); the smaller ones (cuBLASLt's, where a GEMM has a
    bias) come with a stream's first such GEMM, in the restore's loading runs. A restore's
    graphs then have the workspaces their saved graphs had, at the cost the engine's own
    streams had in the saving process."""
    sizes: dict[str, list[int]] = {}
    for name, size in workspaces:
        sizes.setdefault(name, []).append(size)
    for name, got in sorted(sizes.items()):
        count = got.count(max(got))
        have = sum(1 for n in _primed.values() if n == name)
        for k in range(have, count):
            key = (str(torch.device(device)), f"{name}/{k}")
            stream = _named.get(key)
            if stream is None:
                stream = _named[key] = torch.cuda.Stream(device=device)
            prime_stream(device, stream, name)


def primed_streams() -> dict[int, str]:
    """The streams :func:`prime_stream` primed in this process: ``cudaStream_t`` -> name.
    What the caching allocator holds on them outside every pool, no tensor of the target
    covering it, is the libraries' per-stream workspaces (cuBLAS's, cuBLASLt's), which the
    graphs captured on them bake in."""
    return dict(_primed)


def init_cublas(device) -> None:
    """Create this thread's cuBLAS and cuBLASLt handles and workspace on its current stream.

    A thread's first cuBLAS call creates its handle, which must not happen while
    another thread captures (it invalidates the capture)."""
    for dt in (torch.float32, torch.bfloat16):
        a = torch.ones(16, 16, device=device, dtype=dt)
        torch.addmm(a, a, a)
        a @ a  # pyright: ignore[reportUnusedExpression]  # run for the cuBLASLt handle it creates
