"""ASRModel: a NeMo FastConformer checkpoint as one torch module, and the public Python API.

Precision: audio and features stay float32 (as NeMo does); the encoder, prediction network, joint and CTC
head hold weights in the model dtype (bf16/fp16 cast, no autocast). float32 end to end is the exactness
reference, on CUDA too: a float32 model runs with TF32 off (``exact_float32``).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import Tensor, nn

from decoding.boosting import BoostTable
from decoding.ctc import ctc_greedy
from decoding.ctc_boost import CtcBoostLoop
from decoding.cuda_graphs import CUDA_GRAPH_OPTIONS, LabelLoopingDecoder
from decoding.frame_looping import frame_looping_greedy
from decoding.scores import ctc_logprobs, transducer_logprobs
from decoding.types import HOTWORD_BOOST, MAX_HOTWORD_BOOST, Hypothesis

from .audio_io import AudioClip, AudioError, check_channels, check_waveform, read_audio
from .checkpoint import Checkpoint, open_checkpoint
from .config import ModelConfig
from .conversation import Conversation
from .errors import CheckpointError
from .fastconformer import FastConformerEncoder, resolve_attention_kernel
from .features import LogMelFeatures
from .heads import CTCHead, Joint, PredictionNetwork
from .offline import OfflineOptions, transcribe_stream
from .segmenter import length_bucket_problem, segment_problem
from .tokenizer import Tokenizer, hotword_tokens
from .transcript import Transcript

log = logging.getLogger(__name__)

DECODERS = ("auto", "ctc", "rnnt", "tdt")
DECODER_ALGORITHMS = ("label_looping", "frame_looping")  # transducer greedy search; frame looping is the reference
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
AudioInput = np.ndarray | str | Path | AudioClip


@dataclass
class EncodedBatch:
    """Encoder output for a padded batch."""

    encoded: Tensor  # (B, T, d) in the model dtype
    lengths: Tensor  # (B,) valid encoder frames
    duration_s: list[float]


class _Preprocessor(nn.Module):
    """Holds the featurizer under NeMo's key names (``preprocessor.featurizer.*``)."""

    def __init__(self, featurizer: LogMelFeatures):
        super().__init__()
        self.featurizer = featurizer


class ASRModel(nn.Module):
    def __init__(self, config: ModelConfig, tokenizer: Tokenizer | None = None):
        super().__init__()
        self.config = config
        self.tokenizer = tokenizer
        self.preprocessor = _Preprocessor(LogMelFeatures(config.features))
        self.encoder = FastConformerEncoder(config.encoder)
        if config.transducer is not None:
            self.decoder: nn.Module = PredictionNetwork(config.transducer)
            self.joint = Joint(config.transducer, config.encoder.d_model)
        if config.ctc is not None:
            head = CTCHead(config.ctc)
            if config.ctc_prefix == "decoder":
                self.decoder = head
            else:
                self.ctc_decoder = head
        self.eval()

    # --- construction -----------------------------------------------------------------------------------

    @classmethod
    def from_checkpoint(cls, ckpt: Checkpoint) -> ASRModel:
        tokenizer = Tokenizer(ckpt.tokenizer_model)
        if tokenizer.vocab_size != ckpt.config.vocab_size:
            raise CheckpointError(f"{ckpt.source}: tokenizer has {tokenizer.vocab_size} pieces but the model "
                                  f"predicts {ckpt.config.vocab_size}")
        model = cls(ckpt.config, tokenizer)
        model.load_weights(ckpt.state_dict, ckpt.source)
        return model

    def load_weights(self, state_dict: dict[str, Tensor], source: str) -> None:
        """Load a NeMo state dict strictly, with an error that names what does not fit."""
        own = self.state_dict()
        missing = [k for k in own if k not in state_dict]
        unexpected = [k for k in state_dict if k not in own]
        wrong = [f"{k} {tuple(state_dict[k].shape)} != {tuple(v.shape)}" for k, v in own.items()
                 if k in state_dict and state_dict[k].shape != v.shape]
        if missing or unexpected or wrong:
            parts = []
            for label, items in (("missing", missing), ("unexpected", unexpected), ("wrong shape", wrong)):
                if items:
                    more = f" (+{len(items) - 5} more)" if len(items) > 5 else ""
                    parts.append(f"{label}: {', '.join(items[:5])}{more}")
            raise CheckpointError(f"{source}: weights do not match the config; " + "; ".join(parts))
        self.load_state_dict(state_dict, strict=True)

    def to_precision(self, device: torch.device, dtype: torch.dtype) -> ASRModel:
        """Move to ``device``; cast everything but the featurizer (always float32) to ``dtype``."""
        self.to(device)
        for name, module in self.named_children():
            if name != "preprocessor":
                module.to(dtype)
        for module in self.modules():
            if isinstance(module, nn.RNNBase):
                # moving gives each weight its own memory; cuDNN wants them in one buffer, else it copies them
                # into one at every call (each decoder step; it warns) (no-op off cuDNN)
                module.flatten_parameters()
        return self

    # --- properties -------------------------------------------------------------------------------------

    @property
    def device(self) -> torch.device:
        return self.preprocessor.featurizer.fb.device

    @property
    def dtype(self) -> torch.dtype:
        return self.encoder.pre_encode.out.weight.dtype

    @property
    def sample_rate(self) -> int:
        return self.config.features.sample_rate

    @property
    def ctc_head(self) -> CTCHead | None:
        for name in ("ctc_decoder", "decoder"):
            head = getattr(self, name, None)
            if isinstance(head, CTCHead):
                return head
        return None

    @property
    def default_decoder(self) -> str:
        return self.config.default_decoder

    def resolve_decoder(self, decoder: str) -> str:
        if decoder not in DECODERS:
            raise ValueError(f"unknown decoder {decoder!r}; choose from {', '.join(DECODERS)}")
        if decoder == "auto":
            return self.default_decoder
        transducer = self.config.transducer
        available = {"ctc"} if self.ctc_head is not None else set()
        if transducer is not None:
            available.add("tdt" if transducer.is_tdt else "rnnt")
        if decoder not in available:
            raise ValueError(f"this model has no {decoder} head (it has: {', '.join(sorted(available))})")
        return decoder

    # --- inference --------------------------------------------------------------------------------------

    @torch.inference_mode()
    def featurize(self, waveforms: Sequence[np.ndarray], pad_to: int = 0) -> tuple[Tensor, Tensor]:
        """Pad mono float32 waveforms into a batch on the model's device (to ``pad_to`` samples at least);
        log-mel (B, n_mels, T) float32.

        Each waveform is copied straight into its row on the device. Padding on the host first, then
        uploading, costs an extra pass over the whole padded batch in host memory: about 24 ms for 128 clips
        of up to 7 s, a sizeable part of what a GPU takes to transcribe them."""
        lengths = [len(w) for w in waveforms]
        audio = torch.zeros(len(waveforms), max([pad_to, *lengths]), dtype=torch.float32, device=self.device)
        for row, wave in enumerate(waveforms):
            # contiguous: torch cannot view an array with negative strides (a reversed one, x[::-1])
            audio[row, : len(wave)].copy_(torch.from_numpy(np.ascontiguousarray(wave, dtype=np.float32)))
        return self.features(audio, torch.tensor(lengths, dtype=torch.long, device=self.device))

    @torch.inference_mode()
    def features(self, audio: Tensor, n_samples: Tensor) -> tuple[Tensor, Tensor]:
        """A padded (B, N) float32 batch on the model's device, zero past each row's ``n_samples`` -> log-mel
        (B, n_mels, T) float32 and valid frames (B,). For callers that pad and upload batches themselves."""
        with exact_float32(self.device.type == "cuda"):  # the features are float32 in every model dtype
            return self.preprocessor.featurizer(audio, n_samples)

    @torch.inference_mode()
    def run_encoder(self, features: Tensor, n_frames: Tensor) -> tuple[Tensor, Tensor]:
        """Float32 features -> encoder output (B, T', d) in the model dtype and valid frames (B,)."""
        with self._exact():
            return self.encoder(features.to(self.dtype), n_frames)

    def encode(self, waveforms: Sequence[np.ndarray], pad_to: int = 0) -> EncodedBatch:
        """Features and encoder for a batch of mono float32 waveforms at ``sample_rate``, padded to the longest
        (or to ``pad_to`` samples, if more)."""
        encoded, lengths = self.run_encoder(*self.featurize(waveforms, pad_to))
        duration_s = [len(w) / self.sample_rate for w in waveforms]
        return EncodedBatch(encoded=encoded, lengths=lengths, duration_s=duration_s)

    @torch.inference_mode()
    def decode(self, batch: EncodedBatch, decoder: str = "auto", decoder_algorithm: str = "label_looping",
               cuda_graphs: str = "auto", scores: bool = True, boost: BoostTable | None = None,
               scores_per_row: bool = False) -> list[Hypothesis]:
        """Greedy search. Transducers: ``decoder_algorithm`` label_looping (default) | frame_looping (the
        reference); ``cuda_graphs`` auto | conditional | no_while | off picks how label looping runs on CUDA.
        ``scores`` gives each token its log-probability (``Hypothesis.logprobs``, decoding.scores). ``boost``: the
        rows' hotwords (decoding.boosting). ``scores_per_row``: a transducer's scores are computed one row at a
        time, on shapes that depend on that row alone (so in bf16 they do not move with the other rows)."""
        with self._exact():
            return self._decode(batch, decoder, decoder_algorithm, cuda_graphs, scores, boost, scores_per_row)

    def _exact(self) -> contextlib.AbstractContextManager:
        return exact_float32(self.device.type == "cuda" and self.dtype == torch.float32)

    def _decode(self, batch: EncodedBatch, decoder: str, decoder_algorithm: str, cuda_graphs: str, scores: bool,
                boost: BoostTable | None, scores_per_row: bool = False) -> list[Hypothesis]:
        decoder = self.resolve_decoder(decoder)
        if decoder == "ctc":
            head = self.ctc_head
            assert head is not None
            log_probs = head(batch.encoded)
            loop = self.ctc_boost_loop(cuda_graphs) if boost is not None else None
            hyps = ctc_greedy(log_probs, batch.lengths, head.blank_id, boost, loop)
            return _with_logprobs(hyps, ctc_logprobs(log_probs, hyps) if scores else None)
        transducer = self.config.transducer
        assert transducer is not None
        _check_decoding_options(decoder_algorithm, cuda_graphs)
        if decoder_algorithm == "frame_looping":
            hyps = frame_looping_greedy(batch.encoded, batch.lengths, self.decoder, self.joint,
                                        durations=transducer.durations, max_symbols=transducer.max_symbols,
                                        boost=boost)
        else:
            hyps = self.label_looper(cuda_graphs)(batch.encoded, batch.lengths, boost)
        if not scores:
            return hyps
        if scores_per_row:
            logprobs = [transducer_logprobs(batch.encoded[row : row + 1], [hyp], self.decoder, self.joint)[0]
                        for row, hyp in enumerate(hyps)]
        else:
            logprobs = transducer_logprobs(batch.encoded, hyps, self.decoder, self.joint)
        return _with_logprobs(hyps, logprobs)

    def label_looper(self, cuda_graphs: str = "auto") -> LabelLoopingDecoder:
        """This model's label-looping decoder for a ``cuda_graphs`` setting, kept with its buffers and graphs."""
        transducer = self.config.transducer
        if transducer is None:
            raise ValueError("label looping needs a transducer head")
        loopers = self.__dict__.setdefault("_label_loopers", {})  # plain attribute, not a submodule
        if cuda_graphs not in loopers:
            loopers[cuda_graphs] = LabelLoopingDecoder(self.decoder, self.joint, transducer.durations,
                                                       transducer.max_symbols, cuda_graphs)
        return loopers[cuda_graphs]

    def ctc_boost_loop(self, cuda_graphs: str = "auto") -> CtcBoostLoop:
        """This model's frame loop for CTC rows with hotwords, kept with its buffers and (on CUDA) its graph."""
        if self.ctc_head is None:
            raise ValueError("no CTC head")
        loops = self.__dict__.setdefault("_ctc_boost_loops", {})  # plain attribute, not a submodule
        if cuda_graphs not in loops:
            loops[cuda_graphs] = CtcBoostLoop(self.ctc_head.blank_id, cuda_graphs)
        return loops[cuda_graphs]

    def transcribe(self, audio: Sequence[AudioInput] | AudioInput, batch_size: int = 16,
                   decoder: str = "auto", decoder_algorithm: str = "label_looping",
                   cuda_graphs: str = "auto", max_segment_s: float | None = None,
                   multichannel: bool = False, skip_silence: bool = False, hotwords: Sequence[str] = (),
                   hotword_boost: float = HOTWORD_BOOST, length_bucket_s: float | None = None
                   ) -> list[Transcript] | list[Conversation]:
        """Transcribe waveforms (mono float32 at ``sample_rate``) or audio files, in input order.

        Inputs are grouped into batches of similar length (less padding); results do not depend on the
        grouping. Waveforms, already in memory, are sorted all together; files are read a window of 16 batches
        at a time (``transcribe_iter``), so a list of thousands of paths never holds all their audio at once.
        ``decoder_algorithm`` and ``cuda_graphs`` are as in ``decode``. Inputs are taken whole, as NeMo's
        transcribe takes them; ``max_segment_s`` (30 in the service) cuts longer ones at quiet points and
        stitches them back, so that long audio costs what its pieces cost. With ``multichannel`` each channel of
        a file (each row of a (channels, samples) array) is transcribed apart and each input gives a
        ``Conversation``: a stereo call's agent and customer, and who said what when. ``skip_silence`` leaves
        long quiet stretches out (models.silence): a call's channel is quiet half the time. ``hotwords`` (words or
        phrases, as the model writes them) are made likelier by ``hotword_boost`` on their tokens' logits
        (decoding.boosting; any decoder). ``length_bucket_s`` fixes the batch shapes: batches of one length bucket
        of that many seconds, padded to its end and to as many of ``batch_size`` rows as fit ``batch_size`` x
        ``max_segment_s`` of audio at that end, so in bf16 an input's tokens and scores do not depend on the other
        inputs (at the cost of computing the padding).
        """
        if isinstance(audio, (np.ndarray, str, Path, AudioClip)):
            audio = [audio]
        files = any(isinstance(item, (str, Path, AudioClip)) for item in audio)  # a clip is read from its file
        options = self._offline_options(batch_size, decoder, decoder_algorithm, cuda_graphs, max_segment_s,
                                        window=None if files else max(1, len(audio)), multichannel=multichannel,
                                        skip_silence=skip_silence, hotwords=hotwords, hotword_boost=hotword_boost,
                                        length_bucket_s=length_bucket_s)
        return list(transcribe_stream(self, audio, options))

    def transcribe_iter(self, audio: Iterable[AudioInput], batch_size: int = 16, decoder: str = "auto",
                        decoder_algorithm: str = "label_looping", cuda_graphs: str = "auto",
                        max_segment_s: float | None = None, window: int | None = None,
                        return_errors: bool = False, multichannel: bool = False, skip_silence: bool = False,
                        hotwords: Sequence[str] = (), hotword_boost: float = HOTWORD_BOOST,
                        length_bucket_s: float | None = None
                        ) -> Iterator[Transcript | Conversation | AudioError | OSError]:
        """``transcribe`` over any number of inputs in bounded memory: read ``window`` at a time (default 16
        batches; files by a few threads, the next window while one is transcribed), transcripts yielded in input
        order as each window finishes. An input that cannot be read raises, or with ``return_errors`` is
        yielded as its error in its place (models.offline); ``multichannel``, ``skip_silence``, ``hotwords`` and
        ``length_bucket_s`` as in ``transcribe``."""
        options = self._offline_options(batch_size, decoder, decoder_algorithm, cuda_graphs, max_segment_s, window,
                                        multichannel, skip_silence, hotwords, hotword_boost, length_bucket_s)
        return transcribe_stream(self, audio, options, return_errors)

    def _offline_options(self, batch_size: int, decoder: str, decoder_algorithm: str, cuda_graphs: str,
                         max_segment_s: float | None, window: int | None, multichannel: bool = False,
                         skip_silence: bool = False, hotwords: Sequence[str] = (),
                         hotword_boost: float = HOTWORD_BOOST, length_bucket_s: float | None = None) -> OfflineOptions:
        if batch_size < 1:
            raise ValueError("batch_size must be >= 1")
        if not 0 <= hotword_boost <= MAX_HOTWORD_BOOST:  # as a hotword's own bonus; NaN fails this too
            raise ValueError(f"hotword_boost must be 0 to {MAX_HOTWORD_BOOST:g}, not {hotword_boost!r}")
        if length_bucket_s is not None and (problem := length_bucket_problem(length_bucket_s)):
            raise ValueError(f"length_bucket_s {problem}, not {length_bucket_s:g}")
        if max_segment_s is not None and (problem := segment_problem(max_segment_s)):
            raise ValueError(f"max_segment_s {problem}, not {max_segment_s:g}")
        _check_decoding_options(decoder_algorithm, cuda_graphs)
        decoder = self.resolve_decoder(decoder)
        boosted = hotword_tokens(hotwords, self.tokenizer)
        return OfflineOptions(batch_size=batch_size, decoder=decoder,
                              decoder_algorithm=decoder_algorithm, cuda_graphs=cuda_graphs,
                              max_segment_s=max_segment_s, window=window, multichannel=multichannel,
                              skip_silence=skip_silence, hotwords=boosted, hotword_boost=hotword_boost,
                              length_bucket_s=length_bucket_s)

    def load_audio(self, item: AudioInput, index: int = 0, multichannel: bool = False) -> np.ndarray:
        """A waveform as given (checked; integer PCM scaled to [-1, 1)), or a file read at the model's rate; with
        ``multichannel``, (channels, samples): a file's channels apart, an array's rows (a 1-D array is one
        channel)."""
        if isinstance(item, (str, Path, AudioClip)):
            return read_audio(item, self.sample_rate, mix=not multichannel)
        if not isinstance(item, np.ndarray):
            raise TypeError(f"audio[{index}]: expected a numpy array, a path or an AudioClip, got "
                            f"{type(item).__name__}")
        samples = _float_samples(item, index)
        if not multichannel:
            return check_waveform(samples, f"audio[{index}]")
        if samples.ndim == 2 and samples.shape[0] > samples.shape[1]:
            # (samples, channels), as soundfile reads a file: taken as thousands of channels, it never finished
            raise AudioError(f"audio[{index}]: expected (channels, samples), got shape {samples.shape} (more "
                             "channels than samples): pass a (samples, channels) array transposed, as array.T")
        return check_channels(samples, f"audio[{index}]")


def _float_samples(item: np.ndarray, index: int = 0) -> np.ndarray:
    """float32 samples in [-1, 1): integer PCM (int16 as soundfile reads it, int32, unsigned 8-bit) scaled by its full
    scale, as a file of those samples decodes; floats as they are. Other arrays are no samples: a bool array was
    transcribed as 0/1 samples, a complex one with its imaginary part dropped."""
    if item.dtype.kind not in "iuf":
        raise AudioError(f"audio[{index}]: expected float or integer PCM samples, got an array of {item.dtype}")
    if np.issubdtype(item.dtype, np.integer):
        info = np.iinfo(item.dtype)
        half = (int(info.max) + 1) // 2 if info.min == 0 else -int(info.min)
        middle = half if info.min == 0 else 0
        return ((item.astype(np.float64) - middle) / half).astype(np.float32)
    return np.asarray(item, dtype=np.float32)


def _with_logprobs(hyps: list[Hypothesis], logprobs: list[list[float]] | None) -> list[Hypothesis]:
    if logprobs is not None:
        for hyp, scores in zip(hyps, logprobs, strict=True):
            hyp.logprobs = scores
    return hyps


def _check_decoding_options(decoder_algorithm: str, cuda_graphs: str) -> None:
    if decoder_algorithm not in DECODER_ALGORITHMS:
        raise ValueError(f"unknown decoder_algorithm {decoder_algorithm!r}; "
                         f"choose from {', '.join(DECODER_ALGORITHMS)}")
    if cuda_graphs not in CUDA_GRAPH_OPTIONS:
        raise ValueError(f"unknown cuda_graphs {cuda_graphs!r}; choose from {', '.join(CUDA_GRAPH_OPTIONS)}")


# --- loading ----------------------------------------------------------------------------------------------

DEFAULT_MODEL = Path(__file__).parent / "assets" / "default.nemo"


@contextlib.contextmanager
def exact_float32(active: bool = True) -> Iterator[None]:
    """TF32 off while ``active``. PyTorch lets cuDNN's convolutions and LSTMs round float32 products to TF32 (10
    mantissa bits) by default, and matrix products too where a program asked for it: float32 must give NeMo's
    float32 tokens. The switches are process-wide; the engine runs a model from one thread."""
    if not active:
        yield
        return
    saved = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = saved


DEVICE_TYPES = ("cpu", "cuda")  # where batchasr runs; torch knows more (mps, xpu, meta), which crashed later


def parse_device(device: str | torch.device) -> torch.device:
    """A device's name as torch reads it, whether or not this machine has it; ValueError for a name torch does not
    know, or a device type batchasr does not run on."""
    try:
        parsed = torch.device(device)
    except RuntimeError as exc:  # "gpu", "cuda:x"
        raise ValueError(f"unknown device {str(device)!r}; choose auto, cpu, cuda or cuda:N") from exc
    if parsed.type not in DEVICE_TYPES:
        raise ValueError(f"unsupported device {str(device)!r} (batchasr runs on cpu and cuda); choose auto, cpu, "
                         "cuda or cuda:N")
    return parsed


def resolve_device(device: str | torch.device) -> torch.device:
    if str(device) == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = parse_device(device)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError("CUDA is not available on this machine (no GPU, or none torch can use)")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise ValueError(f"there is no {device}: this machine has {torch.cuda.device_count()} GPU(s)")
    return device


def resolve_dtype(dtype: str | torch.dtype, device: torch.device) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; choose from auto, {', '.join(DTYPES)}")
    return DTYPES[dtype]


def load_model(path_or_name: str | Path | None = None, device: str | torch.device = "auto",
               dtype: str | torch.dtype = "auto", attention_kernel: str = "auto") -> ASRModel:
    """Load a ``.nemo`` file or unpacked checkpoint directory; with no argument (or a blank name, as a blank
    ``BATCHASR_MODEL`` is), the embedded default model.

    ``attention_kernel``: "reference" (NeMo's sequence of operations), "sdpa" (torch's fused attention; the
    same result up to rounding) or "auto" (``fastconformer.resolve_attention_kernel``)."""
    if isinstance(path_or_name, str) and not path_or_name.strip():
        path_or_name = None  # Path("") is ".": it loaded whatever checkpoint lay under the working directory
    path = Path(path_or_name) if path_or_name is not None else DEFAULT_MODEL
    if path_or_name is None and not path.exists():
        raise CheckpointError("the embedded default model is not installed (models/assets/default.nemo); "
                              "pass a .nemo file")
    target_device = resolve_device(device)
    target_dtype = resolve_dtype(dtype, target_device)
    kernel = resolve_attention_kernel(attention_kernel, target_device)
    model = ASRModel.from_checkpoint(open_checkpoint(path))
    model.encoder.set_attention_kernel(kernel)
    log.info("loaded %s (%s) on %s as %s, %s attention", path, model.config.kind, target_device, target_dtype,
             kernel)
    return model.to_precision(target_device, target_dtype)
