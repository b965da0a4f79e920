"""Host memory the GPU reads in place, handed to XLA as an ordinary device array (`ExpertQuantization.host_memory =
"mapped"`).

Streamed experts normally live in jax's `pinned_host` memory kind. A compiled step with a host-memory operand is
run without CUDA graphs on the H200 (jax 0.11.2, 2026-12-03: the 1-slot streamed step compiles to 2,703 kernels
launched one by one and no command buffer; docs/PERF.md, "Streamed experts"). Here the rows are allocated pinned
and mapped into the GPU's address space by the CUDA driver (`cuMemHostAlloc` with `DEVICEMAP | PORTABLE`), and the
device pointer is imported through DLPack as a device-memory array: XLA sees device memory, the bytes stay in host
RAM, and every read of them crosses PCIe, as with the pinned kind. Only a kernel that reads few rows (the
staging copy, `pallas_kernels.host_gather`) should touch the array; a kernel over all of it would stream the whole
table over PCIe.

On the CPU backend the same import wraps a page-aligned host buffer (`mmap`) without a copy, so tests run the
DLPack path itself. The memory is freed when jax frees the buffer (the DLPack deleter), not when one Python array
object dies: jax may hand the same buffer to several arrays (an unchanged jit input forwarded as an output).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import itertools
import mmap

import jax
import numpy as np

_DL_CPU, _DL_CUDA = 1, 2
_DL_UINT = 1
_CU_MEMHOSTALLOC_PORTABLE, _CU_MEMHOSTALLOC_DEVICEMAP = 0x01, 0x02


class _DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class _DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _DLTensor(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("device", _DLDevice), ("ndim", ctypes.c_int32), ("dtype", _DLDataType),
                ("shape", ctypes.POINTER(ctypes.c_int64)), ("strides", ctypes.POINTER(ctypes.c_int64)),
                ("byte_offset", ctypes.c_uint64)]


class _DLManagedTensor(ctypes.Structure):
    pass


_DELETER = ctypes.CFUNCTYPE(None, ctypes.POINTER(_DLManagedTensor))
_DLManagedTensor._fields_ = [("dl_tensor", _DLTensor), ("manager_ctx", ctypes.c_void_p), ("deleter", _DELETER)]
_LIVE: dict[int, tuple] = {}  # manager_ctx -> (the exported tensor, release()) until jax frees the buffer
_next_key = itertools.count(1)


def _on_delete(managed) -> None:
    entry = _LIVE.pop(managed.contents.manager_ctx or 0, None)
    if entry is not None:
        entry[1]()


_DELETER_FN = _DELETER(_on_delete)
_capsule_new = ctypes.pythonapi.PyCapsule_New
_capsule_new.restype = ctypes.py_object
_capsule_new.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]


class _Exported:
    """The `__dlpack__` protocol over a raw pointer (uint32, C-contiguous)."""

    def __init__(self, pointer: int, shape: tuple[int, ...], device_type: int, device_id: int, release):
        self._shape = (ctypes.c_int64 * len(shape))(*shape)
        self._managed = _DLManagedTensor()
        self._managed.dl_tensor = _DLTensor(pointer, _DLDevice(device_type, device_id), len(shape),
                                            _DLDataType(_DL_UINT, 32, 1), self._shape, None, 0)
        key = next(_next_key)
        self._managed.manager_ctx = key
        self._managed.deleter = _DELETER_FN
        self._device = (device_type, device_id)
        _LIVE[key] = (self, release)  # the struct the importer holds, and the memory, live until its deleter runs

    def __dlpack_device__(self) -> tuple[int, int]:
        return self._device

    def __dlpack__(self, stream=None, max_version=None, dl_device=None, copy=None):
        return _capsule_new(ctypes.addressof(self._managed), b"dltensor", None)


@functools.cache
def _driver() -> ctypes.CDLL:
    name = ctypes.util.find_library("cuda") or "libcuda.so.1"
    try:
        return ctypes.CDLL(name)
    except OSError as err:
        raise RuntimeError(f"host_memory='mapped' needs the CUDA driver library ({name}): {err}") from err


def _check(result: int, call: str) -> None:
    if result != 0:
        text = ctypes.c_char_p()
        _driver().cuGetErrorString(result, ctypes.byref(text))
        raise RuntimeError(f"{call} failed: CUDA error {result} ({(text.value or b'?').decode()})")


def _cuda_mapped(nbytes: int, ordinal: int) -> tuple[int, int]:
    """Pinned host memory mapped for the GPU: (host pointer, device pointer)."""
    cu = _driver()
    _check(cu.cuInit(0), "cuInit")
    dev, ctx = ctypes.c_int(), ctypes.c_void_p()
    _check(cu.cuDeviceGet(ctypes.byref(dev), ordinal), "cuDeviceGet")
    _check(cu.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev), "cuDevicePrimaryCtxRetain")  # the context jax uses
    _check(cu.cuCtxPushCurrent_v2(ctx), "cuCtxPushCurrent")
    try:
        host, device = ctypes.c_void_p(), ctypes.c_uint64()
        _check(cu.cuMemHostAlloc(ctypes.byref(host), ctypes.c_size_t(nbytes),
                                 _CU_MEMHOSTALLOC_PORTABLE | _CU_MEMHOSTALLOC_DEVICEMAP), f"cuMemHostAlloc({nbytes})")
        _check(cu.cuMemHostGetDevicePointer_v2(ctypes.byref(device), host, 0), "cuMemHostGetDevicePointer")
    finally:
        cu.cuCtxPopCurrent_v2(ctypes.byref(ctypes.c_void_p()))
    return host.value, device.value


def _free_cuda(host: int, ordinal: int) -> None:
    cu = _driver()
    dev, ctx = ctypes.c_int(), ctypes.c_void_p()
    if cu.cuDeviceGet(ctypes.byref(dev), ordinal) or cu.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev):
        return  # the driver is gone (process exit): the memory goes with the process
    cu.cuCtxPushCurrent_v2(ctx)
    cu.cuMemFreeHost(ctypes.c_void_p(host))
    cu.cuCtxPopCurrent_v2(ctypes.byref(ctypes.c_void_p()))
    cu.cuDevicePrimaryCtxRelease_v2(dev)


def mapped_host_array(rows: np.ndarray, device=None) -> jax.Array:
    """`rows` (uint32, 2-D) copied into host memory the device reads in place, as a device-memory `jax.Array` of
    the same shape (see the module docstring). RuntimeError where the device has no such memory."""
    device = device if device is not None else jax.devices()[0]
    rows = np.ascontiguousarray(rows)
    if rows.dtype != np.uint32 or rows.ndim != 2:
        raise ValueError(f"mapped rows must be 2-D uint32, got {rows.dtype} {rows.shape}")
    nbytes = max(rows.nbytes, 1)
    if device.platform in ("gpu", "cuda"):
        ordinal = getattr(device, "local_hardware_id", None) or 0
        host, pointer = _cuda_mapped(nbytes, ordinal)
        view = np.ctypeslib.as_array((ctypes.c_uint32 * rows.size).from_address(host)).reshape(rows.shape)
        view[...] = rows
        exported = _Exported(pointer, rows.shape, _DL_CUDA, ordinal, functools.partial(_free_cuda, host, ordinal))
    elif device.platform == "cpu":
        buffer = mmap.mmap(-1, nbytes)  # page-aligned: imported without a copy
        np.frombuffer(buffer, np.uint32, count=rows.size).reshape(rows.shape)[...] = rows
        pointer = ctypes.addressof(ctypes.c_char.from_buffer(buffer))
        exported = _Exported(pointer, rows.shape, _DL_CPU, 0, functools.partial(_keep_until_called, buffer))
    else:
        raise RuntimeError(f"host_memory='mapped' is not available on {device.platform}")
    return jax.dlpack.from_dlpack(exported)  # on failure the importer calls the deleter: the memory is released


def _keep_until_called(buffer) -> None:
    """Holds `buffer` (through the deleter's entry in `_LIVE`) until jax frees the array that aliases it."""
