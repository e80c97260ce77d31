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
    "MemsetParams",
    "Memcpy3D",
]


#: a launch's grid, block and dynamic shared memory, in the order both a kernel node's
#: parameters and a launch configuration lay them out (cuda.h)
_LAUNCH = [
    ("gridDimX", ctypes.c_uint),
    ("gridDimY", ctypes.c_uint),
    ("gridDimZ", ctypes.c_uint),
    ("blockDimX", ctypes.c_uint),
    ("blockDimY", ctypes.c_uint),
    ("blockDimZ", ctypes.c_uint),
    ("sharedMemBytes", ctypes.c_uint),
]


class KernelParams(ctypes.Structure):  # CUDA_KERNEL_NODE_PARAMS_v2
    _fields_ = [
        ("func", ctypes.c_void_p),
        *_LAUNCH,
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
        *_LAUNCH,
        ("hStream", ctypes.c_void_p),
        ("attrs", ctypes.POINTER(LaunchAttr)),
        ("numAttrs", ctypes.c_uint),
    ]


class MemsetParams(ctypes.Structure):  # CUDA_MEMSET_NODE_PARAMS
    _fields_ = [
        ("dst", ctypes.c_ulonglong),
        ("pitch", ctypes.c_size_t),
        ("value", ctypes.c_uint),
        ("elementSize", ctypes.c_uint),
        ("width", ctypes.c_size_t),
        ("height", ctypes.c_size_t),
    ]


def _copy_side(side: str, host: str) -> list:
    return [
        (f"{side}XInBytes", ctypes.c_size_t),
        (f"{side}Y", ctypes.c_size_t),
        (f"{side}Z", ctypes.c_size_t),
        (f"{side}LOD", ctypes.c_size_t),
        (f"{side}MemoryType", ctypes.c_int),  # CUmemorytype; ctypes pads it to the pointer after it
        (f"{side}Host", ctypes.c_void_p),
        (f"{side}Device", ctypes.c_ulonglong),
        (f"{side}Array", ctypes.c_void_p),
        (host, ctypes.c_void_p),
        (f"{side}Pitch", ctypes.c_size_t),
        (f"{side}Height", ctypes.c_size_t),
    ]


class Memcpy3D(ctypes.Structure):  # CUDA_MEMCPY3D (v2)
    _fields_ = [
        *_copy_side("src", "reserved0"),
        *_copy_side("dst", "reserved1"),
        ("WidthInBytes", ctypes.c_size_t),
        ("Height", ctypes.c_size_t),
        ("Depth", ctypes.c_size_t),
    ]


_p, _size = ctypes.c_void_p, ctypes.POINTER(ctypes.c_size_t)
_devptr = ctypes.c_ulonglong  # CUdeviceptr

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
    "cuStreamSynchronize": [_p],
    # (config, CUfunction or CUkernel, kernelParams, extra)
    "cuLaunchKernelEx": [ctypes.POINTER(LaunchConfig), _p, _p, _p],
    # the restore probe and the graph file (capture_plan.executor.graph_walk)
    # (clone out, original)
    "cuGraphClone": [ctypes.POINTER(_p), _p],
    # (CUgraphExec, CUstream)
    "cuGraphUpload": [_p, _p],
    # (const char** name out, CUfunction)
    "cuFuncGetName": [ctypes.POINTER(ctypes.c_char_p), _p],
    # (CUfunction, size_t paramIndex, size_t* paramOffset, size_t* paramSize): CUDA_ERROR_INVALID_VALUE past the last
    "cuFuncGetParamInfo": [_p, ctypes.c_size_t, _size, _size],
    # (CUmodule* out, CUfunction)
    "cuFuncGetModule": [ctypes.POINTER(_p), _p],
    # (CUfunction* out, CUkernel): a node recorded from a library's kernel has kern set, func null
    "cuKernelGetFunction": [ctypes.POINTER(_p), _p],
    # (unsigned int* count, CUmodule)
    "cuModuleGetFunctionCount": [ctypes.POINTER(ctypes.c_uint), _p],
    # (CUfunction* functions, unsigned int numFunctions, CUmodule): lazily loaded functions stay partly loaded
    "cuModuleEnumerateFunctions": [_p, ctypes.c_uint, _p],
    # (CUdeviceptr* base, size_t* size, CUdeviceptr): fails for a value that is no device allocation's address
    "cuMemGetAddressRange_v2": [ctypes.POINTER(_devptr), _size, _devptr],
    # (node, CUDA_MEMSET_NODE_PARAMS* out)
    "cuGraphMemsetNodeGetParams": [_p, ctypes.POINTER(MemsetParams)],
    # (node, CUDA_MEMCPY3D* out)
    "cuGraphMemcpyNodeGetParams": [_p, ctypes.POINTER(Memcpy3D)],
    # a graph rebuilt from a graph file (capture_plan.executor.graph_rebuild)
    # (CUgraph* out, flags 0)
    "cuGraphCreate": [ctypes.POINTER(_p), ctypes.c_uint],
    # (node out, graph, dependencies, count, params): the driver copies the parameters' values
    "cuGraphAddKernelNode_v2": [ctypes.POINTER(_p), _p, _p, ctypes.c_size_t, ctypes.POINTER(KernelParams)],
    # (node out, graph, dependencies, count, params, CUcontext)
    "cuGraphAddMemsetNode": [ctypes.POINTER(_p), _p, _p, ctypes.c_size_t, ctypes.POINTER(MemsetParams), _p],
    "cuGraphAddMemcpyNode": [ctypes.POINTER(_p), _p, _p, ctypes.c_size_t, ctypes.POINTER(Memcpy3D), _p],
    "cuGraphAddEmptyNode": [ctypes.POINTER(_p), _p, _p, ctypes.c_size_t],
    # (graph, from, to, CUgraphEdgeData*, count)
    "cuGraphAddDependencies_v2": [_p, _p, _p, _p, ctypes.c_size_t],
    # (node, CUlaunchAttributeID, const CUlaunchAttributeValue*: a 64-byte union)
    "cuGraphKernelNodeSetAttribute": [_p, ctypes.c_int, _p],
    # (CUfunction* out, CUmodule, name): a kernel looked up by its (mangled) name
    "cuModuleGetFunction": [ctypes.POINTER(_p), _p, ctypes.c_char_p],
    # (int* out, CUfunction_attribute, CUfunction) and (CUfunction, CUfunction_attribute, int)
    "cuFuncGetAttribute": [ctypes.POINTER(ctypes.c_int), ctypes.c_int, _p],
    "cuFuncSetAttribute": [_p, ctypes.c_int, ctypes.c_int],
    # (dst, src, bytes) and (dst, byte, count): the rebuild's proof copies and scribbles segments
    "cuMemcpyDtoD_v2": [_devptr, _devptr, ctypes.c_size_t],
    "cuMemsetD8_v2": [_devptr, ctypes.c_ubyte, ctypes.c_size_t],
    # (CUtensorMap* out, dataType, rank, globalAddress, globalDim, globalStrides, boxDim, elementStrides,
    #  interleave, swizzle, l2Promotion, oobFill): a host-side encoding (capture_plan.executor.tensor_map_probe)
    "cuTensorMapEncodeTiled": [
        _p,
        ctypes.c_int,
        ctypes.c_uint,
        _p,
        ctypes.POINTER(ctypes.c_uint64),
        ctypes.POINTER(ctypes.c_uint64),
        ctypes.POINTER(ctypes.c_uint),
        ctypes.POINTER(ctypes.c_uint),
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_int,
    ],
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
