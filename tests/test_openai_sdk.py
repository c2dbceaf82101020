"""OpenAI's own Python client against a real server: what users of the OpenAI-compatible route run. Every
response format parses into the client's types, its stream yields its events, and refusals raise the
client's exceptions with our messages."""

from __future__ import annotations

import io
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest
import soundfile as sf
from openai.types.audio import (
    Transcription,
    TranscriptionTextDeltaEvent,
    TranscriptionTextDoneEvent,
    TranscriptionVerbose,
)

from models import load_model
from service.config import Settings
from service.response_bodies import compression_ratio
from tests.conftest import long_recording
from tests.servers import metric, run_server

MODEL_ID = "parakeet-test"


@pytest.fixture(scope="module")
def hybrid(parity_dir):
    return load_model(parity_dir / "tdt_ctc_hybrid.nemo", device="cpu", dtype="float32")


@pytest.fixture(scope="module")
def server(hybrid):
    settings = Settings(model_name=MODEL_ID, max_wait_ms=10, max_segment_s=5, api_keys=["sk-test"])
    with run_server(settings, hybrid) as running:
        yield running


def _client(url: str, api_key: str = "sk-test") -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key=api_key, max_retries=0, timeout=120)


def test_each_response_format_parses_into_the_clients_types(server, hybrid, parity_audio):
    client, audio = _client(server.url), Path(parity_audio[4])
    expected = hybrid.transcribe([str(audio)])[0]

    def create(**options):
        return client.audio.transcriptions.create(file=audio, model=MODEL_ID, **options)

    as_json = create()
    assert isinstance(as_json, Transcription) and as_json.text == expected.text
    assert as_json.usage is not None and as_json.usage.seconds == pytest.approx(expected.duration_s, abs=1e-3)
    assert create(response_format="text") == expected.text + "\n"
    assert create(prompt="Acme Widgets, Dr. Smith.", temperature=0.8, chunking_strategy="auto").text == expected.text
    assert create(response_format="srt").startswith("1\n00:00:00,")
    assert create(response_format="vtt").startswith("WEBVTT\n\n")
    verbose = create(response_format="verbose_json", timestamp_granularities=["word", "segment"], language="en")
    assert isinstance(verbose, TranscriptionVerbose) and verbose.text == expected.text
    assert [w.word for w in verbose.words] == [w.word for w in expected.words]
    assert [(w.start, w.end) for w in verbose.words] == [(w.start_s, w.end_s) for w in expected.words]
    assert " ".join(s.text for s in verbose.segments) == expected.text
    assert [m.id for m in client.models.list()] == [MODEL_ID]


def test_the_served_model_is_retrieved_by_its_id_or_an_alias(server, hybrid):
    client = _client(server.url)
    card = client.models.retrieve(MODEL_ID)
    assert card.id == MODEL_ID and card.object == "model" and 0 < card.created <= time.time()
    assert card.model_extra == {"aliases": ["whisper-1", "default"], "architecture": "hybrid", "languages": ["en"],
                                "decoder": "tdt",
                                "sample_rate": 16000, "vocab_size": hybrid.config.vocab_size, "token_scores": True,
                                "max_segment_s": 5.0}
    assert client.models.retrieve("whisper-1") == card == client.models.list().data[0]
    with pytest.raises(openai.NotFoundError) as unknown:
        client.models.retrieve("gpt-4o-transcribe")
    assert unknown.value.code == "model_not_found"


def test_a_model_id_with_slashes_is_retrieved_as_listed(hybrid, parity_audio):
    """A Hugging Face style id (the client sends its slash encoded, the path arrives decoded) names the model in
    each route; only ids it is not are unknown."""
    served = "nvidia/parakeet-test"
    settings = Settings(model_name=served, model_aliases=["whisper-1", "openai/whisper-large-v3"], max_wait_ms=10)
    with run_server(settings, hybrid) as running:
        client = _client(running.url)
        listed = client.models.list().data[0]
        assert listed.id == served
        assert client.models.retrieve(served) == client.models.retrieve("openai/whisper-large-v3") == listed
        for unknown in ("nvidia/parakeet-other", "nvidia"):
            with pytest.raises(openai.NotFoundError) as not_found:
                client.models.retrieve(unknown)
            assert not_found.value.code == "model_not_found"
        text = client.audio.transcriptions.create(file=Path(parity_audio[4]), model=served).text
        assert text == hybrid.transcribe([parity_audio[4]])[0].text
        assert httpx.get(f"{running.url}/v1/models/").status_code == 404  # no id: not the list, nor the model
        assert metric(running.url, "batchasr_requests_total", '{code="200",route="/v1/models/{model}"}') == 2


def test_the_clients_stream_yields_deltas_then_done(server, parity_audio, tmp_path):
    recording, _ = long_recording(parity_audio, 16)  # pieces of at most 5 s
    path = tmp_path / "long.wav"
    sf.write(path, recording, 16000)
    client = _client(server.url)
    whole = client.audio.transcriptions.create(file=path, model=MODEL_ID).text
    events = list(client.audio.transcriptions.create(file=path, model=MODEL_ID, stream=True))
    *deltas, done = events
    assert len(deltas) > 1 and all(isinstance(e, TranscriptionTextDeltaEvent) for e in deltas)
    assert isinstance(done, TranscriptionTextDoneEvent) and done.text == whole
    assert "".join(e.delta for e in deltas) == whole


def test_logprobs_and_word_probabilities_parse_into_the_clients_types(server, hybrid, parity_audio, tmp_path):
    """``include[]=logprobs`` gives each token's text and log-probability (json, verbose_json and the stream's done
    event); verbose_json's words carry their probability and its segments their tokens' mean log-probability."""
    recording, _ = long_recording(parity_audio, 12)  # pieces of at most 5 s, subtitles of at most 6 s
    audio = tmp_path / "long.wav"
    sf.write(audio, recording, 16000)
    client = _client(server.url)
    expected = hybrid.transcribe([str(audio)], max_segment_s=5)[0]
    as_json = client.audio.transcriptions.create(file=audio, model=MODEL_ID, include=["logprobs"])
    assert [p.logprob for p in as_json.logprobs] == pytest.approx(expected.token_logprobs, abs=1e-3)
    assert "".join(p.token for p in as_json.logprobs) == expected.text
    assert all(p.bytes == list(p.token.encode()) for p in as_json.logprobs)
    assert client.audio.transcriptions.create(file=audio, model=MODEL_ID).logprobs is None  # only when asked
    verbose = client.audio.transcriptions.create(file=audio, model=MODEL_ID, response_format="verbose_json",
                                                 timestamp_granularities=["word", "segment"])
    probabilities = [w.model_extra["probability"] for w in verbose.words]
    assert probabilities == pytest.approx([w.confidence for w in expected.words], abs=1e-3)
    by_segment = [s.avg_logprob for s in verbose.segments]
    assert len(by_segment) > 1 and all(score < 0 for score in by_segment)
    assert [s.compression_ratio for s in verbose.segments] == [compression_ratio(s.text) for s in verbose.segments]
    assert all(0 < s.compression_ratio < 2.4 for s in verbose.segments)  # no repetition loop
    assert compression_ratio(" ".join(["uh huh"] * 20)) > 2.4 and compression_ratio("") == 0.0
    weights = [len(s.tokens) for s in verbose.segments]
    assert sum(weights) == len(expected.tokens)
    assert sum(w * score for w, score in zip(weights, by_segment, strict=True)) / sum(weights) == pytest.approx(
        expected.avg_logprob, abs=1e-3)
    *deltas, done = client.audio.transcriptions.create(file=audio, model=MODEL_ID, stream=True, include=["logprobs"])
    assert [p.logprob for p in done.logprobs] == [p.logprob for p in as_json.logprobs]
    said = [(p.token, p.logprob, p.bytes) for d in deltas for p in d.logprobs]  # each delta's tokens'
    assert len(deltas) > 1 and said == [(p.token, p.logprob, p.bytes) for p in done.logprobs]
    assert all("".join(p.token for p in d.logprobs) == d.delta for d in deltas)
    with pytest.raises(openai.BadRequestError, match="needs response_format") as bad:
        client.audio.transcriptions.create(file=audio, model=MODEL_ID, response_format="srt", include=["logprobs"])
    assert bad.value.param == "include[]"
    with pytest.raises(openai.BadRequestError, match="not 'segments'"):
        client.audio.transcriptions.create(file=audio, model=MODEL_ID, include=["segments"])


def test_a_server_told_not_to_score_tokens_answers_without_scores(hybrid, parity_audio):
    audio = Path(parity_audio[4])
    with run_server(Settings(model_name=MODEL_ID, token_scores=False, max_wait_ms=10), hybrid) as running:
        client = _client(running.url)
        verbose = client.audio.transcriptions.create(file=audio, model=MODEL_ID, response_format="verbose_json",
                                                     timestamp_granularities=["word"])
        assert verbose.words and all("probability" not in w.model_extra for w in verbose.words)
        with pytest.raises(openai.BadRequestError, match="does not score tokens") as refused:
            client.audio.transcriptions.create(file=audio, model=MODEL_ID, include=["logprobs"])
        assert refused.value.code == "logprobs_unavailable"
        native = httpx.post(f"{running.url}/v1/transcribe", content=audio.read_bytes(), timeout=60).json()
    assert native["tokens"] == hybrid.transcribe([str(audio)])[0].tokens
    assert "token_logprobs" not in native and "avg_logprob" not in native
    assert native["words"] and all("confidence" not in w for w in native["words"])


def test_refusals_raise_the_clients_exceptions(server, hybrid, parity_audio):
    audio = Path(parity_audio[0])
    with pytest.raises(openai.AuthenticationError, match="API key"):
        _client(server.url, api_key="wrong").audio.transcriptions.create(file=audio, model=MODEL_ID)
    client = _client(server.url)
    with pytest.raises(openai.NotFoundError, match=f"serves `{MODEL_ID}`") as not_found:
        client.audio.transcriptions.create(file=audio, model="gpt-4o-transcribe")
    assert not_found.value.code == "model_not_found"
    with pytest.raises(openai.BadRequestError, match="cannot decode audio") as bad_audio:
        client.audio.transcriptions.create(file=("a.wav", b"RIFF" + b"\x00" * 64, "audio/wav"), model=MODEL_ID)
    assert bad_audio.value.param == "file"
    with pytest.raises(openai.BadRequestError, match="transcribes en, not 'de'") as other_language:
        client.audio.transcriptions.create(file=audio, model=MODEL_ID, language="de")
    assert other_language.value.code == "unsupported_language" and other_language.value.param == "language"
    verbose = client.audio.transcriptions.create(file=audio, model=MODEL_ID, language="en-US",
                                                 response_format="verbose_json")
    assert verbose.language == "english"  # as OpenAI names it
    with pytest.raises(openai.BadRequestError) as bad_stream:
        client.audio.transcriptions.create(file=audio, model=MODEL_ID, response_format="srt", stream=True)
    assert bad_stream.value.param == "stream"


def test_a_full_queue_raises_rate_limit_errors(hybrid, parity_audio):
    settings = Settings(max_queue=2, max_wait_ms=3000, max_batch_size=64)
    audio = Path(parity_audio[7])
    with run_server(settings, hybrid) as running, ThreadPoolExecutor(4) as pool:
        client = _client(running.url)

        def one(_):
            try:
                return client.audio.transcriptions.create(file=audio, model="whisper-1").text  # an alias clients send
            except openai.RateLimitError as exc:
                return exc

        outcomes = list(pool.map(one, range(4)))
    refused = [o for o in outcomes if isinstance(o, openai.RateLimitError)]
    assert len(refused) == 2 and all(isinstance(o, str) for o in outcomes if o not in refused)
    assert refused[0].code == "queue_full" and int(refused[0].response.headers["retry-after"]) >= 1


def test_a_request_past_the_timeout_is_a_504_the_client_does_not_send_again(hybrid, parity_audio):
    """A 504 had the whole request timeout: OpenAI's client, retrying 5xx twice by default, uploaded it again
    and waited as long each time. The answer says not to (x-should-retry: false), and it is sent once."""
    recording, _ = long_recording(parity_audio, 40)  # far more work than the timeout leaves
    upload = io.BytesIO()
    sf.write(upload, recording, 16000, format="WAV")
    with run_server(Settings(model_name=MODEL_ID, request_timeout_s=0.01), hybrid) as running:
        client = openai.OpenAI(base_url=f"{running.url}/v1", api_key="none", max_retries=2, timeout=60)
        with pytest.raises(openai.InternalServerError) as raised:
            client.audio.transcriptions.create(file=("long.wav", upload.getvalue()), model=MODEL_ID)
        assert raised.value.status_code == 504 and raised.value.response.headers["x-should-retry"] == "false"
        assert raised.value.body["code"] == "timeout"
        assert running.metric("batchasr_requests_total",
                              '{code="504",route="/v1/audio/transcriptions"}') == 1  # sent once
