"""What ``batchasr transcribe`` says when a run over many files ends: how much it did, how fast, and which
transcripts the model was least sure of (the ones a dataset builder should listen to first)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from models.conversation import Conversation
from models.transcript import Transcript

LEAST_SURE_SHOWN = 5
# an avg_logprob below this reads like noise or silence: 84 recordings of noise alone (white, pink and brown, seven
# levels) were all at -0.82 or lower, clean held-out speech at -0.13 to 0 (docs/confidence.md)
NOISE_LIKE_LOGPROB = -0.8


@dataclass
class RunSummary:
    started: float = field(default_factory=time.perf_counter)
    files: int = 0
    audio_s: float = 0.0
    tokens: int = 0
    logprob_sum: float = 0.0
    by_file: list[tuple[float, str]] = field(default_factory=list)  # (avg_logprob, file), scored files only

    def add(self, name: str, transcript: Transcript | Conversation) -> None:
        self.files += 1
        # a conversation counts every channel it transcribed, as RTFx does everywhere
        self.audio_s += transcript.transcribed_s if isinstance(transcript, Conversation) else transcript.duration_s
        scores = transcript.token_logprobs or []
        self.tokens += len(scores)
        self.logprob_sum += sum(scores)
        if transcript.avg_logprob is not None:
            self.by_file.append((transcript.avg_logprob, name))

    def report(self) -> str:
        elapsed = time.perf_counter() - self.started
        lines = [f"{self.files} files, {self.audio_s / 3600:.2f} h of audio in {elapsed:.1f} s "
                 f"(RTFx {self.audio_s / max(elapsed, 1e-9):.0f}, reading and writing included)"]
        if self.tokens:
            lines.append(f"mean token log-probability {self.logprob_sum / self.tokens:.4f}; least sure files "
                         "(avg_logprob): " + ", ".join(f"{name} ({score:.3f})" for score, name in
                                                      sorted(self.by_file)[:LEAST_SURE_SHOWN]))
        return "\n".join(lines) + "\n"

    def noise_hint(self, skipping_silence: bool) -> str:
        """A line on the files whose transcripts read like words made of noise or silence (a tape's long quiet
        stretches read as pages of words), and what to do; empty when there are none."""
        noisy = sorted((score, name) for score, name in self.by_file if score < NOISE_LIKE_LOGPROB)
        if not noisy:
            return ""
        names = ", ".join(name for _, name in noisy[:LEAST_SURE_SHOWN]) + (", ..." if len(noisy) > LEAST_SURE_SHOWN
                                                                           else "")
        advice = ("" if skipping_silence else
                  "; where they hold long quiet stretches, --skip-silence leaves those out rather than read words "
                  "into them")
        return (f"{len(noisy)} of {self.files} files read like noise or silence (avg_logprob below "
                f"{NOISE_LIKE_LOGPROB}): {names}{advice}\n")
