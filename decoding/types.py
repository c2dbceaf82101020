"""What the decoders take and give: the transducer interface they call, and per-utterance hypotheses."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

HOTWORD_BOOST = 2.0  # the logit bonus of a token that continues a hotword (decoding.boosting; docs/benchmarks.md)
MAX_HOTWORD_BOOST = 10.0  # a hotword's own bonus, at most: beyond it, the hotword is all the search would hear

if TYPE_CHECKING:  # the types alone need no torch: the service's front ends import them
    from torch import Tensor


class Hotword(NamedTuple):
    """A word or phrase to make likelier (decoding.boosting): the model's tokens, and its own logit bonus (None:
    the decoder's default). Hashable and picklable: requests share trees by it, front ends send it."""

    tokens: tuple[int, ...]
    boost: float | None = None


Hotwords = tuple[Hotword, ...]  # a request's, each once


@dataclass
class Hypothesis:
    """One utterance's greedy result. Lists, not tensors: cheap to hand across threads and processes."""

    tokens: list[int] = field(default_factory=list)  # label ids, blanks removed
    frames: list[int] = field(default_factory=list)  # encoder frame where each token was emitted
    durations: list[int] | None = None  # frames each token covers (TDT durations, CTC run lengths)
    logprobs: list[float] | None = None  # each token's log-probability where it was emitted (decoding.scores)

    def take(self, indices: list[int]) -> Hypothesis:
        """The tokens at ``indices``, with everything known of each."""
        def pick(values: list) -> list:
            return [values[i] for i in indices]

        return Hypothesis(tokens=pick(self.tokens), frames=pick(self.frames),
                          durations=None if self.durations is None else pick(self.durations),
                          logprobs=None if self.logprobs is None else pick(self.logprobs))


class PredictionNet(Protocol):
    """The transducer prediction network as the decoders use it (``models.heads.PredictionNetwork``)."""

    blank_id: int

    def initial_state(self, batch_size: int, device: Any, dtype: Any) -> Any: ...

    def step(self, labels: Tensor, state: Any) -> tuple[Tensor, Any]: ...

    def select_state(self, mask: Tensor, new: Any, old: Any) -> Any: ...

    def sequence(self, labels: Tensor) -> Tensor: ...


class JointNet(Protocol):
    """The joint split into its precomputable parts (``models.heads.Joint``)."""

    vocab_size: int
    n_durations: int

    def project_encoder(self, encoded: Tensor) -> Tensor: ...

    def project_prediction(self, pred_out: Tensor) -> Tensor: ...

    def joint_after_projection(self, enc_proj: Tensor, pred_proj: Tensor) -> Tensor: ...
