"""Label looping run three ways, chosen automatically and overridable (NeMo's CUDA graph modes).

- ``conditional``: the whole decode is one CUDA graph; both loops are conditional WHILE nodes
  (``decoding.cuda_conditional``), so a batch is decoded with a single graph launch and no host sync. Forced, or
  opted in for "auto" (``BATCHASR_CONDITIONAL_NODES=1``): its capture has crashed a process on a GPU.
- ``no_while``: each loop body is a plain CUDA graph; the host runs the loops, reading the 0-dim loop flags.
- ``eager``: the same stages without capture (CPU, debugging, or ``cuda_graphs="off"``).

All three run the stages of ``decoding.label_looping.LabelLooper`` on one preallocated ``LabelLoopState``;
graphs are captured once and recaptured only when a batch is larger (rows or frames) than the buffers. Batches
with hotwords run a second set, captured with the boosting stages when the first such batch comes and again
only when a batch's hotword table outgrows the state's.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from .boosting import BoostTable
from .cuda_conditional import (
    SWITCH,
    ConditionalGraphBuilder,
    CudaPythonError,
    conditional_opted_in,
    conditional_support,
    load_condition_kernel,
)
from .label_looping import LabelLooper, LabelLoopState
from .types import Hypothesis, JointNet, PredictionNet

log = logging.getLogger(__name__)

CUDA_GRAPH_OPTIONS = ("auto", "conditional", "no_while", "off")
WARMUP_PASSES = 3  # eager passes over every stage before capture: cuBLAS/cuDNN handles, allocator cache
FRAME_QUANTUM = 64  # frame capacity is rounded up to this (64 frames = 5.1 s): growing inputs recapture rarely
N_STREAMS = 3  # the capture stream, then one body stream per loop nesting level (conditional mode)


@dataclass(frozen=True)
class ModeChoice:
    mode: str  # "conditional" | "no_while" | "eager"
    reason: str  # for the log line


def choose_mode(requested: str, device: torch.device) -> ModeChoice:
    """Resolve ``cuda_graphs`` ("auto" | "conditional" | "no_while" | "off") for ``device``.

    "auto" takes plain graphs on CUDA, conditional nodes only where opted in (``cuda_conditional.SWITCH``); a forced
    graph mode that cannot run raises instead of falling back.
    """
    if requested not in CUDA_GRAPH_OPTIONS:
        raise ValueError(f"unknown cuda_graphs {requested!r}; choose from {', '.join(CUDA_GRAPH_OPTIONS)}")
    if requested == "off":
        return ModeChoice("eager", "cuda_graphs='off'")
    if device.type != "cuda":
        if requested == "auto":
            return ModeChoice("eager", f"CUDA graphs need a CUDA device, this is {device.type}")
        raise ValueError(f"cuda_graphs={requested!r} needs a CUDA device, got {device}")
    if requested == "no_while":
        return ModeChoice("no_while", "cuda_graphs='no_while'")
    supported, why = conditional_support(device)
    if requested == "conditional":
        if not supported:
            raise RuntimeError(f"cuda_graphs='conditional' is not available: {why}")
        return ModeChoice("conditional", why)
    if not supported:
        return ModeChoice("no_while", f"conditional nodes unavailable: {why}")
    if not conditional_opted_in():
        return ModeChoice("no_while", f"conditional nodes are opt-in ({SWITCH}=1; {why})")
    return ModeChoice("conditional", why)


class _StageGraphs:
    """``no_while``: one plain graph per loop body; the host runs the loops on the 0-dim flags."""

    def __init__(self, looper: LabelLooper, s: LabelLoopState, streams: list[torch.cuda.Stream]):
        def begin() -> None:
            looper.start(s)
            looper.first_joint(s)

        def next_label() -> None:
            looper.emit(s)
            looper.first_joint(s)

        self.s = s
        self.begin = capture_graph(begin, streams[0])
        self.inner = capture_graph(lambda: looper.inner_joint(s), streams[0])
        self.close = capture_graph(lambda: looper.close_search(s), streams[0])
        self.next = capture_graph(next_label, streams[0])

    def run(self) -> None:
        self.begin.replay()
        while True:
            while self.s.advance_any.item():  # one device-to-host sync per loop test
                self.inner.replay()
            self.close.replay()
            if not self.s.found_any.item():
                return
            self.next.replay()


class _FullGraph:
    """``conditional``: the whole decode in one graph, both loops as conditional WHILE nodes."""

    def __init__(self, looper: LabelLooper, s: LabelLoopState, streams: list[torch.cuda.Stream]):
        device = s.enc_proj.device
        load_condition_kernel(device)  # module loading is not allowed during capture
        # NOTE: loop bodies are captured on their own streams, outside PyTorch's capture, so their temporaries
        # (joint logits, LSTM outputs) would come from the general pool and could be handed to other tensors
        # while replays still write there (PyTorch #114320). Route this thread's allocations to a pool that
        # lives as long as the graph.
        self.pool, route = _private_pool(device)
        self.graph = torch.cuda.CUDAGraph()
        with route, _capturing(self.graph, streams[0]):
            self.builder = ConditionalGraphBuilder(device, streams[1:])  # keeps the condition arguments alive
            looper.run(s, self.builder.while_loop)  # the eager program, its loops as WHILE nodes

    def run(self) -> None:
        self.graph.replay()


def capture_graph(fn: Callable[[], Any], stream: torch.cuda.Stream) -> torch.cuda.CUDAGraph:
    """A plain CUDA graph of what ``fn`` launches, captured on ``stream`` (warmed up there first)."""
    graph = torch.cuda.CUDAGraph()
    with _capturing(graph, stream):
        fn()
    return graph


@contextlib.contextmanager
def _capturing(graph: torch.cuda.CUDAGraph, stream: torch.cuda.Stream) -> Iterator[None]:
    """``torch.cuda.graph`` on ``stream``, leaving the thread as it found it should the capture fail (and the caller
    fall back to another mode): torch ends the capture before it gives the thread its stream back, so a capture
    whose end raised left the thread on the capture stream, and some torch versions the allocator routing its
    allocations to the graph's pool."""
    previous = torch.cuda.current_stream(stream.device)
    try:
        with torch.cuda.graph(graph, stream=stream, capture_error_mode="thread_local"):
            yield
    except BaseException:
        with contextlib.suppress(Exception):  # raises where the pool was let go already (as torch's newer ones do)
            torch._C._cuda_endAllocateToPool(stream.device.index, graph.pool())
        raise
    finally:
        torch.cuda.set_stream(previous)


def on_device(device: torch.device) -> contextlib.AbstractContextManager:
    """``device`` as the thread's current CUDA device while decoding on it: graph capture, the driver's calls and
    the allocator's pools take the current one, which for a model on ``cuda:1`` need not be its own."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def _private_pool(device: torch.device) -> tuple[Any, contextlib.AbstractContextManager]:
    if not hasattr(torch.cuda, "use_mem_pool"):  # torch < 2.6
        log.warning("torch %s has no torch.cuda.use_mem_pool: conditional-node bodies allocate from the "
                    "general pool", torch.__version__)
        return None, contextlib.nullcontext()
    pool = torch.cuda.MemPool()
    return pool, torch.cuda.use_mem_pool(pool, device)


def _warm_up(looper: LabelLooper, s: LabelLoopState, streams: list[torch.cuda.Stream]) -> None:
    """Run every stage eagerly on each capture stream first: lazy library init (cuBLAS workspaces are per
    stream), allocator cache. Every row decodes one zero frame."""
    current = torch.cuda.current_stream(s.enc_proj.device)
    s.lengths.fill_(1)
    for stream in streams:
        stream.wait_stream(current)
        with torch.cuda.stream(stream):
            for _ in range(WARMUP_PASSES):
                for stage in (looper.start, looper.first_joint, looper.inner_joint, looper.close_search,
                              looper.emit):
                    stage(s)
        current.wait_stream(stream)
    s.lengths.zero_()


class LabelLoopingDecoder:
    """Label-looping greedy decoding for one prediction network and joint, keeping buffers and graphs.

    Create one per model (two models on a device each own their buffers and graphs). Calls are serialised
    by a lock: the buffers are shared, and a model may be used from the engine thread and from user code at
    once. ``mode`` is known after the first call (it depends on the device).
    """

    def __init__(self, prediction: PredictionNet, joint: JointNet, durations: tuple[int, ...] = (),
                 max_symbols: int = 10, cuda_graphs: str = "auto"):
        if cuda_graphs not in CUDA_GRAPH_OPTIONS:
            raise ValueError(f"unknown cuda_graphs {cuda_graphs!r}; choose from {', '.join(CUDA_GRAPH_OPTIONS)}")
        self.looper = LabelLooper(prediction, joint, durations, max_symbols)
        self.requested = cuda_graphs
        self.mode: str | None = None
        self.n_captures = 0  # graph (re)captures so far
        self._device: torch.device | None = None
        self._state: LabelLoopState | None = None
        self._graphs: dict[bool, _StageGraphs | _FullGraph] = {}  # by whether they boost hotwords
        # taken once: PyTorch hands out streams round-robin from a pool of 32 a device, so taking new ones at each
        # capture would in time give one that other work (a batch's upload) is using while this captures
        self._streams: list[torch.cuda.Stream] = []
        self._lock = threading.Lock()

    @property
    def capacity(self) -> tuple[int, int]:
        """(rows, frames) the buffers (and graphs) cover; (0, 0) before the first call."""
        if self._state is None:
            return (0, 0)
        return (self._state.batch_capacity, self._state.frame_capacity)

    @torch.inference_mode()
    def __call__(self, encoded: Tensor, lengths: Tensor, boost: BoostTable | None = None) -> list[Hypothesis]:
        """(B, T, d) encoder output and (B,) lengths -> one hypothesis per row; ``boost``: the rows' hotwords."""
        with self._lock, on_device(encoded.device):
            return self._decode(encoded, lengths, boost)

    def _decode(self, encoded: Tensor, lengths: Tensor, boost: BoostTable | None) -> list[Hypothesis]:
        enc_proj = self.looper.project(encoded)  # (B, T, J), once per batch
        batch, n_frames, hidden = enc_proj.shape
        self._choose_mode(enc_proj.device)
        state = self._state
        if state is None or not state.fits(batch, n_frames, enc_proj.device, enc_proj.dtype):
            state = self._grow(batch, n_frames, hidden, enc_proj.device, enc_proj.dtype)
        boosting = boost is not None
        if boosting and self.looper.reserve_boost(state, boost):
            self._graphs.pop(True, None)  # they read the table that was just replaced
        if self.mode != "eager" and boosting not in self._graphs:
            graphs = self._capture(state, boosting)  # before load: warm-up overwrites the state
            if graphs is not None:  # None: no graph could be captured, and "auto" runs eagerly from now on
                self._graphs[boosting] = graphs
                self.n_captures += 1
        self.looper.load(state, enc_proj, lengths, boost)
        if self.mode == "eager":
            self.looper.run_eager(state)
        else:
            self._graphs[boosting].run()
        return self.looper.results(state, batch)

    def _choose_mode(self, device: torch.device) -> None:
        if self.mode is not None and device == self._device:
            return
        choice = choose_mode(self.requested, device)
        log.info("label looping on %s: %s mode (%s)", device, choice.mode, choice.reason)
        self.mode, self._device = choice.mode, device
        self._state, self._graphs, self._streams = None, {}, []

    def _grow(self, batch: int, n_frames: int, hidden: int, device: torch.device,
              dtype: torch.dtype) -> LabelLoopState:
        """New buffers at least as large as before (the old graphs are dropped; each set is captured again when a
        batch needs it): rows keep their running maximum, frames round up to FRAME_QUANTUM. Eager mode sizes its
        buffers the same way, so its arithmetic (matrix shapes) is the graphs' and results compare exactly."""
        old = self._state
        keep = old is not None and old.enc_proj.device == device and old.enc_proj.dtype == dtype
        rows = max(batch, old.batch_capacity if keep and old is not None else 0)
        frames = max(n_frames, old.frame_capacity if keep and old is not None else 0, 1)
        frames = -(-frames // FRAME_QUANTUM) * FRAME_QUANTUM
        self._state, self._graphs = None, {}  # release the old buffers and graphs first
        self._state = self.looper.allocate(rows, frames, hidden, device, dtype)
        return self._state

    def _capture(self, state: LabelLoopState, boosting: bool) -> _StageGraphs | _FullGraph | None:
        """Graphs of the search on ``state``, with the boosting stages or without (the flag is read in Python
        while capturing, so each setting is a graph of its own). Under "auto" a capture that fails falls back a
        mode (conditional -> no_while -> eager: None) with a warning that says why; a forced mode raises."""
        device = state.enc_proj.device
        if not self._streams:
            self._streams = [torch.cuda.Stream(device) for _ in range(N_STREAMS)]
        streams = self._streams
        state.boosting = boosting
        _warm_up(self.looper, state, streams)
        log.debug("label looping: capturing %s graphs for %d rows x %d frames%s", self.mode,
                  state.batch_capacity, state.frame_capacity, ", with hotwords" if boosting else "")
        if self.mode == "conditional":
            try:
                return _FullGraph(self.looper, state, streams)
            except (CudaPythonError, RuntimeError) as exc:
                self._fall_back("no_while", "conditional-node", exc, device)
        try:
            return _StageGraphs(self.looper, state, streams)
        except RuntimeError as exc:  # an op of this torch (or cuDNN) that cannot be captured: serve uncaptured
            self._fall_back("eager", "plain CUDA graph", exc, device)
            return None

    def _fall_back(self, mode: str, what: str, exc: Exception, device: torch.device) -> None:
        if self.requested != "auto":
            raise exc
        log.warning("%s capture failed (%s: %s); label looping falls back to %s mode", what, type(exc).__name__, exc,
                    mode)
        self.mode = mode
        self._graphs.clear()  # one mode for both settings
        torch.cuda.synchronize(device)
