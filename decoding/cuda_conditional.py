"""CUDA graph conditional WHILE nodes inside a PyTorch graph capture, through cuda-python (``cuda.bindings``).

``builder.while_loop(flag, body)`` captures ``while (*flag) { body() }`` into the graph being captured:
a one-thread kernel (compiled once with NVRTC) copies the 0-dim bool ``flag`` into the node's condition
handle before the node and again at the end of each body pass, and the body is captured into the node's
child graph on its own stream. Loops nest (the inner node lands in the outer body graph).

cuda-python is imported lazily: this module imports on a CPU-only machine and ``conditional_support()``
says why conditional nodes are unavailable there. Binding signatures differ between CUDA 12 and 13 (13 adds
edge data to capture-info queries and node insertion); both are handled by unpacking the variable part.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

# "1": "auto" may choose them; unset: only a forced cuda_graphs="conditional" uses them; "0": never (a forced mode
# refuses). Opt-in: their capture of the real decoder crashed the process (a segfault ending torch's capture, no
# error to fall back on) on an H200, driver 580 (CUDA 13.0), torch 2.11, cuda-python 13.3, while small loops of
# elementwise work captured and ran there (docs/benchmarks.md).
SWITCH = "BATCHASR_CONDITIONAL_NODES"
MIN_DRIVER = (12, 6)  # cooperative kernels (some LSTM/GEMM kernels) fail inside conditional bodies before 12.6
MIN_BINDINGS = (12, 3)  # conditional nodes and cuStreamBeginCaptureToGraph

# No headers under NVRTC: declare the handle type and the device-runtime builtin ourselves.
_KERNEL_NAME = b"batchasr_set_condition"
_KERNEL_SOURCE = r"""
typedef __device_builtin__ unsigned long long cudaGraphConditionalHandle;
extern "C" __device__ __cudart_builtin__ void cudaGraphSetConditional(cudaGraphConditionalHandle handle,
                                                                     unsigned int value);
extern "C" __global__ void batchasr_set_condition(cudaGraphConditionalHandle handle, const bool* flag)
{
    cudaGraphSetConditional(handle, *flag ? 1u : 0u);
}
"""


class CudaPythonError(RuntimeError):
    """A cuda-python call returned an error code."""


def _version_tuple(text: str) -> tuple[int, ...]:
    """"12.9.2" -> (12, 9, 2); "13.0.0rc1" -> (13, 0, 0)."""
    return tuple(int(m.group()) for m in (re.match(r"\d+", piece) for piece in text.split(".")[:3]) if m)


def _bindings() -> tuple[Any, Any, tuple[int, ...]]:
    """(driver, nvrtc, bindings version); ImportError when cuda-python's ``cuda.bindings`` is missing."""
    import cuda.bindings
    from cuda.bindings import driver, nvrtc

    return driver, nvrtc, _version_tuple(cuda.bindings.__version__)


def conditional_support(device: torch.device | None = None) -> tuple[bool, str]:
    """Whether conditional WHILE nodes can be used here, and why (for the mode log line). With ``device``, the
    condition kernel is compiled and loaded for it too (once): an NVRTC newer than the driver makes code it
    cannot load, which would otherwise show only at the first capture."""
    if switched_off():
        return False, f"switched off ({SWITCH}=0)"
    if not torch.cuda.is_available():
        return False, "CUDA is not available"
    try:
        driver, _, version = _bindings()
    except ImportError as exc:
        return False, f"cuda-python (cuda.bindings) is not importable: {exc}"
    if version < MIN_BINDINGS:
        return False, f"cuda-python {'.'.join(map(str, version))} < {'.'.join(map(str, MIN_BINDINGS))}"
    try:
        err, raw = driver.cuDriverGetVersion()
    except (RuntimeError, OSError) as exc:  # no libcuda (ROCm builds, containers without a driver)
        return False, f"the CUDA driver cannot be queried: {exc}"
    if _code(err) != 0:
        return False, f"cuDriverGetVersion failed: {err}"
    driver_version = (raw // 1000, (raw % 1000) // 10)
    if driver_version < MIN_DRIVER:
        return False, (f"CUDA driver {driver_version[0]}.{driver_version[1]} < "
                       f"{MIN_DRIVER[0]}.{MIN_DRIVER[1]}")
    if device is not None:
        try:
            load_condition_kernel(device)
        except (CudaPythonError, RuntimeError, OSError) as exc:  # no NVRTC library at all raises RuntimeError
            return False, str(exc)
    return True, (f"CUDA driver {driver_version[0]}.{driver_version[1]}, "
                  f"cuda-python {'.'.join(map(str, version))}")


def switched_off() -> bool:
    """``BATCHASR_CONDITIONAL_NODES=0``: never, a forced mode included."""
    return os.environ.get(SWITCH, "").strip() == "0"


def conditional_opted_in() -> bool:
    """Whether ``cuda_graphs="auto"`` may choose conditional nodes (``BATCHASR_CONDITIONAL_NODES=1``)."""
    return os.environ.get(SWITCH, "").strip() == "1"


def _code(err: Any) -> int:
    return int(getattr(err, "value", err))


def _check(result: Any, what: str) -> Any:
    """Unpack a cuda-python ``(err, *values)`` tuple, raising on error; returns the values (one, a tuple, None)."""
    err, *values = result if isinstance(result, tuple) else (result,)
    if _code(err) != 0:
        raise CudaPythonError(f"{what} failed: {err}")
    if not values:
        return None
    return values[0] if len(values) == 1 else tuple(values)


_KERNELS: dict[int, Any] = {}  # device index -> CUfunction (modules are per context, so per device)


def compile_condition_kernel(arch: str | None = None) -> bytes:
    """NVRTC-compile the condition kernel: machine code (a cubin) for ``arch`` ("sm_90"), or PTX without one.

    Needs NVRTC but no GPU. A cubin loads on any driver of the same CUDA major version; PTX must be JIT-compiled
    by the driver, which refuses PTX newer than itself (an NVRTC 12.8 with a 12.6 driver).
    """
    _, nvrtc, _ = _bindings()
    options = [f"--gpu-architecture={arch}".encode()] if arch else []
    program = _check(nvrtc.nvrtcCreateProgram(_KERNEL_SOURCE.encode(), b"set_condition.cu", 0, [], []),
                     "nvrtcCreateProgram")
    try:
        err, *_ = nvrtc.nvrtcCompileProgram(program, len(options), options)
        if _code(err) != 0:
            size = _check(nvrtc.nvrtcGetProgramLogSize(program), "nvrtcGetProgramLogSize")
            log = bytearray(size)  # NVRTC writes into the buffer
            nvrtc.nvrtcGetProgramLog(program, log)
            raise CudaPythonError(f"NVRTC could not compile the condition kernel for {arch or 'PTX'}: "
                                  f"{log.decode(errors='replace').strip() or err}")
        get_size, get = ((nvrtc.nvrtcGetCUBINSize, nvrtc.nvrtcGetCUBIN) if arch
                         else (nvrtc.nvrtcGetPTXSize, nvrtc.nvrtcGetPTX))
        image = bytearray(_check(get_size(program), get_size.__name__))
        _check(get(program, image), get.__name__)
        return bytes(image)
    finally:
        nvrtc.nvrtcDestroyProgram(program)


def load_condition_kernel(device: torch.device) -> Any:
    """Compile (NVRTC) and load the condition kernel for ``device`` once; call it before capture starts.

    Machine code for the device's own architecture first; PTX where this NVRTC does not know the architecture
    (a GPU newer than the toolkit) or the cubin does not load.
    """
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index in _KERNELS:
        return _KERNELS[index]
    driver, _, _ = _bindings()
    major, minor = torch.cuda.get_device_capability(index)
    failures = []
    for arch in (f"sm_{major}{minor}", None):
        try:
            image = compile_condition_kernel(arch)
            with torch.cuda.device(index):
                # a runtime call makes the device's primary context current on this thread: the driver calls below
                # need one, and nothing may have created it yet (a first use of the GPU, a new thread)
                torch.cuda.synchronize(index)
                module = _check(driver.cuModuleLoadData(image), "cuModuleLoadData")
                _KERNELS[index] = _check(driver.cuModuleGetFunction(module, _KERNEL_NAME), "cuModuleGetFunction")
            return _KERNELS[index]
        except CudaPythonError as exc:
            failures.append(str(exc))
    raise CudaPythonError("the condition kernel does not load: " + "; ".join(failures))


class ConditionalGraphBuilder:
    """Adds WHILE nodes to the graph being captured on the current stream (create it inside the capture).

    Condition handles are created on the top-level graph, also for nested loops (CUDA allows a handle to
    serve a node in the graph or any of its children).
    """

    def __init__(self, device: torch.device, body_streams: list[torch.cuda.Stream]):
        self.device = device
        self._body_streams = body_streams  # one per nesting level, warmed up by the caller
        self._depth = 0
        self._driver, _, _ = _bindings()
        self._kernel = load_condition_kernel(device)
        self._keepalive: list[Any] = []  # handles and argument arrays the captured launches point to
        status, _, self._graph, *_ = self._capture_info(self._current_stream())  # the top-level CUgraph
        self._require_active(status)

    def while_loop(self, flag: torch.Tensor, body: Callable[[], None]) -> None:
        """Capture ``while (flag) { body() }``; ``flag`` is a 0-dim bool tensor that ``body`` updates."""
        drv = self._driver
        if flag.dtype != torch.bool or flag.dim() != 0:
            raise ValueError("the loop flag must be a 0-dim bool tensor")
        if self._depth >= len(self._body_streams):
            raise ValueError(f"loops nest deeper than the {len(self._body_streams)} body streams given")
        ctx = _check(drv.cuCtxGetCurrent(), "cuCtxGetCurrent")
        handle = _check(drv.cuGraphConditionalHandleCreate(self._graph, ctx, 0, 0),
                        "cuGraphConditionalHandleCreate")
        args = self._kernel_args(handle, flag)
        parent = self._current_stream()
        self._launch_condition(args, parent)  # decides whether the loop is entered at all
        body_graph = self._add_while_node(parent, handle, ctx)
        body_stream = self._body_streams[self._depth]
        body_handle = drv.CUstream(body_stream.cuda_stream)
        _check(drv.cuStreamBeginCaptureToGraph(body_handle, body_graph, None, None, 0,
                                               drv.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_THREAD_LOCAL),
               "cuStreamBeginCaptureToGraph")
        self._depth += 1
        try:
            with torch.cuda.stream(body_stream):  # PyTorch ops now land in the node's body graph
                body()
                self._launch_condition(args, body_handle)  # decides whether the body runs again
        except BaseException:
            # an op the body could not capture invalidated the capture, and ending it fails too: that failure
            # would hide the op's error, which says what to fix (and what a fallback's warning logs)
            drv.cuStreamEndCapture(body_handle)
            raise
        finally:
            self._depth -= 1
        _check(drv.cuStreamEndCapture(body_handle), "cuStreamEndCapture")

    # --- helpers ----------------------------------------------------------------------------------------------

    def _current_stream(self) -> Any:
        return self._driver.CUstream(torch.cuda.current_stream(self.device).cuda_stream)

    def _capture_info(self, stream: Any) -> tuple[Any, ...]:
        # CUDA 12: (status, id, graph, deps, n); CUDA 13: (status, id, graph, deps, edge_data, n)
        return _check(self._driver.cuStreamGetCaptureInfo(stream), "cuStreamGetCaptureInfo")

    def _require_active(self, status: Any) -> None:
        if status != self._driver.CUstreamCaptureStatus.CU_STREAM_CAPTURE_STATUS_ACTIVE:
            raise CudaPythonError("conditional nodes need an active stream capture")

    def _kernel_args(self, handle: Any, flag: torch.Tensor) -> np.ndarray:
        # cuLaunchKernel takes the address of each argument: an array of pointers to the values
        values = [np.array([int(handle)], dtype=np.uint64), np.array([flag.data_ptr()], dtype=np.uint64)]
        pointers = np.array([v.ctypes.data for v in values], dtype=np.uint64)
        self._keepalive.extend([handle, *values, pointers])
        return pointers

    def _launch_condition(self, args: np.ndarray, stream: Any) -> None:
        _check(self._driver.cuLaunchKernel(self._kernel, 1, 1, 1, 1, 1, 1, 0, stream, args.ctypes.data, 0),
               "cuLaunchKernel")

    def _add_while_node(self, stream: Any, handle: Any, ctx: Any) -> Any:
        """Insert the WHILE node after the stream's current dependencies; later work depends on it."""
        drv = self._driver
        status, _, graph, *deps_info, n_deps = self._capture_info(stream)
        self._require_active(status)
        params = drv.CUgraphNodeParams()
        params.type = drv.CUgraphNodeType.CU_GRAPH_NODE_TYPE_CONDITIONAL
        params.conditional.handle = handle
        params.conditional.type = drv.CUgraphConditionalNodeType.CU_GRAPH_COND_TYPE_WHILE
        params.conditional.size = 1
        params.conditional.ctx = ctx
        # deps_info is [deps] on CUDA 12 and [deps, edge_data] on CUDA 13, in both calls' argument order. The edge
        # data goes in as None (default edges), as NeMo passes it: what the query returned points into the driver's
        # own memory, and the node's one dependency, our condition kernel, needs no other kind of edge
        deps, *edge_data = deps_info
        node = _check(drv.cuGraphAddNode(graph, deps, *([None] * len(edge_data)), n_deps, params), "cuGraphAddNode")
        _check(drv.cuStreamUpdateCaptureDependencies(
            stream, [node], *([None] * (len(deps_info) - 1)), 1,
            drv.CUstreamUpdateCaptureDependencies_flags.CU_STREAM_SET_CAPTURE_DEPENDENCIES),
            "cuStreamUpdateCaptureDependencies")
        return params.conditional.phGraph_out[0]
