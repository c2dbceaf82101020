"""Reading .nemo checkpoints: archive forms, and a clear error for every way a checkpoint can be bad."""

from __future__ import annotations

import gzip
import io
import tarfile
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from models import CheckpointError, UnsupportedModelError, load_model
from models.asr_model import DEFAULT_MODEL
from models.checkpoint import open_checkpoint
from models.config import parse_model_config
from models.training.export import save_nemo


def _members(nemo: Path) -> dict[str, bytes]:
    with tarfile.open(nemo) as tar:
        return {m.name: tar.extractfile(m).read() for m in tar.getmembers() if m.isfile()}


def _write_tar(path: Path, members: dict[str, bytes], extra: list[tarfile.TarInfo] = ()) -> Path:
    with tarfile.open(path, "w") as tar:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
        for info in extra:
            tar.addfile(info)
    return path


def _with_config(members: dict[str, bytes], edit) -> dict[str, bytes]:
    key = next(k for k in members if k.endswith("model_config.yaml"))
    cfg = yaml.safe_load(members[key])
    edit(cfg)
    return {**members, key: yaml.safe_dump(cfg).encode()}


@pytest.fixture
def tdt_members(parity_dir) -> dict[str, bytes]:
    return _members(parity_dir / "tdt.nemo")


@pytest.fixture
def audio(parity_audio) -> str:
    return parity_audio[0]


def test_plain_gzipped_and_unpacked_forms_give_the_same_output(parity_dir, tdt_members, tmp_path, audio):
    reference = load_model(parity_dir / "tdt.nemo", device="cpu").transcribe([audio])[0]
    gz = tmp_path / "tdt.nemo"
    gz.write_bytes(gzip.compress((parity_dir / "tdt.nemo").read_bytes()))
    unpacked = tmp_path / "unpacked"
    with tarfile.open(parity_dir / "tdt.nemo") as tar:
        tar.extractall(unpacked, filter="data")
    for source in (gz, unpacked):
        got = load_model(source, device="cpu").transcribe([audio])[0]
        assert (got.tokens, got.token_frames, got.text) == (reference.tokens, reference.token_frames,
                                                            reference.text)


def test_config_with_model_key_and_interpolations(tdt_members, tmp_path, audio, parity_dir):
    def edit(cfg):
        cfg["encoder"]["d_model"] = "${model_defaults.enc_hidden}"
    members = _with_config(tdt_members, edit)
    key = next(k for k in members if k.endswith("model_config.yaml"))
    members[key] = yaml.safe_dump({"model": yaml.safe_load(members[key])}).encode()
    model = load_model(_write_tar(tmp_path / "m.nemo", members), device="cpu")
    assert model.config.encoder.d_model == 96


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda tmp, m: tmp / "absent.nemo", "no such file or directory"),
        (lambda tmp, m: "parakeet-rnnt-1.1b", "no such file or directory (a built-in architecture: `batchasr bench "
         "--model` takes it, with random weights)"),
        (lambda tmp, m: _bytes(tmp, np.random.default_rng(0).bytes(4096)), "not a .nemo archive"),
        (lambda tmp, m: _bytes(tmp, b""), "truncated"),
        (lambda tmp, m: _bytes(tmp, _tar_bytes(m)[: len(_tar_bytes(m)) // 2]), "truncated"),
        (lambda tmp, m: _write_tar(tmp / "x.nemo", _without(m, "model_weights.ckpt")),
         "missing weights: `model_weights.ckpt`"),
        (lambda tmp, m: _write_tar(tmp / "x.nemo", _without(m, "model_config.yaml")),
         "`model_config.yaml` is missing"),
        (lambda tmp, m: _write_tar(tmp / "x.nemo", _without(m, "_tokenizer.model")),
         "tokenizer file"),
        (lambda tmp, m: _write_tar(tmp / "x.nemo", _replace(m, "model_weights.ckpt", b"garbage")),
         "not a readable torch state dict"),
        (lambda tmp, m: _write_tar(tmp / "x.nemo", _replace(m, "model_config.yaml", b"a: [b")),
         "not valid YAML"),
    ],
    ids=["missing-file", "architecture-name", "not-an-archive", "empty-file", "truncated", "missing-weights",
         "missing-config", "missing-tokenizer", "corrupt-weights", "corrupt-config"],
)
def test_bad_checkpoint_errors(tmp_path, tdt_members, make, message):
    with pytest.raises(CheckpointError, match=_literal(message)):
        load_model(make(tmp_path, tdt_members), device="cpu")


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda c: c.update(target="nemo.collections.asr.models.EncDecMultiTaskModel"),
         "unsupported architecture `target: nemo.collections.asr.models.EncDecMultiTaskModel`"),
        (lambda c: c.update(target="nemo.collections.asr.models.rnnt_models.EncDecRNNTModel"),
         "character-vocabulary models are not supported"),
        (lambda c: c["encoder"].update(self_attention_model="rel_pos_local_attn"),
         "unsupported option `encoder.self_attention_model: 'rel_pos_local_attn'`"),
        (lambda c: c["encoder"].update(subsampling="striding"), "unsupported option `encoder.subsampling"),
        (lambda c: c["encoder"].update(att_context_size=[70, 1]), "unsupported option `encoder.att_context_size"),
        (lambda c: c["encoder"].update(conv_norm_type="layer_norm"), "unsupported option `encoder.conv_norm_type"),
        (lambda c: c["preprocessor"].update(normalize="all_features"),
         "unsupported option `preprocessor.normalize: 'all_features'`"),
        (lambda c: c["decoder"].update(blank_as_pad=False), "unsupported option `decoder.blank_as_pad: False`"),
        (lambda c: c["joint"]["jointnet"].update(activation="gelu"), "unsupported option `joint.jointnet.activation"),
        (lambda c: c["joint"].update(num_extra_outputs=3), "unsupported option `joint.num_extra_outputs: 3`"),
        # a Citrinet's or QuartzNet's encoder was refused for an option it lacks; a Squeezeformer's loaded
        (lambda c: c["encoder"].update(_target_="nemo.collections.asr.modules.ConvASREncoder"),
         "unsupported option `encoder._target_: 'nemo.collections.asr.modules.ConvASREncoder'` "
         "(supported: ConformerEncoder)"),
        (lambda c: c["encoder"].update(_target_="nemo.collections.asr.modules.SqueezeformerEncoder"),
         "unsupported option `encoder._target_: 'nemo.collections.asr.modules.SqueezeformerEncoder'`"),
        (lambda c: c["preprocessor"].update(_target_="nemo.collections.asr.modules.AudioToMFCCPreprocessor"),
         "unsupported option `preprocessor._target_: 'nemo.collections.asr.modules.AudioToMFCCPreprocessor'` "
         "(supported: AudioToMelSpectrogramPreprocessor)"),
    ],
)
def test_unsupported_architecture_and_options_are_named(tmp_path, tdt_members, edit, message):
    path = _write_tar(tmp_path / "x.nemo", _with_config(tdt_members, edit))
    with pytest.raises(UnsupportedModelError, match=_literal(message)):
        open_checkpoint(path)


def _no_decoding_durations(cfg):
    del cfg["decoding"]["durations"]


def _no_targets(cfg):
    del cfg["encoder"]["_target_"], cfg["preprocessor"]["_target_"]


@pytest.mark.parametrize(
    "edit",
    [
        lambda c: c["encoder"].update(conv_context_size=[4, 4]),  # kernel 9: what null means
        lambda c: c["encoder"].update(att_context_size=[[-1, -1]]),
        lambda c: c["encoder"].update(subsampling_conv_chunking_factor=4),  # splits big batches, same result
        lambda c: c["preprocessor"].update(window_size=None, n_window_size=400, window_stride=None,
                                           n_window_stride=160),
        lambda c: c["preprocessor"].update(window="hamming"),  # the window's values load from the weights
        _no_decoding_durations,  # the loss's durations serve
        lambda c: c["decoding"].update(strategy="beam"),  # logged, decoded greedily
        lambda c: c["encoder"].update(_target_="nemo.collections.asr.modules.conformer_encoder.ConformerEncoder"),
        _no_targets,  # nothing said: the sections are read as the classes batchasr computes
    ],
    ids=["conv-context", "att-context-list", "chunking", "window-in-samples", "hamming", "loss-durations",
         "beam-strategy", "encoder-module-path", "no-targets"],
)
def test_other_spellings_nemo_saves_load_the_same_model(tmp_path, tdt_members, parity_dir, audio, edit):
    reference = load_model(parity_dir / "tdt.nemo", device="cpu").transcribe([audio])[0]
    model = load_model(_write_tar(tmp_path / "x.nemo", _with_config(tdt_members, edit)), device="cpu")
    got = model.transcribe([audio])[0]
    assert (got.tokens, got.token_frames) == (reference.tokens, reference.token_frames)


def test_config_values_nemo_reads_in_its_own_order(tdt_members, caplog):
    key = next(k for k in tdt_members if k.endswith("model_config.yaml"))
    base = yaml.safe_load(tdt_members[key])

    def parse(edit):
        cfg = yaml.safe_load(yaml.safe_dump(base))
        edit(cfg)
        return parse_model_config(cfg)

    # a TDT loss's durations overwrite the decoding's, as NeMo's set_decoding_type_according_to_loss does
    assert parse(lambda c: c["loss"]["tdt_kwargs"].update(durations=[0, 1, 2, 4, 8])).transducer.durations == \
        (0, 1, 2, 4, 8)
    assert parse(lambda c: c["preprocessor"].update(log_zero_guard_value="tiny")).features.log_guard == \
        torch.finfo(torch.float32).tiny
    assert parse(lambda c: c["preprocessor"].update(log_zero_guard_value="eps")).features.log_guard == \
        torch.finfo(torch.float32).eps
    window = parse(lambda c: c["preprocessor"].update(window_size=None, n_window_size=512, window_stride=None,
                                                      n_window_stride=128)).features
    assert (window.win_length, window.hop_length) == (512, 128)
    # unset: NeMo's CUDA-graph decoder caps it at 10
    assert parse(lambda c: c["decoding"]["greedy"].update(max_symbols=None)).transducer.max_symbols == 10
    with caplog.at_level("WARNING", logger="models.config"):
        parse(lambda c: c["decoding"].update(strategy="maes"))
    assert "`decoding.strategy: maes` is not used: batchasr decodes greedily" in caplog.text


@pytest.mark.parametrize(
    ("edit", "error", "message"),
    [
        (lambda c: c["preprocessor"].update(n_window_size=400), CheckpointError,
         "sets both `window_size` and `n_window_size`"),
        (lambda c: c["preprocessor"].update(window_stride=None), CheckpointError,
         "sets neither `window_stride` nor `n_window_stride`"),
        (lambda c: c["preprocessor"].update(pad_to="max"), UnsupportedModelError,
         "unsupported option `preprocessor.pad_to: 'max'`"),
        (lambda c: c["preprocessor"].update(window="kaiser"), UnsupportedModelError,
         "unsupported option `preprocessor.window: 'kaiser'` (supported: hann, hamming, blackman, bartlett)"),
        (lambda c: c["encoder"].update(conv_context_size=[8, 0]), UnsupportedModelError,
         "unsupported option `encoder.conv_context_size: [8, 0]`"),
        (lambda c: c["encoder"].update(subsampling_conv_chunking_factor=3), UnsupportedModelError,
         "unsupported option `encoder.subsampling_conv_chunking_factor: 3`"),
        # an AttributeError, or "invalid literal for int()" naming neither the file nor the key
        (lambda c: c.update(encoder=[1, 2]), CheckpointError, "model_config.yaml: encoder: [1, 2] is not a mapping"),
        (lambda c: c["joint"].update(jointnet="relu"), CheckpointError,
         "model_config.yaml: joint.jointnet: 'relu' is not a mapping"),
        (lambda c: c.update(decoding=[]), CheckpointError, "model_config.yaml: decoding: [] is not a mapping"),
        (lambda c: c["encoder"].update(n_layers="abc"), CheckpointError,
         "model_config.yaml: encoder.n_layers: 'abc' is not a whole number"),
        (lambda c: c["encoder"].update(d_model=[96]), CheckpointError,
         "model_config.yaml: encoder.d_model: [96] is not a whole number"),
        (lambda c: c["decoder"]["prednet"].update(pred_rnn_layers=1.5), CheckpointError,
         "model_config.yaml: decoder.prednet.pred_rnn_layers: 1.5 is not a whole number"),
        (lambda c: c["preprocessor"].update(window_size="wide"), CheckpointError,
         "model_config.yaml: preprocessor.window_size: 'wide' is not a number"),
        (lambda c: c["loss"]["tdt_kwargs"].update(durations=4), CheckpointError,
         "model_config.yaml: loss.tdt_kwargs.durations: 4 is not a list of whole numbers"),
    ],
)
def test_config_values_that_cannot_be_read_are_named(tdt_members, edit, error, message):
    key = next(k for k in tdt_members if k.endswith("model_config.yaml"))
    cfg = yaml.safe_load(tdt_members[key])
    edit(cfg)
    with pytest.raises(error, match=_literal(message)):
        parse_model_config(cfg)


def test_weights_that_do_not_fit_the_config(tmp_path, tdt_members):
    path = _write_tar(tmp_path / "x.nemo", _with_config(tdt_members, lambda c: c["encoder"].update(n_layers=2)))
    with pytest.raises(CheckpointError, match=r"weights do not match the config; missing: encoder\.layers\.1"):
        load_model(path, device="cpu")


def _link(name: str, kind: bytes, target: str) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type, info.linkname = kind, target
    return info


@pytest.mark.parametrize(
    ("bad_name", "extra", "message"),
    [
        ("../escape.txt", [], "escapes the archive"),
        ("/etc/escape.txt", [], "escapes the archive"),
        ("./a/../../escape.txt", [], "escapes the archive"),
        (None, [_link("./evil", tarfile.SYMTYPE, "/etc/passwd")], "is a link; refused"),
        (None, [_link("./evil", tarfile.LNKTYPE, "model_config.yaml")], "is a link; refused"),
        (None, [_link("./fifo", tarfile.FIFOTYPE, "")], "is not a regular file; refused"),
    ],
)
def test_members_escaping_the_archive_are_refused(tmp_path, tdt_members, bad_name, extra, message):
    members = dict(tdt_members)
    if bad_name:
        members[bad_name] = b"x"
    with pytest.raises(CheckpointError, match=_literal(message)):
        open_checkpoint(_write_tar(tmp_path / "x.nemo", members, extra))


def test_unpacked_directory_refuses_a_tokenizer_path_outside_it(tmp_path, tdt_members):
    root = tmp_path / "ckpt"
    root.mkdir()
    members = _with_config(tdt_members, lambda c: c["tokenizer"].update(model_path="nemo:../../secret.model"))
    for name, data in members.items():
        (root / Path(name).name).write_bytes(data)
    (tmp_path / "secret.model").write_bytes(b"x")
    with pytest.raises(CheckpointError, match=r"tokenizer file `secret\.model`"):
        open_checkpoint(root)


def test_a_config_that_cannot_be_read_is_named_with_the_file(tmp_path, tdt_members):
    path = _write_tar(tmp_path / "x.nemo", _with_config(tdt_members, lambda c: c["encoder"].update(n_layers="abc")))
    with pytest.raises(CheckpointError) as caught:
        load_model(path, device="cpu")
    assert str(caught.value) == f"{path}: model_config.yaml: encoder.n_layers: 'abc' is not a whole number"


def _damaged(members: dict[str, bytes]) -> dict[str, bytes]:
    """64 bytes flipped in the middle of the weights, the size intact: what a bad disk or download leaves."""
    key = next(k for k in members if k.endswith("model_weights.ckpt"))
    weights = bytearray(members[key])
    middle = len(weights) // 2
    for i in range(middle, middle + 64):
        weights[i] ^= 0xFF
    return {**members, key: bytes(weights)}


def test_damaged_weights_are_refused_naming_the_member_whose_crc_fails(tmp_path, parity_dir):
    """torch.load does not check the weights' zip CRCs: the model loaded and transcribed garbage."""
    path = _write_tar(tmp_path / "damaged.nemo", _damaged(_members(parity_dir / "ctc.nemo")))
    with pytest.raises(CheckpointError, match=r"`model_weights\.ckpt` is damaged: its member "
                                              r"`model_weights/data/\d+` fails its CRC check"):
        load_model(path, device="cpu")


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_weights_that_are_not_finite_are_refused_naming_the_tensor(tmp_path, tdt_members, bad):
    key = next(k for k in tdt_members if k.endswith("model_weights.ckpt"))
    state = torch.load(io.BytesIO(tdt_members[key]), weights_only=True)
    state["encoder.layers.0.feed_forward1.linear1.weight"][3, 4] = bad
    buffer = io.BytesIO()
    torch.save(state, buffer)
    path = _write_tar(tmp_path / "x.nemo", {**tdt_members, key: buffer.getvalue()})
    with pytest.raises(CheckpointError, match=r"holds NaN or infinite values in "
                                              r"`encoder\.layers\.0\.feed_forward1\.linear1\.weight`"):
        load_model(path, device="cpu")


@pytest.mark.parametrize("edit", [lambda c: c.pop("tokenizer"), lambda c: c["tokenizer"].pop("model_path")],
                         ids=["no-tokenizer-section", "no-model-path"])
def test_a_checkpoint_without_a_tokenizer_is_refused(tmp_path, tdt_members, edit):
    """It loaded, and every transcript was "" with exit status 0."""
    path = _write_tar(tmp_path / "x.nemo", _with_config(tdt_members, edit))
    with pytest.raises(CheckpointError, match=r"names no tokenizer \(tokenizer\.model_path\)"):
        load_model(path, device="cpu")


def _unpack(members: dict[str, bytes], folder: Path) -> Path:
    folder.mkdir(parents=True)
    for name, data in members.items():
        (folder / Path(name).name).write_bytes(data)
    return folder


def test_a_blank_model_name_is_the_default_model_not_the_working_directory(tmp_path, tdt_members, monkeypatch):
    """``Path("")`` is ".": ``--model ""`` loaded whatever checkpoint lay anywhere under the working directory."""
    _unpack(tdt_members, tmp_path / "somewhere" / "deep")
    monkeypatch.chdir(tmp_path)
    default = open_checkpoint(DEFAULT_MODEL).config
    for blank in ("", "  "):
        assert load_model(blank, device="cpu").config == default


def test_an_unpacked_directory_is_read_at_its_top_or_its_one_folder_not_throughout(tmp_path, tdt_members):
    top = _unpack(tdt_members, tmp_path / "top")
    _unpack(tdt_members, tmp_path / "wrapped" / "tdt")  # a .nemo unpacked with its ./ as a folder
    _unpack(tdt_members, tmp_path / "deep" / "a" / "b")
    assert open_checkpoint(top).config == open_checkpoint(tmp_path / "wrapped").config
    with pytest.raises(CheckpointError, match=_literal("`model_config.yaml` is missing")):
        open_checkpoint(tmp_path / "deep")
    _unpack(tdt_members, tmp_path / "wrapped" / "other")  # which one? neither is guessed
    with pytest.raises(CheckpointError, match=_literal("`model_config.yaml` is missing")):
        open_checkpoint(tmp_path / "wrapped")


# --- helpers ---------------------------------------------------------------------------------------------


def _literal(text: str) -> str:
    import re

    return re.escape(text)


def _bytes(tmp: Path, data: bytes) -> Path:
    path = tmp / "x.nemo"
    path.write_bytes(data)
    return path


def _tar_bytes(members: dict[str, bytes]) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buffer.getvalue()


def _without(members: dict[str, bytes], suffix: str) -> dict[str, bytes]:
    return {k: v for k, v in members.items() if not k.endswith(suffix)}


def _replace(members: dict[str, bytes], suffix: str, data: bytes) -> dict[str, bytes]:
    return {k: (data if k.endswith(suffix) else v) for k, v in members.items()}


def test_a_joint_without_dropout_has_its_output_layer_at_nemos_index(tdt_members, tmp_path, audio, parity_dir):
    """NeMo adds the joint's dropout layer only when the config has one: without it the output is joint_net.1."""
    reference = load_model(parity_dir / "tdt.nemo", device="cpu").transcribe([audio])[0]
    members = _with_config(tdt_members, lambda cfg: cfg["joint"]["jointnet"].update(dropout=0.0))
    weights_key = next(k for k in members if k.endswith("model_weights.ckpt"))
    state = torch.load(io.BytesIO(members[weights_key]), weights_only=True)
    state = {k.replace("joint.joint_net.2.", "joint.joint_net.1."): v for k, v in state.items()}
    buffer = io.BytesIO()
    torch.save(state, buffer)
    path = _write_tar(tmp_path / "no_dropout.nemo", {**members, weights_key: buffer.getvalue()})
    got = load_model(path, device="cpu").transcribe([audio])[0]
    assert (got.tokens, got.token_frames) == (reference.tokens, reference.token_frames)
    with pytest.raises(CheckpointError, match=r"unexpected: joint\.joint_net\.2\.weight"):
        load_model(_write_tar(tmp_path / "mismatch.nemo", members), device="cpu")


def test_an_exported_model_has_what_nemos_loader_asks_for(tmp_path):
    """NeMo's restore_from builds the model from the config before loading weights: the transducer classes
    read ``model_defaults``, the BPE tokenizer setup needs all three tokenizer files, and transcribe() reads
    ``validation_ds``. (Checked with NeMo 3.0 itself on the default model: docs/benchmarks.md.)"""
    source = open_checkpoint(DEFAULT_MODEL)
    model = load_model(DEFAULT_MODEL, device="cpu", dtype="float32")
    path = tmp_path / "exported.nemo"
    save_nemo(model, source.raw_config, source.tokenizer_model, path)
    members = {name.removeprefix("./"): data for name, data in _members(path).items()}
    cfg = yaml.safe_load(members["model_config.yaml"])
    assert {"enc_hidden", "pred_hidden", "joint_hidden", "tdt_durations"} <= set(cfg["model_defaults"])
    assert cfg["validation_ds"]["manifest_filepath"] is None
    for field in ("model_path", "vocab_path", "spe_tokenizer_vocab"):
        assert cfg["tokenizer"][field].removeprefix("nemo:") in members, field
    vocab = members[cfg["tokenizer"]["vocab_path"].removeprefix("nemo:")].decode().splitlines()
    assert len(vocab) == model.config.vocab_size - 1 and "<unk>" not in vocab  # every piece but <unk>
    assert cfg["joint"]["jointnet"]["dropout"] == 0.0
    state = torch.load(io.BytesIO(members["model_weights.ckpt"]), weights_only=True)
    assert "joint.joint_net.1.weight" in state and "joint.joint_net.2.weight" not in state
    again = load_model(path, device="cpu", dtype="float32")
    assert all(torch.equal(again.state_dict()[k], v) for k, v in model.state_dict().items())
