"""CTC's boosted rows: the frame loop of ``decoding.ctc`` on preallocated buffers, in CUDA graphs on a GPU.

A CTC row with hotwords is decoded frame by frame: a frame's label depends on the row's emissions before it
(``decoding.ctc.ctc_greedy``). Each step reads the hotword table spread over the vocabulary
(``BoostTable.spread``), about a dozen kernels; on a GPU their launches, not their work, are the loop's time. So
there a graph of FRAMES_PER_REPLAY steps is captured once and replayed until the longest boosted row is done:
one launch per 16 frames. The buffers and the graph are kept, and grown (captured again) only when a batch has
more boosted rows, frames or hotword nodes than they hold. Eager (CPU, ``cuda_graphs="off"``) runs the same step
on buffers of the batch's own size, so the two compare exactly.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from .boosting import NULL_NODE, SpreadBoost
from .cuda_graphs import WARMUP_PASSES, capture_graph, choose_mode, on_device

log = logging.getLogger(__name__)

FRAMES_PER_REPLAY = 16  # frame steps in one graph; a batch replays it until its longest boosted row is done
FRAME_QUANTUM = 64  # frame capacity rounds up to this (a multiple of FRAMES_PER_REPLAY): growth recaptures rarely


@dataclass
class CtcBoostState:
    """The frame loop's tensors. R rows, T frames, N hotword nodes, C classes; past a batch, rows and frames are
    masked (``past_end``) and rows sit on NULL_NODE, so they take blank and move nowhere."""

    log_probs: Tensor  # (R, T, C) float32: the boosted rows' frames
    past_end: Tensor  # (R, T) bool: frames past each row's length
    bonus_of: Tensor  # (N, C) float: each node's bonus on every token (SpreadBoost)
    next_of: Tensor  # (N, C) long: the node each token leads to
    node: Tensor  # (R,) long: where each row's emissions leave it in its phrases
    previous: Tensor  # (R,) long: the previous frame's label
    labels: Tensor  # (R, T) long: each frame's label
    t: Tensor  # (1,) long: the frame the next step takes

    @classmethod
    def allocate(cls, rows: int, frames: int, nodes: int, classes: int, device: torch.device) -> CtcBoostState:
        longs = dict(dtype=torch.long, device=device)
        return cls(log_probs=torch.zeros(rows, frames, classes, device=device),
                   past_end=torch.ones(rows, frames, dtype=torch.bool, device=device),
                   bonus_of=torch.zeros(nodes, classes, device=device),
                   next_of=torch.zeros(nodes, classes, **longs), node=torch.zeros(rows, **longs),
                   previous=torch.zeros(rows, **longs), labels=torch.zeros(rows, frames, **longs),
                   t=torch.zeros(1, **longs))

    @classmethod
    def of_batch(cls, log_probs: Tensor, past_end: Tensor, roots: Tensor, spread: SpreadBoost,
                 blank_id: int) -> CtcBoostState:
        """A state of the batch's own size over its tensors (copied only to float32): what the eager loop runs on."""
        rows, frames, _ = log_probs.shape
        return cls(log_probs=log_probs.float(), past_end=past_end, bonus_of=spread.bonus_of,
                   next_of=spread.next_of, node=roots.clone(),
                   previous=torch.full_like(roots, blank_id),
                   labels=torch.empty(rows, frames, dtype=torch.long, device=log_probs.device),
                   t=torch.zeros(1, dtype=torch.long, device=log_probs.device))

    @property
    def shape(self) -> tuple[int, int, int, int]:
        """(rows, frames, nodes, classes) it holds."""
        rows, frames, classes = self.log_probs.shape
        return rows, frames, self.bonus_of.shape[0], classes

    def fits(self, rows: int, frames: int, nodes: int, classes: int, device: torch.device) -> bool:
        held = self.shape
        return (self.log_probs.device == device and classes == held[3]
                and rows <= held[0] and frames <= held[1] and nodes <= held[2])

    def load(self, log_probs: Tensor, past_end: Tensor, roots: Tensor, spread: SpreadBoost, blank_id: int) -> None:
        """The boosted rows' (R', T', C) log-probabilities, (R', T') frames past their ends, (R',) roots, and their
        table."""
        rows, frames, _ = log_probs.shape
        nodes = spread.bonus_of.shape[0]
        self.log_probs[:rows, :frames].copy_(log_probs)
        self.past_end.fill_(True)
        self.past_end[:rows, :frames].copy_(past_end)
        self.bonus_of[:nodes].copy_(spread.bonus_of)
        self.next_of[:nodes].copy_(spread.next_of)
        self.node.fill_(NULL_NODE)
        self.node[:rows].copy_(roots)
        self.previous.fill_(blank_id)
        self.t.zero_()


def frame_step(s: CtcBoostState, blank_id: int, t: int | None = None) -> None:
    """Every row's label at frame ``t``; with None, at frame ``s.t``, then ``s.t`` + 1: what a graph replays (no
    host read, only in-place writes to the state). The eager loop names the frame, and saves three kernels.

    The label is the argmax of the frame's log-probabilities plus the bonus of the tokens that continue a phrase
    from the row's node, the previous frame's label excepted (taking it again continues its run, not emits);
    only an emission (neither blank nor the previous label) moves the row on.
    """
    if t is None:
        frame, past_end = (x.index_select(1, s.t).squeeze(1) for x in (s.log_probs, s.past_end))
    else:
        frame, past_end = s.log_probs[:, t], s.past_end[:, t]
    bonus = s.bonus_of.index_select(0, s.node).scatter_(1, s.previous.unsqueeze(1), 0.0)
    label = (frame + bonus).argmax(dim=-1).masked_fill_(past_end, blank_id)
    emitted = (label != blank_id) & (label != s.previous)
    torch.where(emitted, s.next_of[s.node, label], s.node, out=s.node)
    s.previous.copy_(label)
    if t is None:
        s.labels.index_copy_(1, s.t, label.unsqueeze(1))
        s.t.add_(1)
    else:
        s.labels[:, t] = label


class CtcBoostLoop:
    """The boosted rows' frame loop for one CTC head, keeping its buffers and (on CUDA) its graph.

    ``cuda_graphs``: "off" runs eagerly; any other setting replays plain CUDA graphs on a GPU (the loop needs no
    conditional node: its length is known before it starts). Calls are serialised by a lock: the buffers are
    shared, and a model may be used from the engine thread and from user code at once.
    """

    def __init__(self, blank_id: int, cuda_graphs: str = "auto"):
        self.blank_id = blank_id
        self.requested = cuda_graphs
        self.n_captures = 0
        self._state: CtcBoostState | None = None
        self._graph: torch.cuda.CUDAGraph | None = None
        self._stream: torch.cuda.Stream | None = None  # taken once (see LabelLoopingDecoder._streams)
        self._lock = threading.Lock()

    @torch.inference_mode()
    def __call__(self, log_probs: Tensor, past_end: Tensor, roots: Tensor, spread: SpreadBoost) -> Tensor:
        """(R, T, C) boosted rows' log-probabilities, (R, T) frames past their ends, (R,) roots -> (R, T) frame
        labels."""
        with self._lock, on_device(log_probs.device):
            if self._graphs_on(log_probs.device):
                return self._replay(log_probs, past_end, roots, spread)
            state = CtcBoostState.of_batch(log_probs, past_end, roots, spread, self.blank_id)
            for t in range(log_probs.shape[1]):
                frame_step(state, self.blank_id, t)
            return state.labels

    def mode(self, device: torch.device) -> str:
        """The graph mode it runs in on ``device``: a plain graph ("no_while") for every mode but eager
        ("conditional" needs no support here: the frames are a fixed count)."""
        requested = "no_while" if self.requested == "conditional" else self.requested
        return choose_mode(requested, device).mode

    def _graphs_on(self, device: torch.device) -> bool:
        return self.mode(device) != "eager"

    def _replay(self, log_probs: Tensor, past_end: Tensor, roots: Tensor, spread: SpreadBoost) -> Tensor:
        rows, frames, classes = log_probs.shape
        nodes = spread.bonus_of.shape[0]
        state = self._state
        if state is None or not state.fits(rows, frames, nodes, classes, log_probs.device):
            state = self._grow(rows, frames, nodes, classes, log_probs.device)
        if self._graph is None:
            self._graph = self._capture(state)
            self.n_captures += 1
        state.load(log_probs, past_end, roots, spread, self.blank_id)
        for _ in range(-(-frames // FRAMES_PER_REPLAY)):
            self._graph.replay()
        return state.labels[:rows, :frames]

    def _grow(self, rows: int, frames: int, nodes: int, classes: int, device: torch.device) -> CtcBoostState:
        """Buffers at least as large as before in every dimension (frames to FRAME_QUANTUM, nodes to a power of
        two); the graph is captured again for them."""
        old = self._state.shape if self._state is not None and self._state.log_probs.device == device else (0,) * 4
        rows = max(rows, old[0])
        frames = -(-max(frames, old[1], 1) // FRAME_QUANTUM) * FRAME_QUANTUM
        nodes = 1 << (max(nodes, old[2], 2) - 1).bit_length()
        self._state, self._graph = None, None  # release the old buffers and graph first
        self._state = CtcBoostState.allocate(rows, frames, nodes, classes, device)
        return self._state

    def _steps(self, state: CtcBoostState) -> Callable[[], None]:
        """What one replay runs: FRAMES_PER_REPLAY frame steps."""

        def steps() -> None:
            for _ in range(FRAMES_PER_REPLAY):
                frame_step(state, self.blank_id)

        return steps

    def _capture(self, state: CtcBoostState) -> torch.cuda.CUDAGraph:
        """A graph of ``_steps``, after eager steps on its stream (library set-up, allocator cache)."""
        device = state.t.device
        if self._stream is None or self._stream.device != device:
            self._stream = torch.cuda.Stream(device)
        stream = self._stream
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            for _ in range(WARMUP_PASSES):
                state.t.zero_()
                frame_step(state, self.blank_id)
        torch.cuda.current_stream(device).wait_stream(stream)
        rows, frames, nodes, _ = state.shape
        log.debug("ctc hotwords: capturing %d frame steps for %d rows x %d frames, %d nodes", FRAMES_PER_REPLAY,
                  rows, frames, nodes)
        return capture_graph(self._steps(state), stream)
