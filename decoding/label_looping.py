"""Batched greedy transducer decoding by label looping, for RNN-T and TDT (Bataev et al., arXiv 2406.06220).

Frame looping walks frames and asks the prediction network for every row at every inner step. Label looping
swaps the loops: each outer step finds, for every row, its *next label* (or the end of its utterance), and
the prediction network runs once per outer step at full batch. Inside, rows sitting on blank move their own
frame pointer and only the joint is recomputed. The encoder projection is computed once.

Semantics equal ``frame_looping_greedy`` token for token, frame for frame and duration for duration (it stays
the reference): blank moves on by its duration (at least 1); a label stays on its frame when its duration is
0 (always, for RNN-T) until ``max_symbols`` labels were emitted there, then time moves on by one; a TDT label
is kept even when its duration jumps past the end of the utterance.

The stages below write only through ``out=``, in-place ops and ``torch.where``: no ``.item()``, no boolean
indexing, no allocation that depends on data. That makes them capturable into CUDA graphs
(``decoding.cuda_graphs``); ``LabelLooper.run_eager`` drives the same stages with a host loop.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from .boosting import BoostTable
from .types import Hypothesis, JointNet, PredictionNet

WhileLoop = Callable[[Tensor, Callable[[], None]], None]  # while_loop(flag, body)
BOOST_MIN_NODES = 64  # hotword table capacity at least (nodes, children per node): batches rarely outgrow it
BOOST_MIN_WIDTH = 8


def _power_of_two(n: int, at_least: int) -> int:
    return max(at_least, 1 << max(n - 1, 0).bit_length())


@dataclass
class LabelLoopState:
    """Every tensor the loop touches, preallocated for a capacity of ``B`` rows and ``T`` frames.

    Rows past the current batch get length 0 and stay inactive, so one state serves any smaller batch.
    Names: B = batch capacity, T = frame capacity, J = joint hidden size,
    L = label capacity (T * max_symbols + 1).

    Frame pointers are *positions*: rows of ``enc_proj`` viewed as (B*T, J), i.e. b * T + frame. The joint's
    gather then needs no add, and a row's pointers compare with its own end as frames would.
    """

    # --- inputs, copied in by LabelLooper.load before each run
    enc_proj: Tensor  # (B, T, J) projected encoder output, model dtype
    lengths: Tensor  # (B,) long, valid frames (0 for unused rows)
    # --- constants
    row_start: Tensor  # (B,) long, b * T: the position of each row's first frame
    durations: Tensor  # (D,) long, TDT duration choices; (0,) for RNN-T
    # --- positions
    pos: Tensor  # (B,) long, where each row is in time (may run past its end)
    end: Tensor  # (B,) long, row_start + length: the row is active while pos < end
    last: Tensor  # (B,) long, the row's last frame (its first for an empty row): keeps gathers inside the row
    look: Tensor  # (B,) long, the frame the row's current symbol was chosen on (a found label's timestamp)
    # --- current symbol per row
    labels: Tensor  # (B,) long, argmax label (blank = vocab size)
    new_labels: Tensor  # (B,) long, scratch: inner-loop candidates
    step: Tensor  # (B,) long, scratch: TDT frames the symbol moves on by; a found label's duration at emit
    dur_idx: Tensor  # (B,) long, scratch: argmax over the duration logits (TDT with other durations than 0..D-1)
    # --- masks
    is_blank: Tensor  # (B,) bool, the first joint's labels == blank
    new_blank: Tensor  # (B,) bool, scratch: inner-loop candidates == blank, then: blank and still moving on
    active: Tensor  # (B,) bool, pos < end
    active_prev: Tensor  # (B,) bool, active when the current search started
    advance: Tensor  # (B,) bool, active and on blank: must look at its next frame
    found: Tensor  # (B,) bool, the search ended on a label for this row (kept even if it ran past the end)
    same_frame: Tensor  # (B,) bool, scratch: label on the previous label's frame; then max_symbols reached
    force: Tensor  # (B,) bool, scratch: max_symbols reached, time forced on by one
    # --- loop predicates: 0-dim bool device tensors, read by the host (eager) or by graph conditional nodes
    advance_any: Tensor  # () inner loop: some row still on blank
    found_any: Tensor  # () outer loop: some row found a label
    # --- prediction network
    enc_frame: Tensor  # (B, J) enc_proj at each row's look
    pred_proj: Tensor  # (B, J) projected prediction output for the last emitted label
    pred_state: Any  # prediction-network state for B rows (LSTM: h, c each (layers, B, H))
    init_state: Any  # the prediction network's initial state, the start of every run
    # --- results, written at column n_labels for every row; only found rows move n_labels on
    emitted: Tensor  # (3, B, L) long: the three below in one block, so one copy brings them to the host
    tokens: Tensor  # (B, L) long, a view of emitted[0]
    frames: Tensor  # (B, L) long, emitted[1]: positions (``results`` turns them into frames)
    token_steps: Tensor  # (B, L) long, emitted[2]: each token's duration (TDT)
    n_labels: Tensor  # (B,) long
    # --- max_symbols bookkeeping
    last_frame: Tensor  # (B,) long, position of the last emitted label (-1: none yet)
    n_at_frame: Tensor  # (B,) long, labels emitted at last_frame
    # --- hotwords (decoding.boosting): the batch's table is copied into one of fixed capacity, allocated with the
    # first batch that boosts, so graphs captured with boosting on read it where it stays
    boosting: bool = False  # this run adds the bonus (a Python flag: graphs are captured with it on or off)
    boost: BoostTable | None = None  # capacity: nodes x children, and B roots
    node: Tensor | None = None  # (B,) long, each row's place in its hotwords' tree

    @property
    def batch_capacity(self) -> int:
        return self.enc_proj.shape[0]

    @property
    def frame_capacity(self) -> int:
        return self.enc_proj.shape[1]

    def fits(self, batch: int, n_frames: int, device: torch.device, dtype: torch.dtype) -> bool:
        return (batch <= self.batch_capacity and n_frames <= self.frame_capacity
                and self.enc_proj.device == device and self.enc_proj.dtype == dtype)


def _state_tensors(state: Any) -> list[Tensor]:
    """The tensors inside a prediction-network state (a tensor, a tuple/list or a dataclass of them)."""
    if isinstance(state, Tensor):
        return [state]
    if dataclasses.is_dataclass(state):
        return [t for f in dataclasses.fields(state) for t in _state_tensors(getattr(state, f.name))]
    if isinstance(state, (tuple, list)):
        return [t for item in state for t in _state_tensors(item)]
    raise TypeError(f"unsupported prediction-network state type {type(state).__name__}")


def _copy_state_(dst: Any, src: Any) -> None:
    for d, s in zip(_state_tensors(dst), _state_tensors(src), strict=True):
        d.copy_(s)


def host_while(flag: Tensor, body: Callable[[], None]) -> None:
    """The eager loop: the host reads the 0-dim flag between stages (the only host syncs)."""
    while flag.item():
        body()


@dataclass
class LoopPasses:
    """How often each loop body ran in one decode: what a graph's time follows (each pass is a fixed set of
    kernels). ``outer``: once per label of the longest hypothesis; ``inner``: once per blank step of the row
    slowest to find its next label, summed over labels."""

    outer: int = 0
    inner: int = 0


class LabelLooper:
    """The label-looping stages for one prediction network and joint.

    Program (invariant: at the top of the outer loop every active row waits for its next label at ``pos``)::

        start; search                      # search = first_joint; inner_joint while advance_any; close_search
        while found_any:
            emit; search
    """

    def __init__(self, prediction: PredictionNet, joint: JointNet, durations: tuple[int, ...] = (),
                 max_symbols: int = 10):
        self.prediction = prediction
        self.joint = joint
        self.blank = joint.vocab_size
        self.n_labels = joint.vocab_size + 1  # logits: labels and blank, then TDT durations
        self.duration_choices = tuple(durations)
        self._durations_are_indices = self.duration_choices == tuple(range(len(self.duration_choices)))
        self.max_symbols = max_symbols

    @property
    def is_tdt(self) -> bool:
        return bool(self.duration_choices)

    # --- state ----------------------------------------------------------------------------------------------

    def allocate(self, batch: int, n_frames: int, joint_hidden: int, device: torch.device,
                 dtype: torch.dtype) -> LabelLoopState:
        n_frames = max(n_frames, 1)  # a batch of empty inputs still needs one frame to gather from
        n_cols = n_frames * max(self.max_symbols, 1) + 1  # +1: rows past their last label write somewhere

        def longs(*shape: int) -> Tensor:
            return torch.zeros(shape, dtype=torch.long, device=device)

        def flags(*shape: int) -> Tensor:
            return torch.zeros(shape, dtype=torch.bool, device=device)

        emitted = longs(3, batch, n_cols)

        return LabelLoopState(
            enc_proj=torch.zeros(batch, n_frames, joint_hidden, device=device, dtype=dtype),
            lengths=longs(batch), row_start=torch.arange(batch, device=device) * n_frames,
            durations=torch.tensor(self.duration_choices, dtype=torch.long, device=device),
            pos=longs(batch), end=longs(batch), last=longs(batch), look=longs(batch),
            labels=longs(batch), new_labels=longs(batch), step=longs(batch), dur_idx=longs(batch),
            is_blank=flags(batch), new_blank=flags(batch), active=flags(batch), active_prev=flags(batch),
            advance=flags(batch), found=flags(batch), same_frame=flags(batch), force=flags(batch),
            advance_any=flags(), found_any=flags(),
            enc_frame=torch.zeros(batch, joint_hidden, device=device, dtype=dtype),
            pred_proj=torch.zeros(batch, joint_hidden, device=device, dtype=dtype),
            pred_state=self.prediction.initial_state(batch, device, dtype),
            init_state=self.prediction.initial_state(batch, device, dtype),
            emitted=emitted, tokens=emitted[0], frames=emitted[1], token_steps=emitted[2],
            n_labels=longs(batch), last_frame=longs(batch), n_at_frame=longs(batch),
        )

    def project(self, encoded: Tensor) -> Tensor:
        """(b, t, d) encoder output -> (b, t, J): the encoder half of the joint, once per batch."""
        return self.joint.project_encoder(encoded)

    def reserve_boost(self, s: LabelLoopState, boost: BoostTable) -> bool:
        """Make the state's hotword table large enough for ``boost``; True when it had to be allocated anew
        (graphs that boost must then be captured again). Capacities round up to powers of two."""
        if s.boost is not None and s.boost.fits(boost):
            return False
        nodes, width = boost.shape
        if s.boost is not None:
            nodes, width = max(nodes, s.boost.shape[0]), max(width, s.boost.shape[1])
        s.boost = BoostTable.empty(_power_of_two(nodes, BOOST_MIN_NODES), _power_of_two(width, BOOST_MIN_WIDTH),
                                   s.batch_capacity, s.lengths.device)
        s.node = torch.zeros_like(s.lengths)
        return True

    def load(self, s: LabelLoopState, enc_proj: Tensor, lengths: Tensor, boost: BoostTable | None = None) -> None:
        """Copy a projected batch into the state; rows past it get length 0.

        Args:
            enc_proj: (b, t, J) from ``project``, b and t within the state's capacity.
            lengths: (b,) valid frames.
            boost: the rows' hotwords, or None.
        """
        batch, n_frames, _ = enc_proj.shape
        s.lengths.zero_()
        s.lengths[:batch].copy_(lengths.clamp(max=n_frames))  # frame looping never reads past t either
        s.enc_proj[:batch, :n_frames].copy_(enc_proj)
        s.boosting = boost is not None
        if boost is not None:
            self.reserve_boost(s, boost)
            s.boost.load(boost)

    def results(self, s: LabelLoopState, batch: int) -> list[Hypothesis]:
        """Copy the first ``batch`` rows' hypotheses to the host: the counts, then tokens, frames and (TDT)
        durations together, two device-to-host copies (and waits) where there were four."""
        counts = s.n_labels[:batch].tolist()
        width = max(counts, default=0)
        block = s.emitted[: 3 if self.is_tdt else 2, :batch, :width].clone()
        block[1].sub_(s.row_start[:batch].unsqueeze(1))  # positions -> frames
        tokens, frames, *steps = block.tolist()
        return [Hypothesis(tokens=tokens[b][:n], frames=frames[b][:n],
                           durations=steps[0][b][:n] if steps else None)
                for b, n in enumerate(counts)]

    # --- stages (capturable: no host sync, writes only into the state) --------------------------------------

    def start(self, s: LabelLoopState) -> None:
        """Reset the loop and run the prediction network once on the start symbol (blank)."""
        s.n_labels.zero_()
        s.last_frame.fill_(-1)
        s.n_at_frame.zero_()
        s.pos.copy_(s.row_start)
        torch.add(s.row_start, s.lengths, out=s.end)
        torch.sub(s.end, 1, out=s.last)
        torch.maximum(s.last, s.row_start, out=s.last)
        s.labels.fill_(self.blank)
        if s.boosting:
            s.node.copy_(s.boost.roots)
        out, state = self.prediction.step(s.labels, s.init_state)
        _copy_state_(s.pred_state, state)
        s.pred_proj.copy_(self.joint.project_prediction(out))

    def first_joint(self, s: LabelLoopState) -> None:
        """The joint for every row at its current frame; every row moves by its symbol's step.

        Inactive rows move too: they are finished for good, and their positions stay past their ends.
        """
        torch.lt(s.pos, s.end, out=s.active_prev)
        torch.minimum(s.pos, s.last, out=s.look)
        step = self._choose(s, self._joint(s), s.labels, s.is_blank)
        s.pos.add_(step)
        self._update_masks(s, s.is_blank)

    def inner_joint(self, s: LabelLoopState) -> None:
        """Rows still on blank look at their next frame; only the joint runs, the prediction is unchanged.

        Every row's symbol is chosen once: rows that are not moving keep theirs (no argmax is taken again,
        which a different GEMM algorithm in another graph could round differently).
        """
        torch.where(s.advance, s.pos, s.look, out=s.look)  # a moving row is active, so pos is inside it
        step = self._choose(s, self._joint(s), s.new_labels, s.new_blank)
        # same as: labels[advance] = new_labels[advance], but no host sync
        torch.where(s.advance, s.new_labels, s.labels, out=s.labels)
        if self.is_tdt:
            step.mul_(s.advance)
        s.new_blank.logical_and_(s.advance)  # RNN-T: also the step of every row
        s.pos.add_(step if self.is_tdt else s.new_blank)
        self._update_masks(s, s.new_blank)

    def close_search(self, s: LabelLoopState) -> None:
        """A row found a label if it was active when the search began and did not end on blank.

        NOTE: not ``active``: a TDT label whose duration jumps past the end is still a label. A row that
        found nothing ran off its end: it is finished for good (its position only grows), so later stages may
        update it unmasked.
        """
        torch.ne(s.labels, self.blank, out=s.found)
        s.found.logical_and_(s.active_prev)
        torch.any(s.found, out=s.found_any)

    def emit(self, s: LabelLoopState) -> None:
        """Store the found labels, step the prediction network on them (full batch), apply max_symbols."""
        # same as: tokens[found, n_labels[found]] = labels[found]; other rows write a column that is
        # overwritten later or lies past their count
        column = s.n_labels.unsqueeze(1)  # (B, 1)
        s.tokens.scatter_(1, column, s.labels.unsqueeze(1))
        s.frames.scatter_(1, column, s.look.unsqueeze(1))
        if self.is_tdt:  # a found label's row has not moved since: it moved by the label's duration
            torch.sub(s.pos, s.look, out=s.step)
            s.token_steps.scatter_(1, column, s.step.unsqueeze(1))
        s.n_labels.add_(s.found)
        if s.boosting:  # rows that found nothing are finished: their node no longer matters
            s.node.copy_(s.boost.advance(s.node, s.labels))
        self._count_at_frame(s)
        self._predict(s)
        self._force_after_max_symbols(s)

    # --- the program -----------------------------------------------------------------------------------------

    def run(self, s: LabelLoopState, while_loop: WhileLoop) -> None:
        """The whole decode; ``while_loop(flag, body)`` runs ``body`` while the 0-dim ``flag`` holds.

        The loops are delegated so one program serves the eager host loop (``run_eager``) and a graph with
        conditional WHILE nodes (``decoding.cuda_graphs``).
        """

        def search() -> None:
            self.first_joint(s)
            while_loop(s.advance_any, lambda: self.inner_joint(s))  # rows on blank move to their next frame
            self.close_search(s)

        def next_label() -> None:
            self.emit(s)
            search()

        self.start(s)
        search()
        while_loop(s.found_any, next_label)  # one label per row and pass

    def run_eager(self, s: LabelLoopState, passes: LoopPasses | None = None) -> None:
        """``run`` with host loops; ``passes``, when given, counts each loop's passes."""
        if passes is None:
            self.run(s, host_while)
            return

        def counting_while(flag: Tensor, body: Callable[[], None]) -> None:
            while flag.item():
                if flag is s.advance_any:
                    passes.inner += 1
                else:
                    passes.outer += 1
                body()

        self.run(s, counting_while)

    # --- helpers ----------------------------------------------------------------------------------------

    def _joint(self, s: LabelLoopState) -> Tensor:
        """(B, V+1+D) joint logits at each row's ``look``."""
        torch.index_select(s.enc_proj.view(-1, s.enc_proj.shape[-1]), 0, s.look, out=s.enc_frame)
        logits = self.joint.joint_after_projection(s.enc_frame, s.pred_proj)
        if s.boosting:
            logits[:, : self.n_labels] += s.boost.bonus(s.node, self.n_labels)
        return logits

    def _choose(self, s: LabelLoopState, logits: Tensor, labels: Tensor, is_blank: Tensor) -> Tensor:
        """Greedy label into ``labels`` and ``is_blank`` (B,) from (B, V+1+D) logits; returns each row's step:
        ``is_blank`` itself for RNN-T (a blank moves one frame, a label none), ``s.step`` for TDT."""
        torch.argmax(logits[:, : self.n_labels], dim=-1, out=labels)
        torch.eq(labels, self.blank, out=is_blank)
        if not self.is_tdt:
            return is_blank
        if self._durations_are_indices:  # Parakeet's 0, 1, 2, ...: the argmax is the duration
            torch.argmax(logits[:, self.n_labels :], dim=-1, out=s.step)
        else:
            torch.argmax(logits[:, self.n_labels :], dim=-1, out=s.dur_idx)
            torch.index_select(s.durations, 0, s.dur_idx, out=s.step)
        # a blank always moves on: same as step[is_blank & (step == 0)] = 1 (durations are never negative)
        torch.maximum(s.step, is_blank, out=s.step)
        return s.step

    def _update_masks(self, s: LabelLoopState, is_blank: Tensor) -> None:
        torch.lt(s.pos, s.end, out=s.active)
        torch.logical_and(s.active, is_blank, out=s.advance)
        torch.any(s.advance, out=s.advance_any)

    # Below, rows that found no label are finished (see close_search): updating them too needs no mask.

    def _count_at_frame(self, s: LabelLoopState) -> None:
        # n_at_frame = n_at_frame + 1 if the label's frame repeats the last label's, else 1
        torch.eq(s.look, s.last_frame, out=s.same_frame)
        s.n_at_frame.mul_(s.same_frame).add_(1)
        s.last_frame.copy_(s.look)

    def _predict(self, s: LabelLoopState) -> None:
        out, new_state = self.prediction.step(s.labels, s.pred_state)  # (B, H), full batch
        _copy_state_(s.pred_state, new_state)
        s.pred_proj.copy_(self.joint.project_prediction(out))

    def _force_after_max_symbols(self, s: LabelLoopState) -> None:
        # a label that leaves its row on its frame for the max_symbols-th time acts as a blank there
        torch.ge(s.n_at_frame, self.max_symbols, out=s.force)
        if self.is_tdt:  # an RNN-T label always stays on its frame; a TDT label only when its duration is 0
            torch.eq(s.pos, s.look, out=s.same_frame)  # same_frame reused as scratch
            s.force.logical_and_(s.same_frame)
        s.pos.add_(s.force)


@torch.inference_mode()
def label_looping_greedy(
    encoded: Tensor,
    lengths: Tensor,
    prediction: PredictionNet,
    joint: JointNet,
    durations: tuple[int, ...] = (),
    max_symbols: int = 10,
    boost: BoostTable | None = None,
    passes: LoopPasses | None = None,
) -> list[Hypothesis]:
    """Eager label looping with a state sized for this batch (same arguments as ``frame_looping_greedy``).

    Args:
        encoded: (B, T, d) encoder output.
        lengths: (B,) valid encoder frames.
        durations: TDT duration choices (empty for RNN-T).
        passes: when given, counts each loop's passes (``LabelLooper.run_eager``).
    """
    looper = LabelLooper(prediction, joint, durations, max_symbols)
    enc_proj = looper.project(encoded)  # (B, T, J)
    batch, n_frames, joint_hidden = enc_proj.shape
    state = looper.allocate(batch, n_frames, joint_hidden, enc_proj.device, enc_proj.dtype)
    looper.load(state, enc_proj, lengths, boost)
    looper.run_eager(state, passes)
    return looper.results(state, batch)
