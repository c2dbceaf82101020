"""Output heads: CTC, and the transducer prediction network and joint (RNN-T and TDT).

The joint is split the way fast decoding needs it: ``project_encoder`` runs once over all encoder frames,
``project_prediction`` once per prediction-network step, and ``joint_after_projection`` (add, activation,
output layer) is all that runs per decoding step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from .config import CTCConfig, TransducerConfig


class CTCHead(nn.Module):
    """NeMo ``ConvASRDecoder``: a kernel-1 Conv1d to V+1 classes (blank last), log-softmax."""

    def __init__(self, cfg: CTCConfig):
        super().__init__()
        self.blank_id = cfg.vocab_size
        self.decoder_layers = nn.Sequential(nn.Conv1d(cfg.feat_in, cfg.vocab_size + 1, kernel_size=1))

    def forward(self, encoded: Tensor) -> Tensor:
        """(B, T, d) -> (B, T, V+1) log-probabilities."""
        logits = self.decoder_layers(encoded.transpose(1, 2)).transpose(1, 2)
        return torch.log_softmax(logits, dim=-1)


@dataclass
class PredictionState:
    """LSTM state for a batch: h and c, each (n_layers, B, H)."""

    h: Tensor
    c: Tensor


class _LSTMDropout(nn.Module):
    """Holds the LSTM under the name NeMo uses (``dec_rnn.lstm``)."""

    def __init__(self, hidden: int, n_layers: int):
        super().__init__()
        self.lstm = nn.LSTM(hidden, hidden, num_layers=n_layers)


class _Prediction(nn.Module):
    def __init__(self, vocab_size: int, hidden: int, n_layers: int):
        super().__init__()
        self.embed = nn.Embedding(vocab_size + 1, hidden, padding_idx=vocab_size)  # blank embeds to zeros
        self.dec_rnn = _LSTMDropout(hidden, n_layers)


class PredictionNetwork(nn.Module):
    """NeMo ``RNNTDecoder`` with ``blank_as_pad``: embedding + LSTM; the start symbol is the blank id."""

    def __init__(self, cfg: TransducerConfig):
        super().__init__()
        self.blank_id = cfg.vocab_size
        self.hidden = cfg.pred_hidden
        self.n_layers = cfg.pred_layers
        self.prediction = _Prediction(cfg.vocab_size, cfg.pred_hidden, cfg.pred_layers)

    def initial_state(self, batch_size: int, device: torch.device, dtype: torch.dtype) -> PredictionState:
        zeros = torch.zeros(self.n_layers, batch_size, self.hidden, device=device, dtype=dtype)
        return PredictionState(h=zeros, c=zeros.clone())

    def step(self, labels: Tensor, state: PredictionState) -> tuple[Tensor, PredictionState]:
        """One step for every row: labels (B,) -> output (B, H) and the new state. Blank acts as start."""
        emb = self.prediction.embed(labels)  # (B, H)
        if labels.device.type != "cpu":  # cuDNN's LSTM, as NeMo runs it
            out, (h, c) = self.prediction.dec_rnn.lstm(emb.unsqueeze(0), (state.h, state.c))
            return out.squeeze(0), PredictionState(h=h, c=c)
        # On CPU, nn.LSTM goes through oneDNN, which costs about 150 us a call for one time step, over 40% of a
        # batch-1 decode. torch's own LSTM cell, layer by layer, takes about 30 us and agrees to ~1e-7.
        hs, cs = [], []
        x = emb
        for layer, (w_ih, w_hh, b_ih, b_hh) in enumerate(self.prediction.dec_rnn.lstm.all_weights):
            x, c = torch.lstm_cell(x, (state.h[layer], state.c[layer]), w_ih, w_hh, b_ih, b_hh)
            hs.append(x)
            cs.append(c)
        return x, PredictionState(h=torch.stack(hs), c=torch.stack(cs))

    def sequence(self, labels: Tensor) -> Tensor:
        """Teacher-forced from the initial state: (B, U) labels, each row's inputs in order (blank = start) ->
        (B, U, H) outputs, one LSTM call over the whole sequence."""
        out, _ = self.prediction.dec_rnn.lstm(self.prediction.embed(labels).transpose(0, 1))  # time-major, as NeMo
        return out.transpose(0, 1)

    @staticmethod
    def select_state(mask: Tensor, new: PredictionState, old: PredictionState) -> PredictionState:
        """Per row: ``new`` where mask (B,) is true, else ``old``."""
        rows = mask.view(1, -1, 1)
        return PredictionState(h=torch.where(rows, new.h, old.h), c=torch.where(rows, new.c, old.c))


class Joint(nn.Module):
    """NeMo ``RNNTJoint``: out(act(enc(f) + pred(g))); TDT appends duration logits after the blank."""

    def __init__(self, cfg: TransducerConfig, encoder_hidden: int):
        super().__init__()
        self.vocab_size = cfg.vocab_size
        self.n_durations = len(cfg.durations)
        self.enc = nn.Linear(encoder_hidden, cfg.joint_hidden)
        self.pred = nn.Linear(cfg.pred_hidden, cfg.joint_hidden)
        activation = {"relu": nn.ReLU(), "tanh": nn.Tanh(), "sigmoid": nn.Sigmoid()}[cfg.joint_activation]
        # NeMo puts a dropout (a no-op here) between them only when the config has one, so the output layer's
        # key is joint_net.2 with dropout and joint_net.1 without
        dropout = [nn.Identity()] if cfg.joint_dropout else []
        self.joint_net = nn.Sequential(activation, *dropout,
                                       nn.Linear(cfg.joint_hidden, cfg.vocab_size + 1 + self.n_durations))

    def project_encoder(self, encoded: Tensor) -> Tensor:
        """(B, T, d) -> (B, T, J)"""
        return self.enc(encoded)

    def project_prediction(self, pred_out: Tensor) -> Tensor:
        """(B, H) -> (B, J)"""
        return self.pred(pred_out)

    def joint_after_projection(self, enc_proj: Tensor, pred_proj: Tensor) -> Tensor:
        """(B, J), (B, J) -> (B, V+1+D) raw logits: tokens, blank, then durations."""
        return self.joint_net(enc_proj + pred_proj)
