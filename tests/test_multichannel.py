"""Multichannel recordings (a call centre's stereo calls): each channel transcribed apart, read back as one
conversation. Through the Python API, the CLI, HTTP and bulk jobs, on the embedded default model (real speech)."""

from __future__ import annotations

import io
import json
import subprocess
import sys
from pathlib import Path

import httpx
import numpy as np
import pytest
import soundfile as sf

from models import load_model
from models.conversation import Conversation
from models.crosstalk import heard_elsewhere
from models.segmenter import plan_pieces
from models.transcript import Transcript, Word
from service.audio import AudioLimits, AudioRequestError, AudioTooLarge, TooManyChannels, decode_audio
from service.config import Settings
from service.formats import from_record, render, to_record, to_srt
from tests.media import encode
from tests.scores import assert_same_but_scores
from tests.servers import run_server, wait_job

DATA = Path(__file__).parent / "data" / "default_model"
EXPECTED = json.loads((DATA / "expected.json").read_text())
RATE = 16000
CALL_S = 9.0
# (channel, start in seconds, clip): the agent speaks, the customer answers, and the agent talks over the end of it
TURNS = ((0, 0.3, "sentences_000028.wav"), (1, 3.9, "sentences_000110.wav"), (0, 5.2, "voice_000142.wav"))
LIMITS = AudioLimits(max_bytes=10 << 20, max_duration_s=3600, sample_rate=RATE, max_channels=2)


def _call(seconds: float = CALL_S, channels: int = 2) -> np.ndarray:
    """(channels, samples): the turns over a faint line noise, each channel on its own (cut at ``seconds``)."""
    call = (np.random.default_rng(0).standard_normal((channels, int(seconds * RATE))) * 0.002).astype(np.float32)
    for channel, start_s, name in TURNS:
        start = int(start_s * RATE)
        clip = sf.read(DATA / name, dtype="float32")[0][: max(0, call.shape[1] - start)]
        call[channel, start : start + len(clip)] += clip
    return call


def _flac(call: np.ndarray, rate: int = RATE) -> bytes:
    buffer = io.BytesIO()
    sf.write(buffer, call.T if call.ndim == 2 else call, rate, format="FLAC")
    return buffer.getvalue()


def _words(*timed: tuple[str, float, float]) -> list[Word]:
    return [Word(word, start, end) for word, start, end in timed]


def _transcript(*timed: tuple[str, float, float]) -> Transcript:
    words = _words(*timed)
    return Transcript(text=" ".join(w.word for w in words), tokens=[], token_frames=[], duration_s=10.0, words=words)


# --- the conversation --------------------------------------------------------------------------------------------


def test_utterances_end_at_a_pause_or_where_another_channel_speaks():
    agent = _transcript(("hello", 0.0, 0.4), ("there", 0.5, 0.9), ("how", 3.0, 3.2), ("can", 3.3, 3.5),
                        ("i", 4.1, 4.2), ("help", 4.3, 4.6))
    customer = _transcript(("hi", 1.0, 1.2), ("mhm", 3.6, 3.9))
    conversation = Conversation([agent, customer])
    utterances = conversation.utterances()
    assert [(u.channel, u.text) for u in utterances] == [
        (0, "hello there"), (1, "hi"),  # the customer answers: a turn
        (0, "how can"), (1, "mhm"), (0, "i help"),  # talked over: the agent's sentence is cut around it
    ]
    assert [(u.start_s, u.end_s) for u in utterances][:2] == [(0.0, 0.9), (1.0, 1.2)]
    assert conversation.text.splitlines() == ["[channel 0] hello there", "[channel 1] hi", "[channel 0] how can",
                                              "[channel 1] mhm", "[channel 0] i help"]
    alone = Conversation([_transcript(("one", 0.0, 0.2), ("two", 0.5, 0.7), ("three", 1.8, 2.0))])
    assert [u.text for u in alone.utterances()] == ["one two", "three"]  # a pause over a second
    tie = Conversation([_transcript(("a", 1.0, 1.1)), _transcript(("b", 1.0, 1.1))])
    assert [u.channel for u in tie.utterances()] == [0, 1]
    assert Conversation([_transcript(), _transcript()]).utterances() == []


def test_two_speakers_talking_at_once_read_as_an_utterance_each_not_a_word_of_each_in_turn():
    """Cut wherever the other channel's word came between, overlapping speech read "[agent] so [customer] but
    [agent] what ..." a word at a time. Without a pause of TURN_GAP_S, each speaker's utterance goes on."""
    agent = _transcript(("so", 0.0, 0.2), ("what", 0.25, 0.45), ("i", 0.5, 0.6), ("meant", 0.65, 0.9),
                        ("was", 0.95, 1.1), ("okay", 1.5, 1.8))
    customer = _transcript(("but", 0.1, 0.3), ("you", 0.35, 0.5), ("said", 0.55, 0.8), ("monday", 0.85, 1.3),
                           ("right", 2.0, 2.3))
    conversation = Conversation([agent, customer], names=["agent", "customer"])
    utterances = conversation.utterances()
    assert [(u.channel, u.text) for u in utterances] == [
        (0, "so what i meant was okay"), (1, "but you said monday"), (1, "right")]  # a turn before "right"
    assert [(u.start_s, u.end_s) for u in utterances][:2] == [(0.0, 1.8), (0.1, 1.3)]  # they overlap
    assert [w.word for _, w in conversation.timed_words()] == [
        "so", "but", "what", "you", "i", "said", "meant", "monday", "was", "okay", "right"]  # in time order
    srt = to_srt(conversation)
    assert srt.index("[agent] so what i meant was okay") < srt.index("[customer] but you said monday")
    assert "00:00:00,100 --> 00:00:01,300" in srt


def test_a_conversation_renders_with_its_speakers_and_comes_back_from_its_record():
    conversation = Conversation([_transcript(("hello", 0.0, 0.4), ("there", 0.5, 0.9)), _transcript(("hi", 1.0, 1.2))])
    srt = render(conversation, "call.wav", "srt")
    assert srt.split("\n\n")[0] == "1\n00:00:00,000 --> 00:00:00,900\n[channel 0] hello there"
    vtt = render(conversation, "call.wav", "vtt")
    assert vtt.startswith("WEBVTT\n\n") and "00:00:01.000 --> 00:00:01.200\n<v channel 1>hi\n" in vtt
    record = to_record(conversation, "call.wav")
    assert record["words"][-1] == {"word": "hi", "start": 1.0, "end": 1.2, "channel": 1}
    assert record["utterances"] == [
        {"channel": 0, "speaker": "channel 0", "start": 0.0, "end": 0.9, "text": "hello there"},
        {"channel": 1, "speaker": "channel 1", "start": 1.0, "end": 1.2, "text": "hi"}]
    assert [c["text"] for c in record["channels"]] == ["hello there", "hi"]
    back = from_record(json.loads(json.dumps(record)))
    for fmt in ("text", "srt", "vtt"):
        assert render(back, "call.wav", fmt) == render(conversation, "call.wav", fmt)
    # named speakers, in every rendering and back from the record
    conversation.names = ["agent", "customer"]
    assert render(conversation, "call.wav", "text") == "[agent] hello there\n[customer] hi\n"
    assert "[agent] hello there" in render(conversation, "call.wav", "srt")
    assert "<v customer>hi" in render(conversation, "call.wav", "vtt")
    record = to_record(conversation, "call.wav")
    assert [u["speaker"] for u in record["utterances"]] == ["agent", "customer"]
    assert [c["name"] for c in record["channels"]] == ["agent", "customer"]
    back = from_record(json.loads(json.dumps(record)))
    assert back.names == ["agent", "customer"]
    assert render(back, "call.wav", "vtt") == render(conversation, "call.wav", "vtt")
    assert Conversation(conversation.channels, names=["agent"]).text.splitlines()[1] == "[channel 1] hi"


# --- decoding ------------------------------------------------------------------------------------------------------


def test_each_channel_decodes_as_that_channel_alone_would():
    call = _call()
    channels = decode_audio(_flac(call), LIMITS, multichannel=True)
    assert channels.shape == (2, call.shape[1]) and channels.dtype == np.float32
    for i in range(2):
        np.testing.assert_array_equal(channels[i], decode_audio(_flac(call[i]), LIMITS))
    # resampled channel by channel: as each channel's own file at 48 kHz would be
    import soxr

    call_48k = soxr.resample(call.T, RATE, 48000).T
    channels_48k = decode_audio(_flac(call_48k, 48000), LIMITS, multichannel=True)
    for i in range(2):
        np.testing.assert_array_equal(channels_48k[i], decode_audio(_flac(call_48k[i], 48000), LIMITS))
    mono = decode_audio(_flac(call[0]), LIMITS, multichannel=True)
    assert mono.shape == (1, call.shape[1])
    # a lossless stereo file in a media container (FLAC in Matroska, through FFmpeg) reads the same
    mkv = decode_audio(encode(call, "mkv"), LIMITS, multichannel=True)
    np.testing.assert_array_equal(mkv, channels)


def test_multichannel_limits_count_every_channels_seconds():
    limits = AudioLimits(max_bytes=10 << 20, max_duration_s=10.0, sample_rate=RATE, max_channels=2)
    call = _call(seconds=6.0)
    assert decode_audio(_flac(call), limits).shape == (call.shape[1],)  # mixed: 6 s
    with pytest.raises(AudioTooLarge, match="2 channels transcribed apart is 5 s"):
        decode_audio(_flac(call), limits, multichannel=True)  # apart: 12 s
    with pytest.raises(TooManyChannels, match="3 channels; at most 2"):
        decode_audio(_flac(_call(seconds=2.0, channels=3)), limits, multichannel=True)
    broken = _call(seconds=2.0)
    broken[1, 100] = np.nan
    buffer = io.BytesIO()
    sf.write(buffer, broken.T, RATE, format="WAV", subtype="FLOAT")
    with pytest.raises(AudioRequestError, match="NaN"):
        decode_audio(buffer.getvalue(), limits, multichannel=True)


# --- the model, the CLI ----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def model():
    return load_model(device="cpu")


@pytest.fixture(scope="module")
def alone(model) -> list[Transcript]:
    """Each channel of the call transcribed on its own."""
    return model.transcribe(list(_call()))


def test_each_channel_reads_as_it_does_alone_and_recovers_the_speech_mixing_loses(model, alone, tmp_path):
    call = _call()
    path = tmp_path / "call.flac"
    path.write_bytes(_flac(call))
    for conversation in (model.transcribe(path, multichannel=True)[0],
                         model.transcribe(call, multichannel=True)[0]):
        assert isinstance(conversation, Conversation)
        assert [t.tokens for t in conversation.channels] == [t.tokens for t in alone]
        assert_same_but_scores([t.words for t in conversation.channels], [t.words for t in alone])
    agent = f"{EXPECTED['sentences_000028.wav']} {EXPECTED['voice_000142.wav']}"
    assert alone[0].text == agent
    assert alone[1].text.endswith(EXPECTED["sentences_000110.wav"])
    utterances = conversation.utterances()
    assert [u.start_s for u in utterances] == sorted(u.start_s for u in utterances)
    assert {u.channel for u in utterances} == {0, 1}
    # mixed down, the overlap garbles both speakers: the reason to keep them apart
    mixed = model.transcribe(call.mean(axis=0))[0].text.split()
    assert not set(agent.split() + EXPECTED["sentences_000110.wav"].split()) <= set(mixed)


def _is_subsequence(words: list[str], of: list[str]) -> bool:
    remaining = iter(of)
    return all(word in remaining for word in words)


@pytest.mark.parametrize("delay_s", [0.0, 0.1])
def test_an_echo_of_the_other_speaker_is_not_transcribed_twice(model, delay_s):
    """Each speaker also heard 30 dB down on the other channel (echo on the line, at once or 100 ms later):
    alone, the customer's channel repeats the agent's words; in the conversation they are dropped (all, or all but
    a word or two), and each speaker's own words stay."""
    call = _call()
    delay = int(delay_s * RATE)
    echo = np.zeros_like(call)
    echo[:, delay:] = call[::-1, : call.shape[1] - delay] * 10 ** (-30 / 20)
    own = model.transcribe(list(call + echo))
    customer = EXPECTED["sentences_000110.wav"].split()
    assert len(own[1].text.split()) >= len(customer) + 5  # the agent's words, heard on the customer's side
    conversation = model.transcribe(call + echo, multichannel=True)[0]
    heard = conversation.channels[1].text.split()
    assert heard[-len(customer):] == customer and len(heard) <= len(customer) + (0 if delay_s == 0 else 2)
    agent = f"{EXPECTED['sentences_000028.wav']} {EXPECTED['voice_000142.wav']}".split()
    assert _is_subsequence(agent, conversation.channels[0].text.split())


def test_a_quieter_line_talking_over_the_other_keeps_every_word(model):
    """The customer 12 dB quieter than the agent, talking over them: not an echo (their loudness does not follow
    the agent's), so nothing is dropped: each channel reads as it does alone."""
    call = _call()
    call[1] *= 10 ** (-12 / 20)
    own = model.transcribe(list(call))
    conversation = model.transcribe(call, multichannel=True)[0]
    assert [t.tokens for t in conversation.channels] == [t.tokens for t in own]
    assert own[1].text.endswith(EXPECTED["sentences_000110.wav"])


def test_with_skip_silence_an_echo_is_skipped_like_silence(model):
    """An echo 30 dB down keeps the customer's channel above its floor; with skip_silence what is flagged as the
    agent's is skipped too, so only the customer's turn is transcribed. A quieter line talking over the agent is
    not flagged anywhere."""
    call = _call()
    echoed = call + call[::-1] * 10 ** (-30 / 20)
    echo = heard_elsewhere(list(echoed), RATE)[1]
    pieces = plan_pieces(echoed[1], RATE, 30.0, 2.0, model.config.frame_samples, True, echo)
    assert plan_pieces(echoed[1], RATE, 30.0, 2.0, model.config.frame_samples, True)[0].end == len(echoed[1])
    assert [(p.start, p.end) for p in pieces] == [(int(3.36 * RATE), int(6.85 * RATE))]  # its turn, padded
    conversation = model.transcribe(echoed, multichannel=True, skip_silence=True)[0]
    assert conversation.channels[1].text == EXPECTED["sentences_000110.wav"]
    quieter = call.copy()
    quieter[1] *= 10 ** (-12 / 20)
    assert not heard_elsewhere(list(quieter), RATE)[1].flags.any()
    # a customer who says nothing, the agent's echo all that stands out on their side: nothing to transcribe
    silent = call.copy()
    silent[1] = np.random.default_rng(5).standard_normal(silent.shape[1]).astype(np.float32) * 0.002
    silent[1] += silent[0] * 10 ** (-30 / 20)
    only_echo = heard_elsewhere(list(silent), RATE)[1]
    assert only_echo.flags.any()
    assert plan_pieces(silent[1], RATE, 30.0, 2.0, model.config.frame_samples, True, only_echo) == []
    assert not heard_elsewhere(list(call), RATE)[0].flags.any()


def test_cli_transcribes_a_folder_of_calls_as_conversations(alone, tmp_path):
    (tmp_path / "calls").mkdir()
    (tmp_path / "calls" / "call.flac").write_bytes(_flac(_call()))
    out = tmp_path / "out"
    command = [sys.executable, "-m", "service.cli", "transcribe", "--multichannel"]
    result = subprocess.run([*command, "--format", "json", str(tmp_path / "calls")], capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr
    record = json.loads(result.stdout)[0]
    assert [c["text"] for c in record["channels"]] == [t.text for t in alone]
    assert record["text"].splitlines()[0].startswith("[channel ")
    result = subprocess.run([*command, "--format", "vtt", "--output-dir", str(out), str(tmp_path / "calls")],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    vtt = (out / "call.vtt").read_text()
    assert "<v channel 0>" in vtt and "<v channel 1>" in vtt
    result = subprocess.run([*command, "--channel-names", "agent,customer", "--format", "text",
                             str(tmp_path / "calls")], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert {line.split("]")[0] for line in result.stdout.splitlines()} == {"[agent", "[customer"}
    refused = subprocess.run([*command[:-1], "--channel-names", "agent,customer", str(tmp_path / "calls")],
                             capture_output=True, text=True, timeout=300)
    assert refused.returncode == 2 and "--multichannel" in refused.stderr


# --- HTTP and jobs -------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def server(model, tmp_path_factory):
    from tests.redis_server import RedisServer

    redis = RedisServer(tmp_path_factory.mktemp("redis")).start()
    settings = Settings(max_wait_ms=20, max_duration_s=2 * CALL_S + 2, max_channels=2, redis_url=redis.url)
    try:
        with run_server(settings, model) as running:
            yield running
    finally:
        redis.stop()


def _check_conversation(body: dict, alone: list[Transcript]) -> None:
    assert [c["text"] for c in body["channels"]] == [t.text for t in alone]
    assert [c["tokens"] for c in body["channels"]] == [t.tokens for t in alone]
    starts = [u["start"] for u in body["utterances"]]
    assert starts == sorted(starts) and {u["channel"] for u in body["utterances"]} == {0, 1}
    assert body["text"].splitlines() == [f"[channel {u['channel']}] {u['text']}" for u in body["utterances"]]
    word_starts = [w["start"] for w in body["words"]]
    assert word_starts == sorted(word_starts) and all(w["channel"] in (0, 1) for w in body["words"])


def test_http_transcribes_the_channels_apart(server, alone):
    data = _flac(_call())
    raw = httpx.post(f"{server.url}/v1/transcribe?multichannel=true", content=data,
                     headers={"content-type": "audio/flac"}, timeout=120)
    assert raw.status_code == 200, raw.text
    body = raw.json()
    _check_conversation(body, alone)
    assert "tokens" not in body and body["segments"] == 2 and body["rtfx"] > 0
    assert body["duration_s"] == pytest.approx(CALL_S)
    form = httpx.post(f"{server.url}/v1/transcribe", files={"file": ("call.flac", data, "audio/flac")},
                      data={"multichannel": "true"}, timeout=120)
    assert form.status_code == 200 and form.json()["channels"] == body["channels"]
    mixed = httpx.post(f"{server.url}/v1/transcribe", content=data, timeout=120).json()
    assert "channels" not in mixed and "utterances" not in mixed and mixed["tokens"]
    named = httpx.post(f"{server.url}/v1/transcribe", content=data, timeout=120,
                       params={"multichannel": "true", "channel_names": "agent,customer"}).json()
    assert [c["name"] for c in named["channels"]] == ["agent", "customer"]
    assert {u["speaker"] for u in named["utterances"]} == {"agent", "customer"}
    assert named["text"].splitlines()[0].startswith(("[agent] ", "[customer] "))


@pytest.mark.parametrize(("query", "data", "status", "code"), [
    ("multichannel=perhaps", "call", 400, "invalid_parameter"),
    ("multichannel=true", "three_channels", 400, "too_many_channels"),
    ("multichannel=true", "long_call", 413, "audio_too_large"),  # 2 x 11 s: over the 20 s limit
    ("multichannel=false", "long_call", 200, None),  # mixed down: 11 s
    ("channel_names=agent,customer", "call", 400, "invalid_parameter"),  # names without multichannel
    ("multichannel=true&channel_names=agent,<b>boss</b>", "call", 400, "invalid_parameter"),
])
def test_http_multichannel_refusals(server, query, data, status, code):
    audio = {"call": _flac(_call()), "three_channels": _flac(_call(seconds=2.0, channels=3)),
             "long_call": _flac(_call(seconds=CALL_S + 2))}[data]
    response = httpx.post(f"{server.url}/v1/transcribe?{query}", content=audio, timeout=120)
    assert response.status_code == status, response.text
    if code:
        assert response.json()["error"]["code"] == code
    assert httpx.get(f"{server.url}/readyz").status_code == 200


def test_a_bulk_job_of_calls_gives_conversations(server, alone, tmp_path):
    data = _flac(_call())
    submitted = httpx.post(f"{server.url}/v1/jobs", files=[("files", ("call.flac", data, "audio/flac"))],
                           data={"multichannel": "true"}, timeout=60)
    assert submitted.status_code == 202, submitted.text
    assert submitted.json()["multichannel"] is True
    job = wait_job(server.url, submitted.json()["id"])
    assert job["status"] == "completed" and job["audio_s"] == pytest.approx(2 * CALL_S)
    (record,) = [json.loads(line) for line in httpx.get(f"{server.url}/v1/jobs/{job['id']}/results").text.splitlines()]
    _check_conversation(record, alone)
    refused = httpx.post(f"{server.url}/v1/jobs", files=[("files", ("call.flac", data, "audio/flac"))],
                         data={"multichannel": "sometimes"}, timeout=60)
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "multichannel"
    # the CLI: a folder of calls, a WebVTT file each with its speakers
    (tmp_path / "calls").mkdir()
    (tmp_path / "calls" / "call.flac").write_bytes(data)
    out = tmp_path / "subtitles"
    result = subprocess.run([sys.executable, "-m", "service.cli", "submit", "--server", server.url, "--multichannel",
                             "--wait", "--output-dir", str(out), "--format", "vtt", str(tmp_path / "calls")],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert (out / "call.vtt").read_text() == render(from_record(record), "call.flac", "vtt")
    # the speakers named: in the job, its results and the files
    named = subprocess.run([sys.executable, "-m", "service.cli", "submit", "--server", server.url, "--multichannel",
                            "--channel-names", "agent,customer", "--wait", "--output-dir", str(tmp_path / "named"),
                            "--format", "vtt", str(tmp_path / "calls")], capture_output=True, text=True, timeout=120)
    assert named.returncode == 0, named.stderr
    vtt = (tmp_path / "named" / "call.vtt").read_text()
    assert "<v agent>" in vtt and "<v customer>" in vtt and "<v channel" not in vtt
    unnamed = subprocess.run([sys.executable, "-m", "service.cli", "submit", "--server", server.url,
                              "--channel-names", "agent,customer", str(tmp_path / "calls")], capture_output=True,
                             text=True, timeout=60)
    assert unnamed.returncode == 2 and "--multichannel" in unnamed.stderr


# --- skip_silence --------------------------------------------------------------------------------------------------


def test_skip_silence_over_http_and_in_jobs_leaves_the_quiet_out(server, model):
    """The customer's channel starts after 3.9 s of line noise: skipped, it is not transcribed (the engine counts
    fewer audio seconds) and gives no stray word; every route gives what the Python API gives."""
    call = _call()
    data = _flac(call)
    offline = model.transcribe(call, multichannel=True, skip_silence=True)[0]
    assert offline.channels[1].text == EXPECTED["sentences_000110.wav"]
    audio_s = server.metric("batchasr_audio_seconds_total")
    whole = httpx.post(f"{server.url}/v1/transcribe?multichannel=true", content=data, timeout=120)
    whole_s = server.metric("batchasr_audio_seconds_total") - audio_s
    skipped = httpx.post(f"{server.url}/v1/transcribe?multichannel=true&skip_silence=true", content=data, timeout=120)
    skipped_s = server.metric("batchasr_audio_seconds_total") - audio_s - whole_s
    assert whole.status_code == skipped.status_code == 200
    assert whole_s == pytest.approx(2 * CALL_S, abs=0.01) and skipped_s < 2 * CALL_S - 3
    assert [c["text"] for c in skipped.json()["channels"]] == [t.text for t in offline.channels]
    form = httpx.post(f"{server.url}/v1/transcribe", files={"file": ("call.flac", data, "audio/flac")},
                      data={"multichannel": "true", "skip_silence": "true"}, timeout=120)
    assert form.status_code == 200 and form.json()["channels"] == skipped.json()["channels"]
    customer = _flac(call[1])
    openai = httpx.post(f"{server.url}/v1/audio/transcriptions", files={"file": ("c.flac", customer, "audio/flac")},
                        data={"skip_silence": "true"}, timeout=120)
    assert openai.status_code == 200 and openai.json()["text"] == EXPECTED["sentences_000110.wav"]
    silent = httpx.post(f"{server.url}/v1/transcribe?skip_silence=true", content=_flac(np.zeros(5 * RATE)),
                        timeout=120)
    assert silent.status_code == 200 and silent.json()["text"] == "" and silent.json()["segments"] == 0
    assert silent.json()["tokens"] == [] and "avg_logprob" not in silent.json()  # no mean of nothing (docs/http-api.md)
    submitted = httpx.post(f"{server.url}/v1/jobs", files=[("files", ("call.flac", data, "audio/flac"))],
                           data={"multichannel": "true", "skip_silence": "true"}, timeout=60)
    assert submitted.status_code == 202 and submitted.json()["skip_silence"] is True
    job = wait_job(server.url, submitted.json()["id"])
    (record,) = [json.loads(line) for line in httpx.get(f"{server.url}/v1/jobs/{job['id']}/results").text.splitlines()]
    assert_same_but_scores(record["channels"], to_record(offline)["channels"])
    scores = [x for channel in record["channels"] for x in channel["token_logprobs"]]
    assert job["avg_logprob"] == pytest.approx(sum(scores) / len(scores), abs=1e-4) == record["avg_logprob"]


def test_a_mono_recording_stored_as_stereo_is_transcribed_once(server, model):
    """Both channels the same signal (to within a little dither): the second repeats the first, is not
    transcribed, and is said to be a duplicate; the conversation is the mono transcript, once."""
    mono = _call()[0]
    dual = np.stack([mono, mono + np.random.default_rng(2).standard_normal(len(mono)).astype(np.float32) * 1e-5])
    (alone,) = model.transcribe([mono])
    conversation = model.transcribe(dual, multichannel=True)[0]
    assert conversation.duplicates == {1: 0}
    assert conversation.channels[0].tokens == alone.tokens and conversation.channels[1].tokens == []
    assert [u.channel for u in conversation.utterances()] == [0] * len(conversation.utterances())
    audio_s = server.metric("batchasr_audio_seconds_total")
    response = httpx.post(f"{server.url}/v1/transcribe?multichannel=true", content=_flac(dual), timeout=120)
    assert response.status_code == 200, response.text
    body = response.json()
    assert server.metric("batchasr_audio_seconds_total") - audio_s == pytest.approx(CALL_S, abs=0.01)  # once
    assert body["channels"][1]["duplicate_of"] == 0 and "duplicate_of" not in body["channels"][0]
    assert body["channels"][0]["tokens"] == alone.tokens and body["channels"][1]["text"] == ""
    record = to_record(conversation)
    assert from_record(json.loads(json.dumps(record))).duplicates == {1: 0}


def test_a_call_whose_channels_together_outnumber_the_queue_is_413_not_429_for_ever(model):
    """Each channel's pieces fit the queue alone, but not both channels' at once: every try got 429."""
    call = np.tile(_call(), (1, 3))  # two channels of three calls each
    n_pieces = [len(plan_pieces(channel, RATE, 5, 1, model.config.frame_samples)) for channel in call]
    settings = Settings(max_queue=max(n_pieces) + 1, max_segment_s=5, segment_overlap_s=1, max_channels=2)
    assert max(n_pieces) < settings.max_queue < sum(n_pieces)
    with run_server(settings, model) as running:
        response = httpx.post(f"{running.url}/v1/transcribe?multichannel=true", content=_flac(call),
                              headers={"content-type": "audio/flac"}, timeout=60)
    assert response.status_code == 413, response.text
    assert f"makes {sum(n_pieces)} pieces" in response.json()["error"]["message"]


def test_names_given_as_a_list_are_each_a_name():
    """A JSON job's channel_names were joined with commas and split again: ["Smith, John", "agent"] named channel 1
    "John", with no error. Each is a name whole now, and a comma in one refused."""
    from service.http import ApiError, speaker_names

    assert speaker_names(["Smith John", " agent "], multichannel=True) == ["Smith John", "agent"]
    assert speaker_names("agent, customer", multichannel=True) == ["agent", "customer"]
    for names in (["Smith, John", "agent"], ["agent", 7], ["agent", ""]):
        with pytest.raises(ApiError, match="not a speaker name"):
            speaker_names(names, multichannel=True)


@pytest.mark.parametrize("field", [{"multichannel": "true"}, {"channel_names": "agent,customer"}])
def test_the_openai_route_refuses_what_only_the_native_route_takes(server, field):
    """multichannel=true there was not read: a call came back mixed down, as one transcript, without a word."""
    files = {"file": ("call.flac", _flac(_call()), "audio/flac")}
    refused = httpx.post(f"{server.url}/v1/audio/transcriptions", files=files, data=field, timeout=60)
    error = refused.json()["error"]
    assert refused.status_code == 400 and (error["param"], error["code"]) == (next(iter(field)), "invalid_parameter")
    assert "/v1/transcribe" in error["message"]
    plain = httpx.post(f"{server.url}/v1/audio/transcriptions", files=files, data={"multichannel": "false"},
                       timeout=60)
    assert plain.status_code == 200, plain.text


@pytest.mark.parametrize("copy", ["half as loud", "inverted", "a sample late", "exact"])
def test_a_channel_that_repeats_another_at_another_level_or_a_sample_late_is_a_duplicate(copy):
    """Only a copy to within 40 dB was caught: at half the level, inverted or a sample late (a mixer, a codec), the
    "stereo" file's two channels were transcribed apart and every word came twice. Two lines of a call are not
    taken for one, nor is a line for its bleed into the other at -6 dB beside that line's own speech."""
    from models.conversation import duplicate_channels

    first, second = _call()
    again = {"half as loud": 0.5 * first, "inverted": -first, "a sample late": np.concatenate(([0.0], first[:-1])),
             "exact": first.copy()}[copy].astype(np.float32)
    assert duplicate_channels(np.stack([first, again])) == {1: 0}
    assert duplicate_channels(np.stack([first, second])) == {}
    bleed = (second + 0.5 * first).astype(np.float32)
    assert duplicate_channels(np.stack([first, bleed])) == {}
    assert duplicate_channels(np.stack([first, np.zeros_like(first)])) == {}
