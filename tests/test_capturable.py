"""What a CUDA graph needs of the label-looping stages, checked on a CPU: no operation that waits for the
device's answer (``.item()``, data-dependent shapes, boolean indexing), and no state field rebound to a new
tensor (a captured graph would go on reading and writing the old one). The loop tests themselves are the
only host reads, and a conditional node makes them on the device."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

from decoding.boosting import build_boost_table
from decoding.ctc_boost import CtcBoostState, frame_step
from decoding.frame_looping import frame_looping_greedy
from decoding.label_looping import LabelLooper, LabelLoopState
from decoding.types import Hotword
from tests.test_label_looping import random_batch, tiny_transducer

aten = torch.ops.aten
CPU = torch.device("cpu")

# operations whose result the host must see (or whose output shape depends on data): each would synchronise
# the stream, and fails inside a capture
SYNCHRONISING = {
    aten._local_scalar_dense.default,  # .item(), .tolist(), Python `if tensor`
    aten.is_nonzero.default,
    aten.equal.default,
    aten.nonzero.default,
    aten.nonzero_static.default,
    aten.masked_select.default,
    aten._unique2.default,
    aten.unique_consecutive.default,
    aten.unique_dim.default,
    aten.repeat_interleave.Tensor,
    aten.repeat_interleave.self_Tensor,
}


class HostSyncRecorder(TorchDispatchMode):
    """Records the operations that would synchronise with the host, and indexing by boolean masks."""

    def __init__(self) -> None:
        super().__init__()
        self.found: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in SYNCHRONISING:
            self.found.append(str(func))
        elif func.overloadpacket in (aten.index, aten.index_put, aten.index_put_) and _bool_index(args):
            self.found.append(f"{func} with a boolean mask")
        return func(*args, **kwargs)


def _bool_index(args: tuple) -> bool:
    indices = args[1] if len(args) > 1 else ()
    return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in indices or ())


def _fields(s: LabelLoopState) -> dict[str, object]:
    return {f.name: getattr(s, f.name) for f in dataclasses.fields(s)}


@pytest.mark.parametrize("hotwords", [False, True], ids=["plain", "hotwords"])
@pytest.mark.parametrize(("seed", "durations"), [(1, ()), (0, (0, 1, 2, 3, 4))], ids=["rnnt", "tdt"])
def test_the_loop_stages_never_wait_for_the_device_and_keep_their_tensors(seed, durations, hotwords):
    # a model whose search runs both loops and reaches max_symbols; rows of speech, an empty one, a one-frame one
    model = tiny_transducer(seed, durations=durations, max_symbols=2)
    encoded, lengths = random_batch(2, [30, 0, 17, 1, 30], 30)
    phrases = (Hotword((1, 2)), Hotword((3,), 3.0), Hotword((2, 4, 1)))
    boost = build_boost_table([phrases, (), phrases[1:], phrases, ()], 2.0, CPU) if hotwords else None
    looper = LabelLooper(model.prediction, model.joint, model.durations, model.max_symbols)
    recorder = HostSyncRecorder()
    passes = {"inner": 0, "outer": 0}

    def device_while(flag: torch.Tensor, body) -> None:
        """A conditional WHILE node's behaviour: the test reads the flag outside the recorded stages."""
        loop = "inner" if flag is state.advance_any else "outer"
        while True:
            with _disable_current_modes():
                if not flag.item():
                    return
            passes[loop] += 1
            body()

    with torch.inference_mode():
        enc_proj = looper.project(encoded)
        state = looper.allocate(8, 64, enc_proj.shape[-1], enc_proj.device, enc_proj.dtype)  # spare capacity
        looper.load(state, enc_proj, lengths, boost)
        before = _fields(state)
        with recorder:
            looper.run(state, device_while)
        hypotheses = looper.results(state, 5)

    assert recorder.found == []
    assert [name for name, value in _fields(state).items() if value is not before[name]] == []
    assert passes["inner"] > 0 and passes["outer"] > 0, passes  # both loop bodies ran, and were recorded
    assert any(h.frames[i] == h.frames[i - 1] for h in hypotheses for i in range(1, len(h.frames)))
    assert hypotheses == frame_looping_greedy(encoded, lengths, model.prediction, model.joint, model.durations,
                                              model.max_symbols, boost=boost)
    if hotwords:  # the table of fixed capacity, and the rows' places in it, were used where they stay
        assert state.boost is before["boost"] and state.node is before["node"] and state.node.any()


def test_ctc_hotword_frame_steps_never_wait_for_the_device_and_keep_their_tensors():
    """decoding.ctc_boost.frame_step, what its CUDA graph holds 16 of: no host read, only in-place writes."""
    generator = torch.Generator().manual_seed(3)
    log_probs = (torch.randn(3, 20, 7, generator=generator) * 2).log_softmax(-1)
    boost = build_boost_table([(Hotword((1, 2)),), (Hotword((3,), 3.0),), ()], 2.0, CPU)
    roots = boost.roots[:2]
    state = CtcBoostState.allocate(4, 32, 8, 7, CPU)  # spare rows, frames and nodes
    state.load(log_probs[:2], torch.arange(20) >= torch.tensor([[20], [11]]), roots, boost.spread(7), 6)
    before, recorder = dataclasses.asdict(state), HostSyncRecorder()
    fields = {f.name: getattr(state, f.name) for f in dataclasses.fields(state)}
    with torch.inference_mode(), recorder:
        for _ in range(32):
            frame_step(state, 6)
    assert recorder.found == []
    assert [name for name, value in fields.items() if getattr(state, name) is not value] == []
    assert int(state.t) == 32 and not torch.equal(state.labels, before["labels"])


# Operations each stage launches besides the prediction network and the joint: on a GPU each is a kernel,
# and in a conditional-node graph the decoder's time follows their count (RNN-T, TDT with durations 0..4).
STAGE_OPERATIONS = {
    "rnnt": {"first_joint": 9, "inner_joint": 10, "close_search": 3, "emit": 12},
    "tdt": {"first_joint": 11, "inner_joint": 13, "close_search": 3, "emit": 16},
}
VIEWS = {"view", "_unsafe_view", "slice", "select", "unsqueeze", "squeeze", "t", "transpose", "expand",
         "as_strided", "alias", "detach"}  # no kernel


class OperationCounter(TorchDispatchMode):
    """Counts the operations that launch work, outside the networks (``outside`` is switched off for them)."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0
        self.outside = True

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self.outside and func.overloadpacket.__name__ not in VIEWS:
            self.count += 1
        return func(*args, **(kwargs or {}))


class Uncounted:
    """A network whose calls the counter leaves out."""

    def __init__(self, network, counter: OperationCounter):
        self._network, self._counter = network, counter

    def __getattr__(self, name):
        attribute = getattr(self._network, name)
        if not callable(attribute):
            return attribute

        def call(*args, **kwargs):
            self._counter.outside = False
            try:
                return attribute(*args, **kwargs)
            finally:
                self._counter.outside = True

        return call


@pytest.mark.parametrize(("kind", "durations"), [("rnnt", ()), ("tdt", (0, 1, 2, 3, 4))])
def test_label_looping_bookkeeping_stays_within_its_operation_counts(kind, durations):
    model = tiny_transducer(4, durations=durations, max_symbols=2)
    encoded, lengths = random_batch(4, [12, 0, 7, 1], 12)
    counter = OperationCounter()
    looper = LabelLooper(Uncounted(model.prediction, counter), Uncounted(model.joint, counter), durations, 2)
    counted = {}
    with torch.inference_mode():
        enc_proj = looper.project(encoded)
        state = looper.allocate(4, 12, enc_proj.shape[-1], enc_proj.device, enc_proj.dtype)
        looper.load(state, enc_proj, lengths)
        looper.start(state)
        for stage in ("first_joint", "inner_joint", "close_search", "emit"):
            counter.count = 0
            with counter:
                getattr(looper, stage)(state)
            counted[stage] = counter.count
    assert counted == STAGE_OPERATIONS[kind]


def test_the_recorder_sees_what_it_must():
    """The check above can fail: the recorder catches a host read and a masked assignment."""
    recorder = HostSyncRecorder()
    x = torch.arange(6)
    with torch.inference_mode(), recorder:
        if (x > 2).any():  # Python reads the device's answer
            x[x > 3] = 0  # boolean indexing: the number of rows depends on data
        x.nonzero()
        torch.where(x > 1, x, 0)  # fine
    assert recorder.found == ["aten.is_nonzero.default", "aten.index_put_.default with a boolean mask",
                              "aten.nonzero.default"]
