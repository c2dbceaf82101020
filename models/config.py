"""Model configuration: frozen dataclasses parsed from a NeMo ``model_config.yaml``.

Only what changes the computation is kept. Every option batchasr does not implement is refused by name
(``UnsupportedModelError``), so a checkpoint never loads into a model that silently computes something else.
"""

from __future__ import annotations

import contextlib
import logging
import re
from dataclasses import dataclass
from typing import Any

from .errors import CheckpointError, UnsupportedModelError

log = logging.getLogger(__name__)

FRAME_HOP_S = 0.01  # NeMo's window_stride for every Parakeet model: 10 ms feature frames

# NeMo model classes (the config's `target`) and the kind of model each one is.
_TARGET_KINDS = {
    "EncDecCTCModelBPE": "ctc",
    "EncDecRNNTBPEModel": "transducer",
    "EncDecHybridRNNTCTCBPEModel": "hybrid",
}
# The same architectures with character vocabularies (no SentencePiece tokenizer): refused by name.
_CHARACTER_CLASSES = {"EncDecCTCModel", "EncDecRNNTModel", "EncDecHybridRNNTCTCModel"}


@dataclass(frozen=True)
class FeatureConfig:
    sample_rate: int = 16000
    n_mels: int = 80
    n_fft: int = 512
    win_length: int = 400  # samples: 25 ms at 16 kHz
    hop_length: int = 160  # samples: 10 ms at 16 kHz
    preemph: float = 0.97
    window: str = "hann"  # the window's values come from the checkpoint; its name sizes the buffer
    log_guard: float = 2**-24  # added before the natural log ("add" guard type)
    mag_power: float = 2.0
    pad_value: float = 0.0


@dataclass(frozen=True)
class EncoderConfig:
    feat_in: int = 80
    d_model: int = 512
    n_layers: int = 17
    n_heads: int = 8
    ff_expansion: int = 4
    conv_kernel_size: int = 9
    subsampling_factor: int = 8  # 10 ms feature frames -> 80 ms encoder frames
    subsampling_channels: int = 256
    xscaling: bool = True  # multiply the pre-encoded input by sqrt(d_model)
    use_bias: bool = True  # biases on FF, attention and conv-module layers
    pos_emb_max_len: int = 5000


@dataclass(frozen=True)
class TransducerConfig:
    vocab_size: int  # V, without blank; blank id = V
    pred_hidden: int = 640
    pred_layers: int = 2
    joint_hidden: int = 640
    joint_activation: str = "relu"
    joint_dropout: float = 0.0  # training-time only, but NeMo adds a layer for it, which shifts the output's key
    durations: tuple[int, ...] = ()  # TDT duration choices; empty for RNN-T
    max_symbols: int = 10  # labels one frame may emit before time is forced forward

    @property
    def is_tdt(self) -> bool:
        return bool(self.durations)


@dataclass(frozen=True)
class CTCConfig:
    vocab_size: int  # V, without blank; blank id = V
    feat_in: int


@dataclass(frozen=True)
class ModelConfig:
    kind: str  # "ctc" | "transducer" | "hybrid"
    features: FeatureConfig
    encoder: EncoderConfig
    transducer: TransducerConfig | None = None
    ctc: CTCConfig | None = None
    # Key prefix of the CTC head in the state dict: "decoder" alone, "ctc_decoder" in hybrids.
    ctc_prefix: str = "decoder"

    @property
    def frame_s(self) -> float:
        """Seconds per encoder frame (80 ms for Parakeet)."""
        return self.encoder.subsampling_factor * self.features.hop_length / self.features.sample_rate

    @property
    def frame_samples(self) -> int:
        """Audio samples per encoder frame: where long audio may be cut so token frames stay whole."""
        return self.features.hop_length * self.encoder.subsampling_factor

    @property
    def vocab_size(self) -> int:
        head = self.transducer or self.ctc
        assert head is not None
        return head.vocab_size

    @property
    def default_decoder(self) -> str:
        """The head that decodes unless another is asked for: the transducer's (tdt | rnnt), else ctc."""
        if self.transducer is None:
            return "ctc"
        return "tdt" if self.transducer.is_tdt else "rnnt"


# ---------------------------------------------------------------------------------------------------------
# Parsing


def resolve_interpolations(cfg: dict[str, Any]) -> dict[str, Any]:
    """Resolve OmegaConf-style ``${a.b.c}`` references against the config root."""
    pattern = re.compile(r"\$\{([^}]+)\}")

    def lookup(path: str) -> Any:
        node: Any = cfg
        for part in path.strip().split("."):
            if not isinstance(node, dict) or part not in node:
                raise CheckpointError(f"model config: cannot resolve interpolation ${{{path}}}")
            node = node[part]
        return resolve(node, depth=1)

    def resolve(value: Any, depth: int = 0) -> Any:
        if depth > 20:
            raise CheckpointError("model config: interpolations nest too deeply (a cycle?)")
        if isinstance(value, dict):
            return {k: resolve(v, depth) for k, v in value.items()}
        if isinstance(value, list):
            return [resolve(v, depth) for v in value]
        if isinstance(value, str):
            whole = pattern.fullmatch(value)
            if whole:
                return resolve(lookup(whole.group(1)), depth + 1)
            return pattern.sub(lambda m: str(resolve(lookup(m.group(1)), depth + 1)), value)
        return value

    return resolve(cfg)


CONFIG_FILE = "model_config.yaml"  # what the errors below name: the checkpoint adds its own path


def _require(section: dict[str, Any], key: str, where: str) -> Any:
    if key not in section or section[key] is None:
        raise CheckpointError(f"model config: missing `{where}.{key}`")
    return section[key]


def _key(where: str, key: str) -> str:
    """``encoder.n_layers``; the config's top level (``model``) is left out."""
    return key if where == "model" else f"{where}.{key}"


def _mapping(value: Any, name: str) -> dict[str, Any]:
    """A section as a dict; ``encoder: [1, 2]`` ended in an AttributeError traceback."""
    if not isinstance(value, dict):
        raise CheckpointError(f"{CONFIG_FILE}: {name}: {value!r} is not a mapping of options")
    return value


def _section(parent: dict[str, Any], key: str, where: str) -> dict[str, Any]:
    """A section the model needs: missing or not a mapping, refused by name."""
    return _mapping(_require(parent, key, where), _key(where, key))


def _optional_section(parent: dict[str, Any], key: str, where: str) -> dict[str, Any]:
    """A section that may be absent or null (NeMo's defaults then); present, it must be a mapping."""
    value = parent.get(key)
    return {} if value is None else _mapping(value, _key(where, key))


def _whole(value: Any, name: str) -> int:
    """An integer option; ``n_layers: abc`` said only "invalid literal for int()", with no file or key."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, str):
        with contextlib.suppress(ValueError):
            return int(value)
    raise CheckpointError(f"{CONFIG_FILE}: {name}: {value!r} is not a whole number")


def _number(value: Any, name: str) -> float:
    if isinstance(value, (int, float, str)) and not isinstance(value, bool):
        with contextlib.suppress(ValueError):
            return float(value)
    raise CheckpointError(f"{CONFIG_FILE}: {name}: {value!r} is not a number")


def _int(section: dict[str, Any], key: str, where: str, default: Any = None) -> int:
    """``section[key]`` (or ``default`` where absent) as an int, refused by name when it is not one."""
    return _whole(section.get(key, default), _key(where, key))


def _required_int(section: dict[str, Any], key: str, where: str) -> int:
    return _whole(_require(section, key, where), _key(where, key))


def _float(section: dict[str, Any], key: str, where: str, default: Any = None) -> float:
    return _number(section.get(key, default), _key(where, key))


def _check_target(section: dict[str, Any], where: str, supported: str) -> None:
    """A section's ``_target_`` (NeMo's class), where given, must be ``supported`` under any module path: a
    Citrinet's ConvASREncoder was refused for an option it lacks, a SqueezeformerEncoder loaded as a FastConformer."""
    target = section.get("_target_")
    _check(target is None or str(target).rsplit(".", 1)[-1] == supported, f"{where}._target_", target, supported)


def _check(condition: bool, option: str, value: Any, supported: str) -> None:
    if not condition:
        raise UnsupportedModelError(f"unsupported option `{option}: {value!r}` (supported: {supported})")


# NeMo's window functions (all symmetric, periodic=False); the values themselves load from the checkpoint
WINDOWS = ("hann", "hamming", "blackman", "bartlett")
# log_zero_guard_value given by name: NeMo takes it from float32's limits
_NAMED_GUARDS = {"tiny": 1.1754943508222875e-38, "eps": 1.1920928955078125e-07}


def _samples(pre: dict[str, Any], seconds_key: str, samples_key: str, default_s: float, sr: int) -> int:
    """A window length or stride: NeMo takes it in seconds (``window_size``) or in samples (``n_window_size``)."""
    seconds, samples = pre.get(seconds_key, default_s), pre.get(samples_key)
    if seconds and samples:
        raise CheckpointError(f"model config: preprocessor sets both `{seconds_key}` and `{samples_key}`")
    if seconds:
        return int(_number(seconds, f"preprocessor.{seconds_key}") * sr)
    if samples:
        return _whole(samples, f"preprocessor.{samples_key}")
    raise CheckpointError(f"model config: preprocessor sets neither `{seconds_key}` nor `{samples_key}`")


def parse_features(pre: dict[str, Any], sample_rate: int) -> FeatureConfig:
    _check_target(pre, "preprocessor", "AudioToMelSpectrogramPreprocessor")
    sr = _int(pre, "sample_rate", "preprocessor", sample_rate)
    _check(pre.get("normalize", "per_feature") == "per_feature", "preprocessor.normalize",
           pre.get("normalize"), "per_feature")
    window = pre.get("window", "hann")
    _check(window in WINDOWS, "preprocessor.window", window, ", ".join(WINDOWS))
    _check(_int(pre, "frame_splicing", "preprocessor", 1) == 1, "preprocessor.frame_splicing",
           pre.get("frame_splicing"), "1")
    _check(pre.get("log", True) is True, "preprocessor.log", pre.get("log"), "true")
    _check(not pre.get("exact_pad", False), "preprocessor.exact_pad", pre.get("exact_pad"), "false")
    _check(pre.get("log_zero_guard_type", "add") == "add", "preprocessor.log_zero_guard_type",
           pre.get("log_zero_guard_type"), "add")
    _check(pre.get("mel_norm", "slaney") == "slaney", "preprocessor.mel_norm", pre.get("mel_norm"), "slaney")
    guard = pre.get("log_zero_guard_value", 2**-24)
    guard = _NAMED_GUARDS.get(guard, guard) if isinstance(guard, str) else guard
    _check(isinstance(guard, (int, float)), "preprocessor.log_zero_guard_value", guard,
           "a number, 'tiny' or 'eps'")
    win_length = _samples(pre, "window_size", "n_window_size", 0.02, sr)
    hop_length = _samples(pre, "window_stride", "n_window_stride", 0.01, sr)
    n_fft = _whole(pre.get("n_fft") or 2 ** (win_length - 1).bit_length(), "preprocessor.n_fft")
    # checked, not used: NeMo's transcribe() pads no frames, whatever the config asks of training (16 where it says
    # nothing). Extra frames are masked, but they moved batch shapes (bf16 rounding) and the position table's growth
    pad_to = pre.get("pad_to", 0) or 0
    _check(isinstance(pad_to, int) and pad_to >= 0, "preprocessor.pad_to", pad_to, "an integer >= 0")
    return FeatureConfig(
        sample_rate=sr,
        n_mels=_int(pre, "features", "preprocessor", 64),
        n_fft=n_fft,
        win_length=win_length,
        hop_length=hop_length,
        preemph=_number(pre.get("preemph", 0.97) or 0.0, "preprocessor.preemph"),
        window=window,
        log_guard=float(guard),
        mag_power=_float(pre, "mag_power", "preprocessor", 2.0),
        pad_value=_float(pre, "pad_value", "preprocessor", 0.0),
    )


def parse_encoder(enc: dict[str, Any]) -> EncoderConfig:
    _check_target(enc, "encoder", "ConformerEncoder")
    _check(enc.get("subsampling", "striding") == "dw_striding", "encoder.subsampling",
           enc.get("subsampling"), "dw_striding")
    factor = _int(enc, "subsampling_factor", "encoder", 4)
    _check(factor >= 2 and factor & (factor - 1) == 0, "encoder.subsampling_factor", factor, "a power of 2")
    _check(enc.get("self_attention_model", "rel_pos") == "rel_pos", "encoder.self_attention_model",
           enc.get("self_attention_model"), "rel_pos")
    context = enc.get("att_context_size")
    _check(context in (None, [-1, -1], [[-1, -1]]), "encoder.att_context_size", context, "[-1, -1] (full context)")
    _check(enc.get("conv_norm_type", "batch_norm") == "batch_norm", "encoder.conv_norm_type",
           enc.get("conv_norm_type"), "batch_norm")
    kernel = _int(enc, "conv_kernel_size", "encoder", 31)
    _check(kernel % 2 == 1, "encoder.conv_kernel_size", kernel, "an odd size")
    conv_context = enc.get("conv_context_size")
    _check(conv_context in (None, [kernel // 2, kernel // 2]), "encoder.conv_context_size", conv_context,
           f"null or [{kernel // 2}, {kernel // 2}] (symmetric)")
    _check(not enc.get("causal_downsampling", False), "encoder.causal_downsampling",
           enc.get("causal_downsampling"), "false")
    _check(enc.get("untie_biases", True) is True, "encoder.untie_biases", enc.get("untie_biases"), "true")
    _check(_int(enc, "feat_out", "encoder", -1) == -1, "encoder.feat_out", enc.get("feat_out"), "-1")
    _check(enc.get("reduction") is None, "encoder.reduction", enc.get("reduction"), "null")
    # NeMo's chunking splits large batches through the subsampling convolutions to save memory; the result is
    # the same, and batchasr bounds its batches itself
    chunking = _int(enc, "subsampling_conv_chunking_factor", "encoder", 1)
    _check(chunking in (1, -1) or (chunking > 1 and chunking & (chunking - 1) == 0),
           "encoder.subsampling_conv_chunking_factor", chunking, "1, -1 or a power of 2")
    d_model = _required_int(enc, "d_model", "encoder")
    n_heads = _int(enc, "n_heads", "encoder", 4)
    _check(n_heads > 0, "encoder.n_heads", n_heads, "a divisor of d_model")
    _check(d_model % n_heads == 0, "encoder.n_heads", n_heads, "a divisor of d_model")
    channels = _int(enc, "subsampling_conv_channels", "encoder", -1)
    return EncoderConfig(
        feat_in=_required_int(enc, "feat_in", "encoder"),
        d_model=d_model,
        n_layers=_required_int(enc, "n_layers", "encoder"),
        n_heads=n_heads,
        ff_expansion=_int(enc, "ff_expansion_factor", "encoder", 4),
        conv_kernel_size=kernel,
        subsampling_factor=factor,
        subsampling_channels=d_model if channels == -1 else channels,
        xscaling=bool(enc.get("xscaling", True)),
        use_bias=bool(enc.get("use_bias", True)),
        pos_emb_max_len=_int(enc, "pos_emb_max_len", "encoder", 5000),
    )


def parse_transducer(cfg: dict[str, Any]) -> TransducerConfig:
    dec = _section(cfg, "decoder", "model")
    joint = _section(cfg, "joint", "model")
    prednet = _section(dec, "prednet", "decoder")
    _check(dec.get("blank_as_pad", True) is True, "decoder.blank_as_pad", dec.get("blank_as_pad"), "true")
    _check(dec.get("normalization_mode") is None, "decoder.normalization_mode",
           dec.get("normalization_mode"), "null")
    _check(prednet.get("rnn_hidden_size", -1) in (None, -1), "decoder.prednet.rnn_hidden_size",
           prednet.get("rnn_hidden_size"), "unset (no projection)")
    _check(str(dec.get("_target_", "RNNTDecoder")).endswith("RNNTDecoder"), "decoder._target_",
           dec.get("_target_"), "RNNTDecoder")
    jointnet = _section(joint, "jointnet", "joint")
    activation = str(jointnet.get("activation", "relu")).lower()
    _check(activation in ("relu", "tanh", "sigmoid"), "joint.jointnet.activation", activation,
           "relu, tanh, sigmoid")
    vocab_size = _required_int(dec, "vocab_size", "decoder")
    extra = _whole(joint.get("num_extra_outputs") or 0, "joint.num_extra_outputs")
    decoding = _optional_section(cfg, "decoding", "model")
    durations: tuple[int, ...] = ()
    if extra or decoding.get("model_type") == "tdt":
        loss = _optional_section(cfg, "loss", "model")
        loss_durations = _optional_section(loss, "tdt_kwargs", "loss").get("durations")
        # NeMo overwrites the decoding's durations with the loss's when the loss is TDT's
        from_loss = loss.get("loss_name") == "tdt" and loss_durations
        chosen = loss_durations if from_loss else decoding.get("durations")
        durations = _durations(chosen or loss_durations or [],
                               "loss.tdt_kwargs.durations" if from_loss or not chosen else "decoding.durations")
        _check(len(durations) == extra and extra > 0, "joint.num_extra_outputs", extra,
               f"the number of TDT durations ({len(durations)})")
        _check(min(durations) >= 0, "decoding.durations", list(durations), "non-negative")
    greedy = _optional_section(decoding, "greedy", "decoding")
    # Unset means no cap to NeMo's eager decoder; its CUDA-graph decoder, the one that runs on GPUs, caps it at 10
    symbols_key = "max_symbols" if greedy.get("max_symbols") else "max_symbols_per_step"
    max_symbols = greedy.get(symbols_key)
    return TransducerConfig(
        vocab_size=vocab_size,
        pred_hidden=_required_int(prednet, "pred_hidden", "decoder.prednet"),
        pred_layers=_int(prednet, "pred_rnn_layers", "decoder.prednet", 1),
        joint_hidden=_required_int(jointnet, "joint_hidden", "joint.jointnet"),
        joint_activation=activation,
        joint_dropout=_number(jointnet.get("dropout") or 0.0, "joint.jointnet.dropout"),
        durations=durations,
        max_symbols=10 if max_symbols is None else _whole(max_symbols, f"decoding.greedy.{symbols_key}"),
    )


def _durations(value: Any, name: str) -> tuple[int, ...]:
    if not isinstance(value, (list, tuple)):
        raise CheckpointError(f"{CONFIG_FILE}: {name}: {value!r} is not a list of whole numbers")
    return tuple(_whole(d, name) for d in value)


def parse_ctc(section: dict[str, Any], where: str) -> CTCConfig:
    _check(str(section.get("_target_", "ConvASRDecoder")).endswith("ConvASRDecoder"), f"{where}._target_",
           section.get("_target_"), "ConvASRDecoder")
    num_classes = _required_int(section, "num_classes", where)
    vocabulary = section.get("vocabulary") or []
    if num_classes == -1:
        if not isinstance(vocabulary, list):
            raise CheckpointError(f"{CONFIG_FILE}: {where}.vocabulary: {vocabulary!r} is not a list")
        num_classes = len(vocabulary)
    return CTCConfig(vocab_size=num_classes, feat_in=_required_int(section, "feat_in", where))


def _warn_about_decoding(cfg: dict[str, Any]) -> None:
    """batchasr decodes greedily; a checkpoint saved with beam search or a language model decodes differently."""
    aux = _optional_section(cfg, "aux_ctc", "model")
    for where, decoding in (("decoding", _optional_section(cfg, "decoding", "model")),
                            ("aux_ctc.decoding", _optional_section(aux, "decoding", "aux_ctc"))):
        strategy = decoding.get("strategy", "greedy_batch")
        if strategy not in ("greedy", "greedy_batch"):
            log.warning("the checkpoint's `%s.strategy: %s` is not used: batchasr decodes greedily", where, strategy)


def parse_model_config(cfg: dict[str, Any]) -> ModelConfig:
    """Build a ``ModelConfig`` from a NeMo config dict, refusing what batchasr does not compute."""
    if "model" in cfg and isinstance(cfg["model"], dict) and "encoder" in cfg["model"]:
        cfg = cfg["model"]
    cfg = resolve_interpolations(cfg)
    target = str(cfg.get("target") or "")
    class_name = target.rsplit(".", 1)[-1]
    if class_name in _CHARACTER_CLASSES:
        raise UnsupportedModelError(f"unsupported architecture `target: {target}`: character-vocabulary "
                                    "models are not supported (supported: the BPE classes)")
    if class_name not in _TARGET_KINDS:
        known = ", ".join(sorted(_TARGET_KINDS))
        raise UnsupportedModelError(f"unsupported architecture `target: {target or None}` (supported: {known})")
    kind = _TARGET_KINDS[class_name]
    _warn_about_decoding(cfg)
    tokenizer = _optional_section(cfg, "tokenizer", "model")
    _check(tokenizer.get("type", "bpe") == "bpe", "tokenizer.type", tokenizer.get("type"), "bpe")
    encoder = parse_encoder(_section(cfg, "encoder", "model"))  # first: its _target_ says what the model is
    features = parse_features(_section(cfg, "preprocessor", "model"), _int(cfg, "sample_rate", "model", 16000))
    if encoder.feat_in != features.n_mels:
        raise CheckpointError(
            f"model config: encoder.feat_in ({encoder.feat_in}) != preprocessor.features ({features.n_mels})"
        )
    if kind == "ctc":
        ctc = parse_ctc(_section(cfg, "decoder", "model"), "decoder")
        return ModelConfig(kind=kind, features=features, encoder=encoder, ctc=ctc)
    transducer = parse_transducer(cfg)
    if kind == "transducer":
        return ModelConfig(kind=kind, features=features, encoder=encoder, transducer=transducer)
    aux = _section(cfg, "aux_ctc", "model")
    ctc = parse_ctc(_section(aux, "decoder", "aux_ctc"), "aux_ctc.decoder")
    if ctc.vocab_size != transducer.vocab_size:
        raise CheckpointError("model config: aux_ctc vocabulary size differs from the transducer's")
    return ModelConfig(kind=kind, features=features, encoder=encoder, transducer=transducer, ctc=ctc,
                       ctc_prefix="ctc_decoder")
