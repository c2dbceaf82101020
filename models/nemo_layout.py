"""Model configs in NeMo's layout, written from a model's shape: the sections ``config.parse_model_config`` reads.

The built-in architectures (random weights) and the trained default model's export both write their configs
here, so neither can drift from the parser or from the other.
"""

from __future__ import annotations

from typing import Any, Literal

TDT_DURATIONS = (0, 1, 2, 3, 4)

ModelKind = Literal["ctc", "rnnt", "tdt", "hybrid_tdt_ctc"]
_TARGETS = {
    "ctc": "ctc_bpe_models.EncDecCTCModelBPE",
    "rnnt": "rnnt_bpe_models.EncDecRNNTBPEModel",
    "tdt": "rnnt_bpe_models.EncDecRNNTBPEModel",
    "hybrid_tdt_ctc": "hybrid_rnnt_ctc_bpe_models.EncDecHybridRNNTCTCBPEModel",
}


def nemo_config(kind: ModelKind, *, vocab_size: int, n_mels: int, d_model: int, n_layers: int, n_heads: int = 8,
                conv_kernel: int = 9, subsampling_channels: int = 256, xscaling: bool = True, use_bias: bool = True,
                pred_hidden: int = 640, pred_layers: int = 1, joint_hidden: int = 640,
                vocabulary: list[str] | None = None) -> dict[str, Any]:
    """A FastConformer ASR model's config: 80 ms frames, dw_striding 8x, rel-pos attention, greedy decoding.

    ``vocabulary`` (the tokenizer's pieces) is written where NeMo keeps it; without it only sizes are given.
    """
    words = {"vocabulary": list(vocabulary)} if vocabulary is not None else {}  # copies: no YAML anchors
    cfg: dict[str, Any] = {
        "target": f"nemo.collections.asr.models.{_TARGETS[kind]}",
        "sample_rate": 16000,
        # NeMo's transcribe() reads options from here; no data set is named
        "validation_ds": {"manifest_filepath": None, "sample_rate": 16000, "batch_size": 4, "shuffle": False,
                          "use_start_end_token": False},
        "preprocessor": {"_target_": "nemo.collections.asr.modules.AudioToMelSpectrogramPreprocessor",
                         "sample_rate": 16000, "normalize": "per_feature", "window_size": 0.025,
                         "window_stride": 0.01, "window": "hann", "features": n_mels, "n_fft": 512, "log": True,
                         "frame_splicing": 1, "dither": 1e-5, "pad_to": 0, "pad_value": 0.0},
        "encoder": {"_target_": "nemo.collections.asr.modules.ConformerEncoder", "feat_in": n_mels,
                    "feat_out": -1, "n_layers": n_layers, "d_model": d_model, "subsampling": "dw_striding",
                    "subsampling_factor": 8, "subsampling_conv_channels": subsampling_channels,
                    "causal_downsampling": False, "ff_expansion_factor": 4, "self_attention_model": "rel_pos",
                    "n_heads": n_heads, "att_context_size": [-1, -1], "xscaling": xscaling, "untie_biases": True,
                    "pos_emb_max_len": 5000, "conv_kernel_size": conv_kernel, "conv_norm_type": "batch_norm",
                    "conv_context_size": None, "use_bias": use_bias,
                    "dropout": 0.0, "dropout_pre_encoder": 0.0, "dropout_emb": 0.0, "dropout_att": 0.0},
    }
    ctc_decoder = {"_target_": "nemo.collections.asr.modules.ConvASRDecoder", "feat_in": d_model,
                   "num_classes": vocab_size, **words}
    if kind == "ctc":
        cfg["decoder"] = ctc_decoder
        return cfg
    tdt = kind in ("tdt", "hybrid_tdt_ctc")
    cfg["decoder"] = {"_target_": "nemo.collections.asr.modules.RNNTDecoder", "normalization_mode": None,
                      "random_state_sampling": False, "blank_as_pad": True, "vocab_size": vocab_size,
                      "prednet": {"pred_hidden": pred_hidden, "pred_rnn_layers": pred_layers, "t_max": None,
                                  "dropout": 0.0}}
    cfg["joint"] = {"_target_": "nemo.collections.asr.modules.RNNTJoint", "log_softmax": None,
                    "preserve_memory": False, "fuse_loss_wer": False, "num_classes": vocab_size,
                    "num_extra_outputs": len(TDT_DURATIONS) if tdt else 0, **words,
                    "jointnet": {"joint_hidden": joint_hidden, "activation": "relu", "dropout": 0.0,
                                 "encoder_hidden": d_model, "pred_hidden": pred_hidden}}
    # NeMo's transducer classes copy these sizes into the decoder and joint when they are built
    cfg["model_defaults"] = {"enc_hidden": d_model, "pred_hidden": pred_hidden, "joint_hidden": joint_hidden,
                             **({"tdt_durations": list(TDT_DURATIONS)} if tdt else {})}
    cfg["decoding"] = {"strategy": "greedy_batch", "greedy": {"max_symbols": 10}}
    if tdt:
        cfg["decoding"].update(model_type="tdt", durations=list(TDT_DURATIONS))
    if kind == "hybrid_tdt_ctc":
        cfg["aux_ctc"] = {"decoder": ctc_decoder, "decoding": {"strategy": "greedy_batch"}}
    return cfg
