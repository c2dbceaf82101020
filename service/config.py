"""Service settings: one pydantic-settings object, read from ``BATCHASR_*`` environment variables."""

from __future__ import annotations

import json
from typing import Annotated

from pydantic import Field, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from decoding.types import HOTWORD_BOOST, MAX_HOTWORD_BOOST
from models.segmenter import MIN_SEGMENT_S, SEGMENT_TOO_SHORT

from .batcher import POOL_FACTOR


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="BATCHASR_", extra="ignore")

    # Model and device
    model: str | None = None  # a .nemo path; None: the embedded default model
    model_name: str | None = None  # the id clients see (default: the model file's stem)
    model_aliases: Annotated[list[str], NoDecode] = Field(default_factory=lambda: ["whisper-1", "default"])
    # the languages the model transcribes (ISO 639-1): a request for another is refused rather than answered in
    # the wrong one; none: any is taken
    languages: Annotated[list[str], NoDecode] = Field(default_factory=lambda: ["en"])
    device: str = "auto"
    dtype: str = "auto"
    decoder: str = "auto"
    attention_kernel: str = "auto"  # reference | sdpa (torch's fused attention) | auto (models.fastconformer)
    # each token's log-probability (decoding.scores): word confidences, avg_logprob, include[]=logprobs. Off, the
    # engine does the greedy search alone, and answers carry no scores
    token_scores: bool = True
    # the logit bonus of a token that continues one of a request's hotwords (decoding.boosting)
    hotword_boost: Annotated[float, Field(ge=0.0, le=MAX_HOTWORD_BOOST)] = HOTWORD_BOOST

    # HTTP
    host: str = "127.0.0.1"
    port: int = 8000
    # when set, every /v1 route needs one of these as a Bearer key
    api_keys: Annotated[list[str], NoDecode] = Field(default_factory=list)
    max_upload_bytes: int = 200 * 1024 * 1024
    # one job submission's body: its uploads wait in Redis for the workers (larger sets: paths or URLs)
    max_job_upload_bytes: int = 1024 * 1024 * 1024
    # upload bytes a process holds in memory at once, read and not yet decoded (service.intake)
    max_intake_bytes: int = 2 * 1024 * 1024 * 1024
    max_duration_s: float = 4 * 3600.0  # multichannel requests: every channel's seconds count
    max_channels: int = 8  # channels a file may have: transcribed apart (multichannel) or mixed down
    request_timeout_s: float = 600.0
    job_item_timeout_s: float = 3600.0  # one attempt at a job item, its wait behind HTTP requests included
    decode_threads: int = 4  # audio decoding runs in this many threads, off the event loop
    # HTTP front-end processes beside the engine's (service.processes); 0: the engine's process serves HTTP too
    frontends: int = 0

    # Batching
    max_batch_size: int = 32
    max_batch_audio_s: float | None = None  # padded seconds in one batch (bounds memory); see batch_audio_limit_s
    max_wait_ms: float = 10.0
    max_queue: int = 2048  # queued segments beyond which requests get 429
    max_segment_s: float = 30.0  # longer audio is split near here at quiet points
    segment_overlap_s: float = 2.0
    # fixed batch shapes: pieces of one length bucket of this many seconds per batch, padded to its end and to as
    # many rows as fit the padded-audio limit, so bf16 transcripts do not move with their neighbours
    # (service.batcher); None: off
    length_bucket_s: float | None = None

    # Redis (bulk jobs)
    redis_url: str | None = None
    input_roots: Annotated[list[str], NoDecode] = Field(default_factory=list)  # jobs may name files under these
    # jobs may name http(s) URLs under these (service.url_inputs: scheme, host, port and path must match)
    input_url_prefixes: Annotated[list[str], NoDecode] = Field(default_factory=list)
    max_job_items: int = 100_000  # items in one job (service.jobs.MAX_JOB_ITEMS): more go as several jobs
    job_url_timeout_s: float = 60.0  # connecting to, and each read from, a job's audio URL
    job_input_ttl_s: int = 7 * 86400  # uploaded audio waits at most this long for a worker
    job_result_ttl_s: int = 7 * 86400  # results are kept this long after the job finishes
    job_max_attempts: int = 3
    job_visibility_timeout_s: float = 300.0  # an unacknowledged delivery is reclaimed after this
    job_prefetch: int | None = None  # job items in flight per worker (default: see job_items_in_flight)
    webhook_secret: str | None = None  # whsec_<base64>; signs completion webhooks (none: jobs cannot ask for one)
    # a job's webhook URL must lie under one of these (service.url_rules); none: any URL at a public address
    webhook_url_prefixes: Annotated[list[str], NoDecode] = Field(default_factory=list)
    worker_name: str | None = None  # consumer name in the group (default: host-pid)
    # job consumer processes beside the engine's, sharing job_items_in_flight (service.processes); 0: the
    # engine's process consumes. serve needs front ends for them.
    job_consumers: int = 0

    @field_validator("model", "model_name", "max_batch_audio_s", "length_bucket_s", "redis_url", "job_prefetch",
                     "webhook_secret", "worker_name", mode="before")
    @classmethod
    def _empty_is_unset(cls, value: object) -> object:
        """``BATCHASR_X=`` (a manifest that lists every setting, some left blank) means the default, not an error."""
        return None if isinstance(value, str) and not value.strip() else value

    @field_validator("api_keys", "model_aliases", "languages", "input_roots", "input_url_prefixes",
                     "webhook_url_prefixes", mode="before")
    @classmethod
    def _split_commas(cls, value: object) -> object:
        """Accept ``a,b`` as well as a JSON list from the environment."""
        if isinstance(value, str):
            if value.lstrip().startswith("["):
                return json.loads(value)
            return [part.strip() for part in value.split(",") if part.strip()]
        return value

    @field_validator("languages")
    @classmethod
    def _language_codes(cls, value: list[str]) -> list[str]:
        codes = [code.lower() for code in value]
        if bad := [code for code in codes if not (len(code) in (2, 3) and code.isalpha())]:
            raise ValueError(f"languages are ISO 639-1 codes such as en or de, not {bad[0]!r}")
        return codes

    @field_validator("input_url_prefixes", "webhook_url_prefixes")
    @classmethod
    def _http_urls(cls, value: list[str]) -> list[str]:
        from .url_rules import check_prefixes  # the same parsing the URLs checked against them get

        return check_prefixes(value)

    @field_validator("max_batch_size", "max_queue", "decode_threads", "job_prefetch", "max_job_items")
    @classmethod
    def _positive(cls, value: int | None) -> int | None:
        if value is not None and value < 1:
            raise ValueError("must be >= 1")
        return value

    @field_validator("frontends", "job_consumers")
    @classmethod
    def _not_negative(cls, value: int) -> int:
        if value < 0:
            raise ValueError("must be >= 0")
        return value

    @property
    def batch_audio_limit_s(self) -> float:
        """Padded seconds of audio in one batch: ``max_batch_audio_s``, else full batches of the longest pieces
        (``max_batch_size`` x ``max_segment_s``), so raising the batch size alone is not undone by this limit."""
        if self.max_batch_audio_s is not None:
            return self.max_batch_audio_s
        return self.max_batch_size * self.max_segment_s

    @property
    def job_items_in_flight(self) -> int:
        """A worker's job items in flight: ``job_prefetch``, else as many as the batcher chooses a batch from
        (``POOL_FACTOR`` batches), so it can put items of like lengths together, but at most half the queue,
        which interactive requests share."""
        if self.job_prefetch is not None:
            return self.job_prefetch
        return max(1, min(POOL_FACTOR * self.max_batch_size, self.max_queue // 2))

    @property
    def redis_max_connections(self) -> int:
        """A connection per item in flight up to 256 (an item holds one only while it talks to Redis; the rest
        wait for one), and room for the job routes and the consumer's own reads."""
        return min(self.job_items_in_flight, 256) + 32

    @field_validator("attention_kernel")
    @classmethod
    def _known_attention_kernel(cls, value: str) -> str:
        from models.fastconformer import ATTENTION_KERNEL_OPTIONS

        if value not in ATTENTION_KERNEL_OPTIONS:
            raise ValueError(f"must be one of {', '.join(ATTENTION_KERNEL_OPTIONS)}")
        return value

    @field_validator("length_bucket_s")
    @classmethod
    def _positive_bucket(cls, value: float | None) -> float | None:
        if value is not None and value <= 0:
            raise ValueError("must be > 0 seconds (or unset)")
        return value

    @field_validator("max_segment_s")
    @classmethod
    def _segment_long_enough(cls, value: float) -> float:
        if not value >= MIN_SEGMENT_S:  # NaN too
            raise ValueError(SEGMENT_TOO_SHORT)
        return value

    @model_validator(mode="after")
    def _overlap_under_half_a_segment(self) -> Settings:
        # each cut must move on past the overlap it leaves behind, or long audio is never cut to the end
        if not 0 <= self.segment_overlap_s < self.max_segment_s / 2:
            raise ValueError(f"segment_overlap_s ({self.segment_overlap_s:g}) must be >= 0 and under half of "
                             f"max_segment_s ({self.max_segment_s:g})")
        return self


def get_settings(**overrides: object) -> Settings:
    """Settings from the environment, with explicit overrides (command-line options, tests)."""
    return Settings(**{k: v for k, v in overrides.items() if v is not None})
