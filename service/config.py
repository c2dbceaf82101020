"""Service settings: one pydantic-settings object, read from ``BATCHASR_*`` environment variables."""

from __future__ import annotations

import difflib
import json
import math
import os
import shlex
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any

from pydantic import Field, ValidationError, ValidationInfo, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from decoding.types import HOTWORD_BOOST, MAX_HOTWORD_BOOST
from models.segmenter import DEFAULT_MAX_SEGMENT_S, length_bucket_problem, segment_problem

from .batcher import POOL_FACTOR

ENV_PREFIX = "BATCHASR_"
MAX_SECONDS = 30 * 86400  # the longest timeout or duration a setting takes
MAX_WAIT_MS = 3_600_000  # the longest max_wait_ms (an hour; a much longer one overflowed the engine thread's wait)
# BATCHASR_* variables that are not settings: the conditional-node switch (decoding.cuda_conditional), the parity
# fixtures' folder (tests), and docker-compose's choice of GPU for each engine
OTHER_VARIABLES = frozenset({"BATCHASR_CONDITIONAL_NODES", "BATCHASR_PARITY_DIR", "BATCHASR_API_GPU",
                             "BATCHASR_WORKER_GPU"})
# an error names a bad setting's value: these are credentials, named as *** instead
SECRET_SETTINGS = frozenset({"api_keys", "webhook_secret"})


def _webhook_retry_delays() -> list[float]:
    from .webhooks import RETRY_DELAYS_S  # its HTTP client is imported when webhooks are, not with the settings

    return list(RETRY_DELAYS_S)


# settings given as lists: comma-separated, or a JSON list
LIST_SETTINGS = ("api_keys", "model_aliases", "languages", "input_roots", "input_url_prefixes", "webhook_url_prefixes",
                 "webhook_retry_delays_s")


# Front ends `serve` starts on a GPU when none are asked for: with HTTP in the engine's process an H200 served 24% of
# the offline engine's RTFx, its event loop the limit; with 4 front ends 52% (docs/benchmarks.md).
AUTO_FRONTENDS = 4


def auto_frontends(device_type: str, cores: int) -> int:
    """``frontends`` left unset: on a GPU, AUTO_FRONTENDS processes or half the cores if fewer (the engine's thread,
    uploads and decoding need the rest); on a CPU none, where they would take the cores the model computes on."""
    return min(AUTO_FRONTENDS, cores // 2) if device_type == "cuda" else 0


def usable_cores(cpu_max: str = "/sys/fs/cgroup/cpu.max") -> int:
    """The cores this process may run on, not the machine's: its CPU set, and a container's CPU quota (cgroup v2's
    ``cpu.max``; a Kubernetes ``cpu`` limit) where one is set."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    try:
        quota = quota_cores(Path(cpu_max).read_text())
    except OSError:
        quota = None
    return min(cores, quota) if quota else cores


def quota_cores(cpu_max: str) -> int | None:
    """cgroup v2 ``cpu.max`` ("400000 100000": 4 cores a period; "max 100000": no quota) -> whole cores (at least 1),
    or None without a quota."""
    quota, _, period = cpu_max.strip().partition(" ")
    if quota == "max" or not quota.isdigit() or not period.isdigit() or int(period) == 0:
        return None
    return max(1, math.ceil(int(quota) / int(period)))


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, extra="ignore")  # no .env file: the environment only

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
    # upload bytes a process reads or decodes at once, or for a job holds until Redis has them (service.intake)
    max_intake_bytes: int = 2 * 1024 * 1024 * 1024
    max_duration_s: float = 4 * 3600.0  # multichannel requests: every channel's seconds count
    max_channels: int = 8  # channels a file may have: transcribed apart (multichannel) or mixed down
    request_timeout_s: float = 600.0
    job_item_timeout_s: float = 3600.0  # one attempt at a job item, its wait behind HTTP requests included
    decode_threads: int = 4  # audio decoding runs in this many threads, off the event loop
    # HTTP front-end processes beside the engine's (service.processes); 0: the engine's process serves HTTP too;
    # None: auto_frontends
    frontends: int | None = None

    # Batching
    max_batch_size: int = 32
    max_segment_s: float = DEFAULT_MAX_SEGMENT_S  # longer audio is split near here at quiet points
    segment_overlap_s: float = 2.0
    max_batch_audio_s: float | None = None  # padded seconds in one batch (bounds memory); see batch_audio_limit_s
    max_wait_ms: float = 10.0
    max_queue: int = 2048  # queued segments beyond which requests get 429
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
    # items one owner (an API key; without keys, everyone) may have queued or in progress at once; a submission that
    # would go past it is refused (429 too_many_queued_items), so that one key cannot fill Redis for all. None: no limit
    job_max_queued_items: int | None = None
    job_url_timeout_s: float = 60.0  # connecting to, and each read from, a job's audio URL
    job_input_ttl_s: int = 7 * 86400  # uploaded audio waits at most this long for a worker
    job_result_ttl_s: int = 7 * 86400  # results are kept this long after the job finishes
    job_max_attempts: int = 3
    job_visibility_timeout_s: float = 300.0  # an unacknowledged delivery is reclaimed after this
    job_prefetch: int | None = None  # job items in flight per worker (default: see job_items_in_flight)
    webhook_secret: str | None = None  # whsec_<base64>; signs completion webhooks (none: jobs cannot ask for one)
    # a job's webhook URL must lie under one of these (service.url_rules); none: any URL at a public address
    webhook_url_prefixes: Annotated[list[str], NoDecode] = Field(default_factory=list)
    # the wait after each failed attempt at a webhook before the next (each within 20% of it; a receiver's
    # Retry-After lengthens it): as many retries as waits
    webhook_retry_delays_s: Annotated[list[float], NoDecode] = Field(default_factory=_webhook_retry_delays)
    worker_name: str | None = None  # consumer name in the group (default: host-pid)
    # job consumer processes beside the engine's, sharing job_items_in_flight (service.processes); 0: the
    # engine's process consumes. serve needs front ends for them.
    job_consumers: int = 0

    @model_validator(mode="before")
    @classmethod
    def _blank_is_default(cls, values: Any) -> Any:
        """``BATCHASR_X=`` (a manifest that lists every setting, some left blank) means X's default: not an error
        (a blank number or JOB_MAX_QUEUED_ITEMS refused to start), nor a blank value (a blank HOST had the server
        listen on every interface; a blank WEBHOOK_RETRY_DELAYS_S, no retries). But for LANGUAGES, whose empty list
        means any language."""
        if not isinstance(values, dict):
            return values
        return {name: value for name, value in values.items()
                if name == "languages" or not (isinstance(value, str) and not value.strip())}

    @field_validator(*LIST_SETTINGS, mode="before")
    @classmethod
    def _split_commas(cls, value: object) -> object:
        """Accept ``a,b`` as well as a JSON list from the environment."""
        if isinstance(value, str):
            if value.lstrip().startswith("["):
                try:
                    return json.loads(value)
                except json.JSONDecodeError as exc:
                    raise ValueError(f"a list starting with [ must be JSON: {exc}") from None
            return [part.strip() for part in value.split(",") if part.strip()]
        return value

    @field_validator("api_keys")
    @classmethod
    def _no_blank_keys(cls, value: list[str]) -> list[str]:
        """Blank keys dropped, as the ``a,b`` form drops them: a JSON list's ``""`` would have let in a request
        with an empty ``Authorization: Bearer``. A list of nothing but blank ones is refused: dropped, it would turn
        the keys off, which an operator who gave a list did not mean."""
        keys = [key.strip() for key in value if key.strip()]
        if value and not keys:
            raise ValueError("holds only blank keys: give the keys, or leave it unset for none")
        return keys

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

    @field_validator("max_batch_size", "max_queue", "decode_threads", "job_prefetch", "max_job_items",
                     "max_upload_bytes", "max_job_upload_bytes", "max_intake_bytes", "max_channels",
                     "job_input_ttl_s", "job_result_ttl_s", "job_max_attempts", "job_max_queued_items")
    @classmethod
    def _positive(cls, value: int | None) -> int | None:
        if value is not None and value < 1:
            raise ValueError("must be >= 1")
        return value

    @field_validator("max_duration_s", "request_timeout_s", "job_item_timeout_s", "job_url_timeout_s",
                     "job_visibility_timeout_s")
    @classmethod
    def _positive_seconds(cls, value: float) -> float:
        if not 0 < value <= MAX_SECONDS:  # NaN too; infinity would be cast to int for timers, 1e300 overflow them
            raise ValueError(f"must be a number of seconds > 0, at most {MAX_SECONDS:,} (30 days)")
        return value

    @field_validator("max_wait_ms")
    @classmethod
    def _not_negative_wait(cls, value: float) -> float:
        if not 0 <= value <= MAX_WAIT_MS:  # a longer one overflowed the engine thread's wait, failing it for good
            raise ValueError(f"must be a number of milliseconds from 0 to {MAX_WAIT_MS:,}")
        return value

    @field_validator("port")
    @classmethod
    def _port(cls, value: int) -> int:
        if not 0 <= value <= 65535:
            raise ValueError("must be 0 to 65535")
        return value

    @field_validator("device")
    @classmethod
    def _known_device(cls, value: str) -> str:
        if value != "auto":  # whether this machine has it is for loading the model to tell
            from models.asr_model import parse_device

            parse_device(value)
        return value

    @field_validator("dtype")
    @classmethod
    def _known_dtype(cls, value: str) -> str:
        from models.asr_model import DTYPES

        if value != "auto" and value not in DTYPES:
            raise ValueError(f"must be one of auto, {', '.join(DTYPES)}")
        return value

    @field_validator("decoder")
    @classmethod
    def _known_decoder(cls, value: str) -> str:
        from models.asr_model import DECODERS

        return _one_of(value, DECODERS)

    @field_validator("redis_url")
    @classmethod
    def _redis_url(cls, value: str | None) -> str | None:
        if value is not None:
            from .redis_pools import check_url

            check_url(value)
        return value

    @field_validator("webhook_secret")
    @classmethod
    def _webhook_secret(cls, value: str | None) -> str | None:
        if value is not None:
            import binascii

            from .webhooks import secret_bytes  # decoded as each webhook is signed: a bad one failed every delivery

            try:
                secret_bytes(value)
            except (binascii.Error, ValueError) as exc:
                raise ValueError(f"a webhook secret is whsec_ and base64, as Standard Webhooks defines it (make one: "
                                 f"python -c 'import base64, os; print(\"whsec_\" + base64.b64encode(os.urandom(32))"
                                 f".decode())'): {exc}") from None
        return value

    @field_validator("webhook_retry_delays_s")
    @classmethod
    def _retry_delays(cls, value: list[float]) -> list[float]:
        if any(not math.isfinite(delay) or delay <= 0 for delay in value):
            raise ValueError("each wait is a positive number of seconds")
        return value

    @field_validator("frontends", "job_consumers")
    @classmethod
    def _not_negative(cls, value: int | None) -> int | None:
        if value is not None and value < 0:
            raise ValueError("must be >= 0")
        return value

    @property
    def shutdown_grace_s(self) -> int:
        """How long a stopping HTTP server waits for the requests in flight (uvicorn takes whole seconds): their
        timeout, rounded up (down, a timeout under a second gave none)."""
        return math.ceil(self.request_timeout_s)

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

        return _one_of(value, ATTENTION_KERNEL_OPTIONS)

    @field_validator("max_batch_audio_s")
    @classmethod
    def _positive_batch_audio(cls, value: float | None, info: ValidationInfo) -> float | None:
        if value is not None and not 0 < value < math.inf:
            raise ValueError("must be a finite number of seconds > 0 (or unset)")
        # the longest piece runs alone in a batch at the least: a longer one went past the limit that bounds memory
        segment_s = info.data.get("max_segment_s")  # declared first: validated before this (absent if refused)
        if value is not None and segment_s is not None and segment_s > value:
            raise ValueError(f"must hold the longest piece in one batch: at least max_segment_s ({segment_s:g})")
        return value

    @field_validator("length_bucket_s")
    @classmethod
    def _length_bucket(cls, value: float | None) -> float | None:
        if value is not None and (problem := length_bucket_problem(value)):
            raise ValueError(f"{problem} (or unset)")
        return value

    @field_validator("max_segment_s")
    @classmethod
    def _segment_long_enough(cls, value: float) -> float:
        if problem := segment_problem(value):
            raise ValueError(problem)
        return value

    @field_validator("segment_overlap_s")
    @classmethod
    def _overlap_under_half_a_segment(cls, value: float, info: ValidationInfo) -> float:
        # each cut must move on past the overlap it leaves behind, or long audio is never cut to the end;
        # max_segment_s is validated first (declared first), and absent here when it was refused itself
        segment_s = info.data.get("max_segment_s")
        if segment_s is not None and not 0 <= value < segment_s / 2:
            raise ValueError(f"must be >= 0 and under half of max_segment_s ({segment_s:g})")
        return value


@dataclass(frozen=True)
class SettingProblem:
    """A setting refused: the value given, what is wrong with it, and whether an override (a command-line option)
    gave it rather than the environment."""

    field: str
    value: object
    message: str
    overridden: bool

    def line(self, option_names: Mapping[str, str]) -> str:
        """``BATCHASR_MAX_SEGMENT_S=4: must be ...``, or the option's name for an override's."""
        where = option_names.get(self.field, self.field) if self.overridden else ENV_PREFIX + self.field.upper()
        return f"{where}={shlex.quote(_shown(self.field, self.value))}: {self.message}"


class InvalidSettings(ValueError):
    """Settings refused, one ``SettingProblem`` per bad setting (its first error)."""

    def __init__(self, problems: list[SettingProblem]):
        super().__init__("\n".join(problem.line({}) for problem in problems))
        self.problems = problems

    def lines(self, option_names: Mapping[str, str]) -> list[str]:
        return [problem.line(option_names) for problem in self.problems]


def get_settings(**overrides: object) -> Settings:
    """Settings from the environment, with explicit overrides (command-line options, tests); ``InvalidSettings``
    naming each bad one."""
    given = {k: v for k, v in overrides.items() if v is not None}
    try:
        return Settings(**given)
    except ValidationError as exc:
        raise InvalidSettings(_problems(exc, given)) from exc


def _one_of(value: str, choices: Iterable[str]) -> str:
    """``value``, refused unless it is one of ``choices`` (a setting's names: a decoder, an attention kernel)."""
    if value not in choices:
        raise ValueError(f"must be one of {', '.join(choices)}")
    return value


def unread_variables(environ: Mapping[str, str] = os.environ) -> list[str]:
    """A line for each ``BATCHASR_*`` variable set that nothing reads, with the setting it most likely meant: a
    misspelt setting is otherwise ignored without a word, and its default taken."""
    known = sorted({ENV_PREFIX + name.upper() for name in Settings.model_fields} | OTHER_VARIABLES)
    lines = []
    for name in sorted(environ):
        if name.upper().startswith(ENV_PREFIX) and name.upper() not in known:
            # compared without the prefix, which every name shares
            close = difflib.get_close_matches(name.upper()[len(ENV_PREFIX):], [k[len(ENV_PREFIX):] for k in known],
                                              n=1, cutoff=0.75)
            meant = f"; did you mean {ENV_PREFIX}{close[0]}?" if close else ""
            lines.append(f"{name} is not a setting and is ignored{meant}")
    return lines


def _problems(exc: ValidationError, given: Mapping[str, object]) -> list[SettingProblem]:
    problems: dict[str, SettingProblem] = {}
    for error in exc.errors():
        field = str(error["loc"][0]) if error["loc"] else ""
        if field in problems:  # a list's other bad items: the first says what is wrong
            continue
        cause = error.get("ctx", {}).get("error")  # a validator's ValueError: its words, without "Value error, "
        message = str(cause) if error["type"] == "value_error" and cause is not None else error["msg"]
        overridden = field in given
        # the environment's text as it was set (a list's error holds only its item)
        value = given[field] if overridden else os.environ.get(ENV_PREFIX + field.upper(), error.get("input"))
        problems[field] = SettingProblem(field, value, message, overridden)
    return list(problems.values())


def _shown(field: str, value: object) -> str:
    """A bad setting's value as an error line shows it: credentials hidden."""
    if field in SECRET_SETTINGS:
        return "***"
    if field == "redis_url":
        from .logs import redacted_url

        try:
            return redacted_url(str(value))
        except ValueError:  # not even a URL's shape
            return "***"
    return str(value)
