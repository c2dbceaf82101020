"""Token log-probabilities (decoding.scores) and what is made of them: each token's is the one greedy search took
its argmax from (checked against a step-by-step replay), words' confidences, ``avg_logprob``, and scores that
follow their tokens through stitching; on the embedded model they tell guesses from speech."""

from __future__ import annotations

import json
import math
from functools import cache
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf
import torch
from hypothesis import HealthCheck, given, settings

from decoding.frame_looping import frame_looping_greedy
from decoding.scores import ctc_logprobs, transducer_logprobs
from decoding.types import Hypothesis
from models import ASRModel, load_model
from models.audio_io import read_audio
from models.segmenter import NO_CUT, Segment
from models.stitching import stitch
from models.transcript import build_transcript
from tests.conftest import REPO, load_script
from tests.scores import assert_scores_are_the_searchs
from tests.test_label_looping import decoding_cases, random_batch, tiny_transducer

DATA = Path(__file__).parent / "data" / "default_model"
EXPECTED = json.loads((DATA / "expected.json").read_text())
RATE = 16000


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(decoding_cases())
def test_each_tokens_logprob_is_the_one_greedy_search_chose_it_by(case):
    """Random RNN-T and TDT heads, one or two LSTM layers, saturated max_symbols, empty rows."""
    model = tiny_transducer(case["seed"], case["vocab"], case["durations"], case["max_symbols"],
                            case["blank_bias"], case["pred_layers"])
    encoded, lengths = random_batch(case["seed"], case["lengths"], case["n_frames"])
    with torch.inference_mode():
        hyps = frame_looping_greedy(encoded, lengths, model.prediction, model.joint, model.durations,
                                    model.max_symbols)
        logprobs = transducer_logprobs(encoded, hyps, model.prediction, model.joint)
        assert_scores_are_the_searchs(encoded, hyps, logprobs, model.prediction, model.joint)


def test_many_tokens_are_scored_in_parts(monkeypatch):
    model = tiny_transducer(4, durations=(0, 1), max_symbols=4, blank_bias=-50.0)  # a label or more every frame
    encoded, lengths = random_batch(4, [30, 17, 0, 30], 30)
    with torch.inference_mode():
        hyps = frame_looping_greedy(encoded, lengths, model.prediction, model.joint, model.durations, 4)
        whole = transducer_logprobs(encoded, hyps, model.prediction, model.joint)
        monkeypatch.setattr("decoding.scores.JOINT_ROWS", 7)
        parts = transducer_logprobs(encoded, hyps, model.prediction, model.joint)
    assert [len(s) for s in parts] == [len(s) for s in whole]
    assert sum(len(s) for s in whole) > 100 and whole[2] == []  # many parts of 7, and an empty row
    assert all(np.allclose(p, w, rtol=0, atol=1e-6) for p, w in zip(parts, whole, strict=True))


@cache
def _model(path: str | None) -> ASRModel:
    return load_model(path, device="cpu", dtype="float32")


@pytest.mark.parametrize("name,decoder", [("rnnt", "rnnt"), ("tdt", "tdt"), ("tdt_ctc_hybrid", "tdt"),
                                          ("tdt_ctc_hybrid", "ctc"), ("ctc", "ctc"), (None, "tdt"), (None, "ctc")])
def test_fixtures_and_the_default_model_score_what_they_emit(parity_dir, parity_audio, name, decoder):
    model = _model(str(parity_dir / f"{name}.nemo") if name else None)
    waves = [read_audio(path, model.sample_rate) for path in parity_audio[:6]]
    batch = model.encode(waves)
    hyps = model.decode(batch, decoder)
    logprobs = [h.logprobs for h in hyps]
    assert sum(len(s) for s in logprobs) > 0
    if decoder == "ctc":
        with torch.inference_mode():
            log_probs = model.ctc_head(batch.encoded)
        for row, hyp in enumerate(hyps):  # the token's peak over its run, each of whose frames chose it
            for token, frame, run, score in zip(hyp.tokens, hyp.frames, hyp.durations, hyp.logprobs, strict=True):
                assert all(int(log_probs[row, f].argmax()) == token for f in range(frame, frame + run))
                assert score == pytest.approx(float(log_probs[row, frame : frame + run, token].max()), abs=1e-6)
        assert ctc_logprobs(log_probs, hyps) == logprobs
        assert any(run > 1 for h in hyps for run in h.durations)  # runs of several frames were met
        return
    with torch.inference_mode():
        assert_scores_are_the_searchs(batch.encoded, hyps, logprobs, model.decoder, model.joint)
    frame_looping = model.decode(batch, decoder, "frame_looping")
    assert [h.logprobs for h in frame_looping] == logprobs  # same tokens, same scores


def test_scores_hardly_move_with_the_batch_a_recording_shares(parity_audio):
    model = _model(None)
    waves = [read_audio(path, model.sample_rate) for path in parity_audio]
    together = model.decode(model.encode(waves))
    for wave, hyp in zip(waves, together, strict=True):
        (alone,) = model.decode(model.encode([wave]))
        assert alone.tokens == hyp.tokens
        assert np.allclose(alone.logprobs, hyp.logprobs, rtol=0, atol=1e-4)


def test_a_words_confidence_is_its_least_sure_token_and_avg_logprob_their_mean():
    model = _model(None)
    transcript = model.transcribe([sf.read(DATA / "sentences_000110.wav", dtype="float32")[0]])[0]
    spans = model.tokenizer.words(transcript.tokens)
    assert len(spans) == len(transcript.words) > 3
    for span, word in zip(spans, transcript.words, strict=True):
        least = min(transcript.token_logprobs[span.first : span.last + 1])
        assert word.confidence == pytest.approx(math.exp(least), abs=1e-4)
        assert 0.0 <= word.confidence <= 1.0
    assert transcript.avg_logprob == pytest.approx(np.mean(transcript.token_logprobs), abs=1e-4)
    assert build_transcript(Hypothesis(tokens=[5], frames=[0]), model.tokenizer, 0.08, 1.0).words[0].confidence is None


def test_stitching_keeps_each_kept_tokens_own_score():
    frame = 1280
    first = Hypothesis(tokens=[1, 2, 3], frames=[0, 10, 40], logprobs=[-0.1, -0.2, -0.3])
    second = Hypothesis(tokens=[4, 5, 6], frames=[5, 20, 30], logprobs=[-0.4, -0.5, -0.6])
    # the cut at frame 30 of the recording: the first piece keeps what lies before it, the second what lies after
    pieces = [(Segment(0, 50 * frame, 0, 30 * frame), first),
              (Segment(20 * frame, 80 * frame, 30 * frame, NO_CUT), second)]
    out = stitch(pieces, None, frame)
    assert out.tokens == [1, 2, 5, 6] and out.logprobs == [-0.1, -0.2, -0.5, -0.6]
    unscored = stitch([pieces[0], (pieces[1][0], Hypothesis(tokens=[4], frames=[30]))], None, frame)
    assert unscored.tokens == [1, 2, 4] and unscored.logprobs is None


def test_long_audio_scores_come_from_the_pieces(parity_audio):
    model = _model(None)
    waves = [read_audio(path, model.sample_rate) for path in parity_audio]
    recording = np.concatenate([np.concatenate([w, np.zeros(RATE // 2, np.float32)]) for w in waves * 2])
    whole = model.transcribe(recording, max_segment_s=10)[0]
    assert len(whole.token_logprobs) == len(whole.tokens) > 50
    assert all(w.confidence is not None for w in whole.words)
    assert whole.avg_logprob == pytest.approx(np.mean(whole.token_logprobs), abs=1e-4)


# --- what the scores say, on the embedded model (it has only heard espeak-ng) -----------------------------------


def _noise(seconds: float, level: float, seed: int) -> np.ndarray:
    return (np.random.default_rng(seed).standard_normal(int(seconds * RATE)) * level).astype(np.float32)


def test_a_word_read_into_line_noise_is_the_least_sure_and_speech_is_sure():
    model = _model(None)
    clip = sf.read(DATA / "sentences_000110.wav", dtype="float32")[0]
    call = _noise(9.0, 0.002, 1)
    call[int(3.9 * RATE) : int(3.9 * RATE) + len(clip)] += clip
    transcript = model.transcribe(call)[0]
    said = EXPECTED["sentences_000110.wav"].split()
    assert transcript.text.split()[-len(said) + 1 :] == said[1:]  # "... port city in southeastern cuba"
    stray = transcript.words[0]  # the model hears a word in the noise before the speech
    assert stray.start_s < 3.9 and stray.confidence < 0.3
    assert min(w.confidence for w in transcript.words[2:]) > 0.75
    for name in EXPECTED:
        clean = model.transcribe([sf.read(DATA / name, dtype="float32")[0]])[0]
        assert clean.text == EXPECTED[name] and clean.avg_logprob > -0.05
        assert min(w.confidence for w in clean.words) > 0.8


def test_what_it_makes_of_noise_alone_is_all_doubt():
    """Noise alone, white, pink (telephone hiss) and brown (rumble), quiet to loud: the model reads words into it,
    and a word may come out fairly sure (up to 0.89 measured), but the utterance's avg_logprob says it is guessing,
    far below clean speech's (above -0.05 here, -0.125 at worst on the held-out clips)."""
    model = _model(None)
    noises = [_coloured(kind, 6.0, level, seed) for seed, (kind, level) in enumerate(
        (kind, level) for kind in ("white", "pink", "brown") for level in (0.002, 0.02, 0.1, 0.2))]
    for transcript in model.transcribe(noises, batch_size=4):
        assert transcript.words  # it does read words into noise ...
        assert transcript.avg_logprob < -0.5  # ... and says it is guessing


def _coloured(kind: str, seconds: float, level: float, seed: int) -> np.ndarray:
    """Noise of ``kind``: white (flat), pink (power falling as 1/f) or brown (1/f^2), at RMS ``level``."""
    n = int(seconds * RATE)
    spectrum = np.fft.rfft(np.random.default_rng(seed).standard_normal(n))
    f = np.maximum(np.arange(len(spectrum)), 1)
    spectrum /= {"white": 1, "pink": np.sqrt(f), "brown": f}[kind]
    wave = np.fft.irfft(spectrum, n)
    return (wave / wave.std() * level).astype(np.float32)


# --- the measuring script's own arithmetic (loadtest/confidence_quality.py) --------------------------------------


def test_the_quality_scripts_alignment_and_auroc():
    script = load_script(REPO / "loadtest" / "confidence_quality.py")
    assert script.right_words(["a", "b", "c"], ["a", "x", "c", "d"]) == [True, False, True, False]
    assert script.right_words(["the", "cat", "sat"], ["cat", "sat"]) == [True, True]  # a deletion
    assert script.right_words([], ["uh"]) == [False] and script.right_words(["a"], []) == []
    right = np.array([True, True, False, False])
    assert script.auroc(np.array([0.9, 0.8, 0.2, 0.1]), right) == 1.0
    assert script.auroc(np.array([0.1, 0.2, 0.8, 0.9]), right) == 0.0
    assert script.auroc(np.array([0.5, 0.5, 0.5, 0.5]), right) == 0.5
    assert script.auroc(np.array([0.9, 0.3, 0.5, 0.1]), right) == 0.75
