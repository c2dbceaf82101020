"""Response bodies of the HTTP API (one schema per response shape)."""

from __future__ import annotations

from pydantic import BaseModel


class ErrorDetail(BaseModel):
    """All four in every refusal: `param` names the field at fault (null where none is), `code` what a client can
    match on."""

    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    """The OpenAI error shape, so SDK clients parse our errors."""

    error: ErrorDetail


class WordTiming(BaseModel):
    word: str
    start: float  # seconds
    end: float
    confidence: float | None = None  # 0..1: the probability of the word's least sure token
    channel: int | None = None  # whose word, when the channels were transcribed apart


class OpenAIWord(BaseModel):
    """A word of ``verbose_json``; ``probability`` as Whisper-based servers name it (our native ``confidence``)."""

    word: str
    start: float
    end: float
    probability: float | None = None


class TokenLogprob(BaseModel):
    """One entry of OpenAI's ``logprobs`` (``include[]=logprobs``)."""

    token: str
    logprob: float
    bytes: list[int]


class Usage(BaseModel):
    type: str = "duration"
    seconds: float


class TranscriptionJSON(BaseModel):
    text: str
    logprobs: list[TokenLogprob] | None = None  # with include[]=logprobs
    usage: Usage


class Segment(BaseModel):
    id: int
    seek: int
    start: float
    end: float
    text: str
    tokens: list[int]
    temperature: float = 0.0
    avg_logprob: float = 0.0  # the mean log-probability of its tokens
    compression_ratio: float = 1.0  # its text's bytes over their zlib size: high for a repetition loop
    no_speech_prob: float = 0.0  # a transducer has no no-speech token: always 0 (its avg_logprob tells doubt)


class VerboseTranscription(BaseModel):
    task: str = "transcribe"
    language: str  # named as OpenAI names it, "english" (service.languages)
    duration: float
    text: str
    segments: list[Segment] | None = None
    words: list[OpenAIWord] | None = None
    logprobs: list[TokenLogprob] | None = None  # with include[]=logprobs
    usage: Usage


class UtteranceTiming(BaseModel):
    """A speaker's words up to a pause or until another channel speaks."""

    channel: int
    speaker: str  # its name from channel_names, else "channel N"
    start: float
    end: float
    text: str


class ChannelTranscription(BaseModel):
    channel: int  # 0-based, in the file's order
    name: str | None = None  # the speaker's, from channel_names
    text: str
    tokens: list[int]
    token_frames: list[int]
    token_logprobs: list[float] | None = None
    avg_logprob: float | None = None
    words: list[WordTiming]
    duplicate_of: int | None = None  # the earlier channel this one repeats (not transcribed: left empty)


class NativeTranscription(BaseModel):
    """With ``multichannel``: ``text`` is the utterances in time order, a line each naming its channel; ``words``
    carry their channel; ``utterances`` and ``channels`` are set, and the tokens are in ``channels``."""

    model: str
    text: str
    tokens: list[int] | None = None
    token_frames: list[int] | None = None
    token_logprobs: list[float] | None = None  # natural log-probability of each token
    avg_logprob: float | None = None  # their mean (every channel's, with multichannel)
    words: list[WordTiming]
    duration_s: float
    queue_s: float  # waiting for the engine
    compute_s: float  # engine time spent on this request
    rtfx: float  # audio seconds (every channel's) / compute_s
    segments: int  # pieces long audio was split into
    utterances: list[UtteranceTiming] | None = None
    channels: list[ChannelTranscription] | None = None


class ModelCard(BaseModel):
    """OpenAI's model object, and what a client may want to know of the model served."""

    id: str
    object: str = "model"
    created: int  # when this server started serving it (Unix seconds)
    owned_by: str = "batchasr"
    aliases: list[str]  # other names it answers to as `model`
    architecture: str  # ctc | transducer | hybrid (NeMo's FastConformer families)
    languages: list[str]  # what it transcribes (ISO 639-1; empty: not stated)
    decoder: str  # the head that decodes: ctc | rnnt | tdt
    sample_rate: int  # audio is resampled to this
    vocab_size: int
    token_scores: bool  # whether answers carry token log-probabilities and word confidences
    max_segment_s: float  # longer audio is cut near here at quiet points and stitched back


class ModelList(BaseModel):
    object: str = "list"
    data: list[ModelCard]
