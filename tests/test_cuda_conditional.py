"""What of the graph machinery a CPU can check: support detection, the CUDA 12/13 binding shims, and the
no_while host loop (with stand-in graphs that replay by calling the captured function)."""

from __future__ import annotations

import contextlib
from types import SimpleNamespace

import pytest
import torch

from decoding import cuda_conditional, cuda_graphs
from decoding.cuda_conditional import ConditionalGraphBuilder, CudaPythonError, _check, _version_tuple
from decoding.frame_looping import frame_looping_greedy
from decoding.label_looping import LabelLooper
from models import load_model

ACTIVE = "active"


def fake_driver(cuda_major: int, driver_version: int = 12080) -> SimpleNamespace:
    """Just enough of ``cuda.bindings.driver`` to add a WHILE node, recording the calls."""
    calls: list[tuple] = []

    def capture_info(stream):
        if cuda_major >= 13:  # (err, status, id, graph, deps, edge_data, n)
            return 0, ACTIVE, 7, "graph", ["dep"], ["edge"], 1
        return 0, ACTIVE, 7, "graph", ["dep"], 1

    def add_node(*args):
        calls.append(("cuGraphAddNode", *args[:-1]))
        return 0, "node"

    def update_deps(*args):
        calls.append(("cuStreamUpdateCaptureDependencies", *args))
        return (0,)

    def node_params():
        return SimpleNamespace(type=None, conditional=SimpleNamespace(phGraph_out=["body graph"]))

    return SimpleNamespace(
        calls=calls,
        cuStreamGetCaptureInfo=capture_info,
        cuGraphAddNode=add_node,
        cuStreamUpdateCaptureDependencies=update_deps,
        cuDriverGetVersion=lambda: (0, driver_version),
        CUgraphNodeParams=node_params,
        CUstreamCaptureStatus=SimpleNamespace(CU_STREAM_CAPTURE_STATUS_ACTIVE=ACTIVE),
        CUgraphNodeType=SimpleNamespace(CU_GRAPH_NODE_TYPE_CONDITIONAL="conditional"),
        CUgraphConditionalNodeType=SimpleNamespace(CU_GRAPH_COND_TYPE_WHILE="while"),
        CUstreamUpdateCaptureDependencies_flags=SimpleNamespace(CU_STREAM_SET_CAPTURE_DEPENDENCIES="set"),
    )


@pytest.mark.parametrize("cuda_major", [12, 13])
def test_while_node_uses_the_signatures_of_both_cuda_versions(cuda_major):
    driver = fake_driver(cuda_major)
    builder = object.__new__(ConditionalGraphBuilder)  # skip __init__: it needs a live capture
    builder._driver = driver
    assert builder._add_while_node("stream", "handle", "ctx") == "body graph"
    if cuda_major >= 13:
        # the edge data the query returned is not passed back: default edges (None), as NeMo does
        assert driver.calls == [("cuGraphAddNode", "graph", ["dep"], None, 1),
                                ("cuStreamUpdateCaptureDependencies", "stream", ["node"], None, 1, "set")]
    else:
        assert driver.calls == [("cuGraphAddNode", "graph", ["dep"], 1),
                                ("cuStreamUpdateCaptureDependencies", "stream", ["node"], 1, "set")]


@pytest.mark.parametrize("fails", ["body", "nothing"])
def test_a_body_that_breaks_the_capture_raises_its_own_error(monkeypatch, fails):
    """An op that cannot be captured invalidates the capture, so ending it fails as well: that failure (a
    CudaPythonError naming cuStreamEndCapture) came instead of the op's error, and a fallback's warning said only
    that. The capture is ended either way, and the nesting depth restored."""
    driver = fake_driver(12)
    ended = []
    driver.cuGraphConditionalHandleCreate = lambda *args: (0, "handle")
    driver.cuCtxGetCurrent = lambda: (0, "ctx")
    driver.CUstream = lambda handle: handle
    driver.CUstreamCaptureMode = SimpleNamespace(CU_STREAM_CAPTURE_MODE_THREAD_LOCAL="thread local")
    driver.cuStreamBeginCaptureToGraph = lambda *args: (0,)
    invalidated = 901 if fails == "body" else 0  # CUDA_ERROR_STREAM_CAPTURE_INVALIDATED
    driver.cuStreamEndCapture = lambda stream: ended.append(stream) or (invalidated, None)
    builder = object.__new__(ConditionalGraphBuilder)  # skip __init__: it needs a live capture
    builder._driver, builder._graph, builder._depth, builder._keepalive = driver, "graph", 0, []
    builder._body_streams = [SimpleNamespace(cuda_stream="body stream")]
    monkeypatch.setattr(builder, "_kernel_args", lambda handle, flag: "args", raising=False)
    monkeypatch.setattr(builder, "_launch_condition", lambda args, stream: None, raising=False)
    monkeypatch.setattr(builder, "_current_stream", lambda: "parent", raising=False)
    monkeypatch.setattr(torch.cuda, "stream", lambda stream: contextlib.nullcontext())

    def body():
        if fails == "body":
            raise RuntimeError("operation not permitted when stream is capturing")

    flag = torch.zeros((), dtype=torch.bool)
    if fails == "body":
        with pytest.raises(RuntimeError, match="operation not permitted"):
            builder.while_loop(flag, body)
    else:
        builder.while_loop(flag, body)
    assert ended == ["body stream"] and builder._depth == 0


def test_check_unpacks_and_raises():
    assert _check((0,), "f") is None
    assert _check((0, "x"), "f") == "x"
    assert _check((0, "x", "y"), "f") == ("x", "y")
    with pytest.raises(CudaPythonError, match="f failed"):
        _check((SimpleNamespace(value=700), "x"), "f")
    assert _version_tuple("12.9.2") == (12, 9, 2) and _version_tuple("13.0.0rc1") == (13, 0, 0)


@pytest.mark.parametrize(
    ("bindings", "driver_version", "supported", "reason"),
    [
        (None, 12080, False, "not importable"),
        ((12, 2, 0), 12080, False, "cuda-python 12.2.0 < 12.3"),
        ((12, 9, 0), 12040, False, "CUDA driver 12.4 < 12.6"),
        ((12, 9, 0), "raise", False, "cannot be queried"),
        ((13, 0, 1), 13000, True, "CUDA driver 13.0, cuda-python 13.0.1"),
    ],
)
def test_support_detection(monkeypatch, bindings, driver_version, supported, reason):
    driver = fake_driver(13, 0 if driver_version == "raise" else driver_version)
    if driver_version == "raise":  # a host without libcuda
        driver.cuDriverGetVersion = lambda: (_ for _ in ()).throw(RuntimeError("libcuda.so not found"))

    def fake_bindings():
        if bindings is None:
            raise ImportError("No module named 'cuda'")
        return driver, None, bindings

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(cuda_conditional, "_bindings", fake_bindings)
    ok, why = cuda_conditional.conditional_support()
    assert ok is supported and reason in why


def test_a_condition_kernel_that_does_not_load_on_the_device_is_no_support(monkeypatch):
    """NVRTC newer than the driver makes a kernel the driver cannot load: said when the mode is chosen (auto takes
    plain graphs, a forced conditional mode refuses), not at the first capture."""
    def no_kernel(device):
        raise CudaPythonError("the condition kernel does not load: cuModuleLoadData failed: "
                              "CUDA_ERROR_UNSUPPORTED_PTX_VERSION")

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(cuda_conditional, "_bindings", lambda: (fake_driver(12, 12080), None, (13, 0, 1)))
    monkeypatch.setattr(cuda_conditional, "load_condition_kernel", no_kernel)
    assert cuda_conditional.conditional_support()[0]  # no device: the driver and bindings alone
    ok, why = cuda_conditional.conditional_support(torch.device("cuda", 0))
    assert not ok and "UNSUPPORTED_PTX_VERSION" in why
    choice = cuda_graphs.choose_mode("auto", torch.device("cuda", 0))
    assert choice.mode == "no_while" and "UNSUPPORTED_PTX_VERSION" in choice.reason
    with pytest.raises(RuntimeError, match="UNSUPPORTED_PTX_VERSION"):
        cuda_graphs.choose_mode("conditional", torch.device("cuda", 0))


@pytest.mark.parametrize(("value", "supported", "auto"), [
    ("0", False, "no_while"), (" 0 ", False, "no_while"), ("1", True, "conditional"), (" 1", True, "conditional"),
    ("", True, "no_while"), (None, True, "no_while"), ("yes", True, "no_while")])
def test_the_environment_opts_auto_in_to_conditional_nodes_or_switches_them_off(monkeypatch, value, supported, auto):
    """BATCHASR_CONDITIONAL_NODES=1 lets "auto" choose conditional nodes: their capture crashed the process on a GPU
    (a segfault, nothing to fall back from), so by default only a forced mode uses them. "0": a capable system says
    no, a forced mode refuses (scripts/gpu_check.sh sets it should they hang or fail)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(cuda_conditional, "_bindings", lambda: (fake_driver(13, 13000), None, (13, 0, 1)))
    monkeypatch.setattr(cuda_conditional, "load_condition_kernel", lambda device: "kernel")  # it loads
    if value is None:
        monkeypatch.delenv(cuda_conditional.SWITCH, raising=False)
    else:
        monkeypatch.setenv(cuda_conditional.SWITCH, value)
    ok, why = cuda_conditional.conditional_support()
    assert ok is supported and (supported or "switched off (BATCHASR_CONDITIONAL_NODES=0)" in why)
    choice = cuda_graphs.choose_mode("auto", torch.device("cuda", 0))
    assert choice.mode == auto
    if supported and auto == "no_while":
        assert "opt-in (BATCHASR_CONDITIONAL_NODES=1" in choice.reason
    if supported:
        assert cuda_graphs.choose_mode("conditional", torch.device("cuda", 0)).mode == "conditional"
    else:
        with pytest.raises(RuntimeError, match="switched off"):
            cuda_graphs.choose_mode("conditional", torch.device("cuda", 0))


def test_auto_falls_back_to_no_while_and_forced_conditional_raises(monkeypatch):
    monkeypatch.setattr(cuda_graphs, "conditional_support", lambda device: (False, "CUDA driver 12.4 < 12.6"))
    cuda = torch.device("cuda", 0)
    choice = cuda_graphs.choose_mode("auto", cuda)
    assert choice.mode == "no_while" and "12.4 < 12.6" in choice.reason
    with pytest.raises(RuntimeError, match="not available"):
        cuda_graphs.choose_mode("conditional", cuda)
    assert cuda_graphs.choose_mode("no_while", cuda).mode == "no_while"
    monkeypatch.setattr(cuda_graphs, "conditional_support", lambda device: (True, "CUDA driver 13.0"))
    monkeypatch.setenv(cuda_conditional.SWITCH, "1")
    assert cuda_graphs.choose_mode("auto", cuda).mode == "conditional"


class Replayer:
    """A stand-in for a captured graph: replay runs the captured function again."""

    def __init__(self, fn):
        self.fn = fn

    def replay(self) -> None:
        self.fn()


@pytest.mark.parametrize("name", ["tdt", "rnnt"])
def test_no_while_host_loop_equals_frame_looping(monkeypatch, parity_dir, name):
    monkeypatch.setattr(cuda_graphs, "capture_graph", lambda fn, stream: Replayer(fn))
    model = load_model(parity_dir / f"{name}.nemo", device="cpu", dtype="float32")
    t = model.config.transducer
    generator = torch.Generator().manual_seed(0)
    encoded = torch.randn(5, 12, model.config.encoder.d_model, generator=generator)
    lengths = torch.tensor([12, 0, 7, 1, 12])
    looper = LabelLooper(model.decoder, model.joint, t.durations, t.max_symbols)
    enc_proj = looper.project(encoded)
    state = looper.allocate(8, 64, enc_proj.shape[-1], enc_proj.device, enc_proj.dtype)  # spare capacity
    looper.load(state, enc_proj, lengths)
    with torch.inference_mode():
        cuda_graphs._StageGraphs(looper, state, [None]).run()
        reference = frame_looping_greedy(encoded, lengths, model.decoder, model.joint, t.durations, t.max_symbols)
    assert looper.results(state, 5) == reference


def test_nvrtc_compiles_the_condition_kernel_without_a_gpu():
    pytest.importorskip("cuda.bindings.nvrtc")
    ptx = cuda_conditional.compile_condition_kernel()
    assert b".entry batchasr_set_condition" in ptx and b".extern .func cudaGraphSetConditional" in ptx
    assert ptx.endswith(b"\0")  # cuModuleLoadData reads PTX up to its terminator
    cubin = cuda_conditional.compile_condition_kernel("sm_90")
    assert cubin.startswith(b"\x7fELF") and b"batchasr_set_condition" in cubin
    with pytest.raises(CudaPythonError, match="could not compile the condition kernel for sm_1"):
        cuda_conditional.compile_condition_kernel("sm_1")


def test_kernel_loads_as_machine_code_first_and_as_ptx_when_that_fails(monkeypatch):
    """A cubin needs no JIT (a driver older than the NVRTC refuses its PTX); PTX covers a GPU the NVRTC does
    not know. Both failing names both reasons."""
    compiled: list[str | None] = []

    def fake_compile(arch):
        compiled.append(arch)
        return b"\x7fELF" if arch else b".version\0"

    def load_driver(refuse):
        def load(image):
            kind = "cubin" if image.startswith(b"\x7fELF") else "ptx"
            return (SimpleNamespace(value=222), None) if refuse(image) else (0, kind)
        return SimpleNamespace(cuModuleLoadData=load, cuModuleGetFunction=lambda module, name: (0, (module, name)))

    monkeypatch.setattr(cuda_conditional, "compile_condition_kernel", fake_compile)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index: (9, 0))
    monkeypatch.setattr(torch.cuda, "device", lambda index: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "synchronize", lambda index: None)
    monkeypatch.setattr(cuda_conditional, "_KERNELS", {})
    device = torch.device("cuda", 0)

    monkeypatch.setattr(cuda_conditional, "_bindings", lambda: (load_driver(lambda image: False), None, (13, 0)))
    assert cuda_conditional.load_condition_kernel(device) == ("cubin", b"batchasr_set_condition")
    assert compiled == ["sm_90"]
    assert cuda_conditional.load_condition_kernel(device)[0] == "cubin" and compiled == ["sm_90"]  # cached

    cuda_conditional._KERNELS.clear()
    compiled.clear()
    refuse_elf = load_driver(lambda image: image.startswith(b"\x7fELF"))
    monkeypatch.setattr(cuda_conditional, "_bindings", lambda: (refuse_elf, None, (13, 0)))
    assert cuda_conditional.load_condition_kernel(device)[0] == "ptx"
    assert compiled == ["sm_90", None]

    cuda_conditional._KERNELS.clear()
    monkeypatch.setattr(cuda_conditional, "_bindings", lambda: (load_driver(lambda image: True), None, (13, 0)))
    with pytest.raises(CudaPythonError, match=r"does not load: cuModuleLoadData failed.*; cuModuleLoadData failed"):
        cuda_conditional.load_condition_kernel(device)
