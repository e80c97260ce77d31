"""The CUDA driver calls the executor makes through ctypes: one binding, each call typed once.

The executor reads graphs (node counts, node descriptions, edges), instantiates, updates and
launches executables, and probes launch attributes through ``libcuda.so.1`` directly: torch
exposes none of these. Every call is declared here, in :data:`SIGNATURES`, with the ABI
structures it takes (cuda.h's layouts: ``CUDA_KERNEL_NODE_PARAMS_v2``, ``CUgraphEdgeData``,
``CUgraphExecUpdateResultInfo``, ``CUlaunchAttribute``, ``CUlaunchConfig``), so a call is typed
the same way wherever it is made.

Constraints: a machine without the driver (CI, the tests' fake targets) has no
``libcuda.so.1``; :func:`call` answers None and :func:`calls` the reason, and each user
decides what that means (a node count unknown, never 0; no executable shared). Every call
returns a ``CUresult`` (0: success).
"""

from __future__ import annotations

import ctypes
import functools

__all__ = [
    "SIGNATURES",
    "library",
    "call",
    "calls",
    "KernelParams",
    "EdgeData",
    "UpdateResult",
    "LaunchAttr",
    "LaunchConfig",
]


class KernelParams(ctypes.Structure):  # CUDA_KERNEL_NODE_PARAMS_v2
    _fields_ = [
        ("func", ctypes.c_void_p),
        ("gridDimX", ctypes.c_uint),
        ("gridDimY", ctypes.c_uint),
        ("gridDimZ", ctypes.c_uint),
        ("blockDimX", ctypes.c_uint),
        ("blockDimY", ctypes.c_uint),
        ("blockDimZ", ctypes.c_uint),
        ("sharedMemBytes", ctypes.c_uint),
        ("kernelParams", ctypes.c_void_p),
        ("extra", ctypes.c_void_p),
        ("kern", ctypes.c_void_p),
        ("ctx", ctypes.c_void_p),
    ]


class EdgeData(ctypes.Structure):  # CUgraphEdgeData
    _fields_ = [
        ("from_port", ctypes.c_ubyte),
        ("to_port", ctypes.c_ubyte),
        ("type", ctypes.c_ubyte),
        ("reserved", ctypes.c_ubyte * 5),
    ]


class UpdateResult(ctypes.Structure):  # CUgraphExecUpdateResultInfo
    _fields_ = [("result", ctypes.c_int), ("errorNode", ctypes.c_void_p), ("errorFromNode", ctypes.c_void_p)]


class LaunchAttr(ctypes.Structure):  # CUlaunchAttribute: the id, padding to 8 bytes, a 64-byte value union
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", ctypes.c_uint * 16)]


class LaunchConfig(ctypes.Structure):  # CUlaunchConfig
    _fields_ = [
        ("gridDimX", ctypes.c_uint),
        ("gridDimY", ctypes.c_uint),
        ("gridDimZ", ctypes.c_uint),
        ("blockDimX", ctypes.c_uint),
        ("blockDimY", ctypes.c_uint),
        ("blockDimZ", ctypes.c_uint),
        ("sharedMemBytes", ctypes.c_uint),
        ("hStream", ctypes.c_void_p),
        ("attrs", ctypes.POINTER(LaunchAttr)),
        ("numAttrs", ctypes.c_uint),
    ]


_p, _size = ctypes.c_void_p, ctypes.POINTER(ctypes.c_size_t)

#: every driver call the executor makes: name -> argument types (cuda.h)
SIGNATURES: dict[str, list] = {
    "cuDriverGetVersion": [ctypes.POINTER(ctypes.c_int)],
    # the calling thread's context: a thread of the executor's own binds its caller's
    "cuCtxGetCurrent": [ctypes.POINTER(_p)],
    "cuCtxSetCurrent": [_p],
    # (graph, nodes or null for the count alone, count)
    "cuGraphGetNodes": [_p, _p, _size],
    # (graph, from, to, edgeData, numEdges): every array may be null for the count alone
    "cuGraphGetEdges_v2": [_p, _p, _p, _p, _size],
    "cuGraphNodeGetType": [_p, ctypes.POINTER(ctypes.c_int)],
    "cuGraphKernelNodeGetParams_v2": [_p, ctypes.POINTER(KernelParams)],
    # (node, CUlaunchAttributeID, CUlaunchAttributeValue out: a 64-byte union)
    "cuGraphKernelNodeGetAttribute": [_p, ctypes.c_int, _p],
    "cuGraphInstantiateWithFlags": [ctypes.POINTER(_p), _p, ctypes.c_ulonglong],
    "cuGraphExecUpdate_v2": [_p, _p, ctypes.POINTER(UpdateResult)],
    "cuGraphLaunch": [_p, _p],
    "cuGraphExecDestroy": [_p],
    "cuGraphDestroy": [_p],
    "cuStreamCreate": [ctypes.POINTER(_p), ctypes.c_uint],
    "cuStreamBeginCapture_v2": [_p, ctypes.c_int],
    "cuStreamEndCapture": [_p, ctypes.POINTER(_p)],
    "cuStreamDestroy_v2": [_p],
    # (config, CUfunction or CUkernel, kernelParams, extra)
    "cuLaunchKernelEx": [ctypes.POINTER(LaunchConfig), _p, _p, _p],
}


@functools.cache
def library() -> ctypes.CDLL | str:
    """``libcuda.so.1``, or why it cannot be loaded."""
    try:
        return ctypes.CDLL("libcuda.so.1")
    except OSError as err:
        return f"libcuda.so.1 cannot be loaded ({err})"


@functools.cache
def call(name: str):
    """The driver call ``name`` (a key of :data:`SIGNATURES`), typed; None where the
    library or the symbol is missing."""
    lib = library()
    fn = None if isinstance(lib, str) else getattr(lib, name, None)
    if fn is None:
        return None
    fn.argtypes, fn.restype = SIGNATURES[name], ctypes.c_int
    return fn


def calls(*names: str) -> dict | str:
    """The driver calls ``names`` by name, or a sentence saying why one is not there."""
    lib = library()
    if isinstance(lib, str):
        return lib
    got = {}
    for name in names:
        fn = call(name)
        if fn is None:
            return f"libcuda.so.1 has no {name}"
        got[name] = fn
    return got
