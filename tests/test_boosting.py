"""Hotwords (decoding.boosting): both transducer decoders boost alike, and CTC as its frame-by-frame definition says;
rows without hotwords decode as before; on the embedded model, with either head, a boosted phrase is heard where the
audio leaves room for it, and words not said stay out; over HTTP each request's hotwords are its own, in the
engine's process or through a front end."""

from __future__ import annotations

import asyncio
import copy
import io
import json
import shutil
import subprocess

import httpx
import numpy as np
import pytest
import soundfile as sf
import soxr
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from decoding import boosting, cuda_graphs
from decoding.boosting import NULL_NODE, PHRASE_START_SHARE, BoostTable, build_boost_table
from decoding.ctc import ctc_greedy
from decoding.cuda_graphs import LabelLoopingDecoder, ModeChoice
from decoding.frame_looping import frame_looping_greedy
from decoding.label_looping import label_looping_greedy
from decoding.types import Hotword
from models import load_model
from models.tokenizer import MAX_HOTWORDS, checked_hotwords, split_boost
from service.cli import main
from service.config import Settings
from tests.servers import run_server, wait_job
from tests.test_cuda_conditional import Replayer
from tests.test_decoding_modes import _cpu_warm_up
from tests.test_label_looping import decoding_cases, random_batch, tiny_transducer

CPU = torch.device("cpu")
SAID = "having a snout that is shorter than average"  # the embedded model hears "... that is sure to than average"
HOTWORD = "shorter"
DECOYS = ["kappa", "zebra", "quantum", "violin"]


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(decoding_cases(), st.data())
def test_label_looping_boosts_as_frame_looping_does(case, data):
    model = tiny_transducer(case["seed"], case["vocab"], case["durations"], case["max_symbols"],
                            case["blank_bias"], case["pred_layers"])
    encoded, lengths = random_batch(case["seed"], case["lengths"], case["n_frames"])
    phrases = [data.draw(_hotwords(case["vocab"])) for _ in lengths]  # a row's: none to three
    boost = build_boost_table(phrases, data.draw(st.floats(0.5, 8.0)), CPU)
    args = (encoded, lengths, model.prediction, model.joint, model.durations, model.max_symbols)
    with torch.inference_mode():
        boosted = label_looping_greedy(*args, boost=boost)
        assert boosted == frame_looping_greedy(*args, boost=boost)
        plain = label_looping_greedy(*args)
    for row, row_phrases in enumerate(phrases):
        if not row_phrases:  # a row without hotwords decodes as it would alone
            assert boosted[row] == plain[row]


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                 HealthCheck.function_scoped_fixture])
@given(st.data(), st.booleans())
def test_a_kept_decoder_gives_each_row_what_it_gives_alone_whatever_the_batches_before(monkeypatch, data, graphs):
    """The service's decoder keeps its buffers (and on a GPU its graphs and hotword table) from batch to batch. Over
    a run of batches of changing size, each row bringing its own hotwords or none, every row decodes as it does
    alone with only its own: nothing of another row's phrases, nor of an earlier batch's, reaches it. (Above, the
    boosted batch is checked against frame looping on the same table, which would share a leak.)"""
    if graphs:  # no_while's bookkeeping on this CPU, each graph a stand-in replaying what it captured
        monkeypatch.setattr(cuda_graphs, "choose_mode", lambda requested, device: ModeChoice("no_while", "test"))
        monkeypatch.setattr(cuda_graphs, "capture_graph", lambda fn, stream: Replayer(fn))
        monkeypatch.setattr(cuda_graphs, "_warm_up", _cpu_warm_up)
        monkeypatch.setattr(torch.cuda, "Stream", lambda device: None)
    vocab = data.draw(st.integers(2, 9))
    model = tiny_transducer(data.draw(st.integers(0, 999)), vocab, data.draw(st.sampled_from(((), (0, 1, 2, 3, 4)))),
                            data.draw(st.integers(1, 4)), data.draw(st.floats(-4.0, 4.0)))
    args = (model.prediction, model.joint, model.durations, model.max_symbols)
    decoder, weight = LabelLoopingDecoder(*args), data.draw(st.floats(0.5, 8.0))
    for _ in range(data.draw(st.integers(1, 5))):
        n_frames = data.draw(st.integers(0, 70))  # past FRAME_QUANTUM at times: the buffers grow
        lengths = data.draw(st.lists(st.integers(0, n_frames), min_size=1, max_size=7))
        phrases = [data.draw(_hotwords(vocab)) for _ in lengths]
        encoded, lengths_t = random_batch(data.draw(st.integers(0, 9999)), lengths, n_frames)
        together = decoder(encoded, lengths_t, build_boost_table(phrases, weight, CPU))
        for row, own in enumerate(phrases):
            # "alone": the same batch, decoded afresh, with no phrases but this row's. Not the row in a batch of
            # its own: float32 results move by a rounding with the batch's size (not with the other rows' content),
            # and a near tie the bonus makes may then go the other way (hypothesis found one: 203 labels alike, the
            # 204th not, with or without the kept decoder)
            only_own = [own if other == row else () for other in range(len(phrases))]
            alone = label_looping_greedy(encoded, lengths_t, *args, boost=build_boost_table(only_own, weight, CPU))
            assert together[row] == alone[row], (row, own)


def _hotwords(vocab: int) -> st.SearchStrategy[tuple[Hotword, ...]]:
    """A row's hotwords: none to three phrases of 1-3 tokens, each with the default bonus or its own."""
    tokens = st.lists(st.integers(0, vocab - 1), min_size=1, max_size=3).map(tuple)
    hotword = st.builds(Hotword, tokens, st.none() | st.floats(0.5, 8.0))
    return st.lists(hotword, max_size=3, unique_by=lambda h: h.tokens).map(tuple)


def _ctc_boosted_by_definition(log_probs: torch.Tensor, length: int, blank: int, hotwords, weight: float
                               ) -> list[int]:
    """One row's frame labels as the definition reads (decoding.ctc.ctc_boosted_labels), with the phrases' tree
    as dictionaries (token -> (child, bonus)): each frame takes the argmax with the bonus of the tokens that
    continue a phrase from where the row's emissions leave it (the phrase's own or ``weight``, a share of it for
    its first token, the largest where phrases share a step), the previous frame's label excepted; only an
    emission moves the row."""
    root: dict = {}
    for hotword in hotwords:
        bonus = weight if hotword.boost is None else hotword.boost
        node = root
        for token in hotword.tokens:
            child, best = node.get(token, ({}, 0.0))
            node[token] = (child, max(best, bonus * (PHRASE_START_SHARE if node is root else 1.0)))
            node = child
    node, previous, labels = root, blank, []
    for t in range(log_probs.shape[0]):
        if t >= length:
            labels.append(blank)
            continue
        bonus = torch.zeros(log_probs.shape[1])
        for token, (_, step) in node.items():
            if token != previous:
                bonus[token] = step
        label = int((log_probs[t] + bonus).argmax())
        if label not in (blank, previous):
            node = node[label][0] if label in node else root[label][0] if label in root else root
        labels.append(previous := label)
    return labels


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_ctc_boosts_as_its_definition_says(data):
    n_frames, vocab = data.draw(st.integers(0, 14)), data.draw(st.integers(2, 6))
    lengths = data.draw(st.lists(st.integers(0, n_frames), min_size=1, max_size=6))
    phrases = [data.draw(_hotwords(vocab)) for _ in lengths]
    weight = data.draw(st.floats(0.0, 8.0))
    generator = torch.Generator().manual_seed(data.draw(st.integers(0, 2**16)))
    blank_bias = data.draw(st.floats(-3.0, 3.0))  # from mostly tokens to mostly blank
    logits = torch.randn(len(lengths), n_frames, vocab + 1, generator=generator) * 2
    logits[..., vocab] += blank_bias
    log_probs, lengths_t = logits.log_softmax(-1), torch.tensor(lengths)
    boost = build_boost_table(phrases, weight, CPU)
    boosted, plain = ctc_greedy(log_probs, lengths_t, vocab, boost), ctc_greedy(log_probs, lengths_t, vocab)
    for row, row_phrases in enumerate(phrases):
        labels = _ctc_boosted_by_definition(log_probs[row], lengths[row], vocab, row_phrases, weight)
        expected = ctc_greedy(torch.nn.functional.one_hot(torch.tensor([labels], dtype=torch.long), vocab + 1)
                              .float().reshape(1, n_frames, vocab + 1), lengths_t[row:row + 1], vocab)[0]
        assert boosted[row] == expected
        if not row_phrases:  # a row without hotwords decodes as it would alone
            assert boosted[row] == plain[row]


@settings(max_examples=100, deadline=None)
@given(st.data())
def test_the_spread_table_steps_as_the_tree_does(data):
    """BoostTable.spread (what CTC's frame loop reads): every node's bonus row and every token's next node equal
    what bonus and advance give by walking the children, padded tables (as the decoder's graphs keep them) too."""
    vocab = data.draw(st.integers(2, 8))
    phrases = [data.draw(_hotwords(vocab)) for _ in range(data.draw(st.integers(1, 4)))]
    table = build_boost_table(phrases, data.draw(st.floats(0.0, 8.0)), CPU)
    if table is None:
        return
    if data.draw(st.booleans()):
        padded = BoostTable.empty(table.shape[0] + 3, table.shape[1] + 2, len(table.roots) + 1, CPU)
        padded.load(table)
        table = padded
    spread = table.spread(vocab + 1)
    nodes = torch.arange(table.shape[0])
    assert torch.equal(spread.bonus(nodes), table.bonus(nodes, vocab + 1))
    for token in range(vocab + 1):
        label = torch.full_like(nodes, token)
        assert torch.equal(spread.advance(nodes, label), table.advance(nodes, label))


def test_ctc_walks_the_tree_where_the_spread_table_would_be_too_large(monkeypatch):
    generator = torch.Generator().manual_seed(7)
    vocab, lengths = 6, torch.tensor([30, 0, 17, 30])
    log_probs = (torch.randn(4, 30, vocab + 1, generator=generator) * 2).log_softmax(-1)
    phrases = [(Hotword((1, 2)), Hotword((3,), 4.0)), (), (Hotword((2, 2, 5)),), (Hotword((1, 2)),)]
    boost = build_boost_table(phrases, 3.0, CPU)
    spread = ctc_greedy(log_probs, lengths, vocab, boost)
    monkeypatch.setattr(boosting, "SPREAD_MAX_ENTRIES", 0)
    assert boost.spread(vocab + 1) is None
    assert ctc_greedy(log_probs, lengths, vocab, boost) == spread != ctc_greedy(log_probs, lengths, vocab)


def test_the_table_shares_trees_starts_over_and_leaves_rows_without_phrases_alone():
    assert build_boost_table([(), ()], 3.0, CPU) is None
    phrases = (Hotword((5, 6, 7)), Hotword((5, 8)))
    table = build_boost_table([phrases, (), phrases, (Hotword((9,)),)], 2.0, CPU)
    assert table.roots[1] == NULL_NODE and table.roots[0] == table.roots[2] != table.roots[3]  # one tree each
    bonus = table.bonus(table.roots, 10)
    assert bonus[0].nonzero().flatten().tolist() == [5] and bonus[0, 5] == 1.0  # half, for a phrase's start
    assert bonus[1].abs().sum() == 0 and bonus[3].nonzero().flatten().tolist() == [9]
    root = table.roots[:1]
    after_5 = table.advance(root, torch.tensor([5]))
    assert table.bonus(after_5, 10)[0].nonzero().flatten().tolist() == [6, 8]  # both phrases go on from "5"
    assert table.bonus(after_5, 10)[0, 6] == 2.0  # the whole bonus, once a phrase is begun
    assert table.advance(after_5, torch.tensor([9])) == root  # continues nothing: back to the root
    assert table.advance(after_5, torch.tensor([5])) == after_5  # continues nothing, but starts a phrase again
    after_7 = table.advance(table.advance(after_5, torch.tensor([6])), torch.tensor([7]))
    assert table.bonus(after_7, 10).abs().sum() == 0  # a whole phrase: nothing more to boost there
    assert table.advance(table.roots[1:2], torch.tensor([5])) == NULL_NODE
    # a phrase's own bonus, and the largest where two phrases share a step
    table = build_boost_table([(Hotword((5, 6, 7)), Hotword((5, 8), 6.0), Hotword((4,), 0.5))], 2.0, CPU)
    assert table.bonus(table.roots, 10)[0].tolist() == [0, 0, 0, 0, 0.25, 3.0, 0, 0, 0, 0]
    after_5 = table.advance(table.roots, torch.tensor([5]))
    assert table.bonus(after_5, 10)[0, 6] == 2.0 and table.bonus(after_5, 10)[0, 8] == 6.0


def test_a_hotword_may_bring_its_own_bonus(model):
    assert split_boost("widget pro:1.5") == ("widget pro", 1.5) and split_boost(" acme : 3 ") == (" acme", 3.0)
    assert split_boost("acme") == ("acme", None) and split_boost("a:b") == ("a:b", None)  # no number: no bonus
    assert split_boost("acme:10") == ("acme", 10.0) and split_boost("acme:.5") == ("acme", 0.5)
    assert split_boost("acme:1e-1") == ("acme", 0.1)
    for bad in ("acme:1e9", "acme:inf", "acme:nan", "acme:-inf", "acme:0"):  # numbers, but no bonus in range
        with pytest.raises(ValueError, match="own boost is more than 0 and at most 10"):
            split_boost(bad)
    assert split_boost("at 10:30 am") == ("at 10:30 am", None)  # a colon inside the phrase is the phrase's
    # and so is one between digits ("at 10" was boosted by 5); a space before the colon boosts such a phrase
    assert split_boost("at 10:05") == ("at 10:05", None) and split_boost("ratio 16:9") == ("ratio 16:9", None)
    assert split_boost("model 3 :2") == ("model 3", 2.0)
    acme = model.tokenizer.hotwords(["acme"])[0].tokens
    # given twice, a phrase is boosted once, by the last bonus given for it
    assert model.tokenizer.hotwords(["acme", "kappa", "acme:3"]) == (
        Hotword(acme, 3.0), Hotword(model.tokenizer.hotwords(["kappa"])[0].tokens))


def test_a_hotword_the_vocabulary_cannot_spell_is_refused(model):
    """The embedded model writes lowercase: "NVIDIA" was spelled as the bare boundary piece and <unk>, and boosting
    those split words the model had heard (boosted by 10, "middle name" came out as "middle n ame" on the CTC
    head)."""
    unknown = model.tokenizer._sp.unk_id()
    for bad, missing in (("NVIDIA", "NVIDA"), ("Acme:3", "A"), ("café", "é")):
        with pytest.raises(ValueError, match=f"never writes \\({missing!r}\\)"):
            model.tokenizer.hotwords([bad])
    with pytest.raises(ValueError, match="never writes"):
        model.transcribe([np.zeros(16000, dtype=np.float32)], hotwords=["acme", "NVIDIA"], decoder="ctc")
    assert all(unknown not in h.tokens for h in model.tokenizer.hotwords(["nvidia", "acme:3", "cafe"]))


def test_the_default_bonus_is_checked_as_a_hotwords_own_is(model):
    """``hotword_boost=inf`` was taken: every frame took the hotword ("acmel acme l acme c acme")."""
    wave = np.zeros(16000, dtype=np.float32)
    for bad in (float("inf"), float("nan"), -1.0, 10.5):
        with pytest.raises(ValueError, match="hotword_boost must be 0 to 10"):
            model.transcribe([wave], hotwords=["acme"], hotword_boost=bad)
    assert model.transcribe([wave], hotwords=["acme"], hotword_boost=10.0)[0].duration_s == 1.0


@pytest.mark.parametrize("bad", [10.5, float("inf"), float("nan"), -1.0])
def test_the_services_hotword_boost_is_held_to_the_same_range(bad):
    with pytest.raises(ValueError):
        Settings(hotword_boost=bad)


@pytest.fixture(scope="module")
def model():
    return load_model(device="cpu")


def _espeak(text: str) -> np.ndarray:
    if shutil.which("espeak-ng") is None:
        pytest.skip("espeak-ng not installed")
    wav = subprocess.run(["espeak-ng", "--stdout", text], capture_output=True, check=True, timeout=30).stdout
    samples, rate = sf.read(io.BytesIO(wav), dtype="float32")
    return soxr.resample(samples, rate, 16000).astype(np.float32)


@pytest.fixture(scope="module")
def spoken() -> np.ndarray:
    return _espeak(SAID)


def test_a_boosted_phrase_is_heard_and_words_not_said_stay_out(model, spoken):
    plain = model.transcribe([spoken])[0]
    boosted = model.transcribe([spoken], hotwords=[HOTWORD])[0]
    assert boosted.text == SAID
    assert model.transcribe([spoken], hotwords=[HOTWORD], decoder_algorithm="frame_looping")[0].text == SAID
    assert model.transcribe([spoken], hotwords=DECOYS)[0].tokens == plain.tokens
    # the scores stay the model's own: the boosted word is the doubt it was
    assert next(w.confidence for w in boosted.words if w.word == HOTWORD) < 0.9
    # a phrase, boosted harder: "exchange or by bib for money" is heard as said
    said = "exchange or buy back for money"
    assert model.transcribe([_espeak(said)], hotwords=["buy back"], hotword_boost=5.0)[0].text == said
    # the CTC head hears "byy back": boosted, the phrase as said; decoys change nothing
    said_ctc = model.transcribe([_espeak(said)], decoder="ctc")[0]
    assert said_ctc.text != said
    assert model.transcribe([_espeak(said)], hotwords=["buy back"], hotword_boost=5.0,
                            decoder="ctc")[0].text == said
    assert model.transcribe([_espeak(said)], hotwords=DECOYS, decoder="ctc")[0].tokens == said_ctc.tokens
    # a hotword's own bonus, written "phrase:bonus": the same phrase, the others at the default
    assert model.transcribe([_espeak(said)], hotwords=["buy back"])[0].text != said  # the default is too little
    for decoder in ("tdt", "ctc"):
        assert model.transcribe([_espeak(said)], hotwords=["buy back:5", *DECOYS], decoder=decoder)[0].text == said
    for bad in ("buy back:0", "buy back:10.5", "buy back:-1"):
        with pytest.raises(ValueError, match="own boost is more than 0 and at most 10"):
            model.transcribe([spoken], hotwords=[bad])
    with pytest.raises(ValueError, match="1 to 64 characters"):
        model.transcribe([spoken], hotwords=[" "])
    with pytest.raises(ValueError, match=f"at most {MAX_HOTWORDS}"):
        model.transcribe([spoken], hotwords=[f"w{i}" for i in range(MAX_HOTWORDS + 1)])


def _flac(samples: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    sf.write(buffer, samples, 16000, format="FLAC")
    return buffer.getvalue()


def test_each_request_over_http_boosts_its_own_hotwords(model, spoken):
    data = _flac(spoken)
    with run_server(Settings(max_wait_ms=300, max_batch_size=8), model) as running:
        async def send() -> list[httpx.Response]:
            async with httpx.AsyncClient(timeout=120) as client:
                native = client.post(f"{running.url}/v1/transcribe?hotwords={HOTWORD},kappa", content=data,
                                     headers={"content-type": "audio/flac"})
                plain = client.post(f"{running.url}/v1/transcribe", content=data,
                                    headers={"content-type": "audio/flac"})
                openai = client.post(f"{running.url}/v1/audio/transcriptions", data={"hotwords": HOTWORD},
                                     files={"file": ("a.flac", data, "audio/flac")})
                return list(await asyncio.gather(native, plain, openai))

        native, plain, openai = asyncio.run(send())  # one batch: the boosted and the plain request together
        different = ",".join(f"w{i}" for i in range(MAX_HOTWORDS + 1))
        too_many = httpx.post(f"{running.url}/v1/transcribe", params={"hotwords": different},
                              content=data, headers={"content-type": "audio/flac"})
        boosted_items = running.metric("batchasr_hotword_items_total")
        boosted_batches = running.metric("batchasr_hotword_batches_total")
    assert native.json()["text"] == openai.json()["text"] == SAID
    assert plain.json()["text"] == model.transcribe([spoken])[0].text != SAID
    assert too_many.status_code == 400 and too_many.json()["error"]["param"] == "hotwords"
    assert boosted_items == 2 and boosted_batches in (1, 2)  # a batch counts once, plain items beside or not
    said = "exchange or buy back for money"  # the CTC head hears "byy back"
    with run_server(Settings(decoder="ctc"), model) as running:
        boosted_ctc = httpx.post(f"{running.url}/v1/transcribe", params={"hotwords": "buy back:5,kappa"},
                                 content=_flac(_espeak(said)), headers={"content-type": "audio/flac"}, timeout=60)
        out_of_range = httpx.post(f"{running.url}/v1/audio/transcriptions", data={"hotwords": "buy back:11"},
                                  files={"file": ("a.flac", data, "audio/flac")}, timeout=60)
    assert boosted_ctc.json()["text"] == said
    assert out_of_range.status_code == 400 and out_of_range.json()["error"]["param"] == "hotwords"
    assert "at most 10" in out_of_range.json()["error"]["message"]
    without_vocabulary = copy.copy(model)  # a checkpoint without its tokenizer cannot spell hotwords
    without_vocabulary.tokenizer = None
    with run_server(Settings(), without_vocabulary) as running:
        refused = httpx.post(f"{running.url}/v1/transcribe?hotwords=buy", content=data,
                             headers={"content-type": "audio/flac"})
    assert refused.status_code == 400 and refused.json()["error"]["code"] == "hotwords_unavailable"
    with pytest.raises(ValidationError, match="greater than or equal to 0"):  # a bonus, never a penalty
        Settings(hotword_boost=-1.0)


def test_hotwords_in_the_query_string_reach_both_routes_every_value_counted(model, spoken):
    # docs/hotwords.md: hotwords on both transcription routes, query or form field, repeated or comma-separated
    data = _flac(spoken)
    with run_server(Settings(), model) as running:
        openai = httpx.post(f"{running.url}/v1/audio/transcriptions", params={"hotwords": HOTWORD},
                            files={"file": ("a.flac", data, "audio/flac")}, timeout=60)
        repeated = httpx.post(f"{running.url}/v1/transcribe", params=[("hotwords", HOTWORD), ("hotwords", "kappa")],
                              content=data, headers={"content-type": "audio/flac"}, timeout=60)
        refused = httpx.post(f"{running.url}/v1/audio/transcriptions", params={"hotwords": "x" * 65},
                             files={"file": ("a.flac", data, "audio/flac")}, timeout=60)
        # in both places: the form's were dropped unchecked (here, one no model can spell); now refused
        both = [httpx.post(f"{running.url}{route}", params={"hotwords": "corporation"}, data={field: "ACME"},
                           files={"file": ("a.flac", data, "audio/flac")}, timeout=60)
                for route in ("/v1/audio/transcriptions", "/v1/transcribe") for field in ("hotwords", "hotwords[]")]
        switched = httpx.post(f"{running.url}/v1/transcribe", params={"multichannel": "false"},
                              data={"multichannel": "true"}, files={"file": ("a.flac", data, "audio/flac")},
                              timeout=60)
    assert openai.json()["text"] == SAID
    assert repeated.json()["text"] == SAID  # the first value too, not only the last
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "hotwords"
    assert [(r.status_code, r.json()["error"]["param"]) for r in both] == [(400, "hotwords")] * 4
    assert switched.status_code == 400 and "both in the query string and in the form" in switched.text


def test_a_jobs_hotwords_reach_every_item_and_bad_ones_are_refused_at_submission(model, spoken, redis_server):
    data = _flac(spoken)
    with run_server(Settings(redis_url=redis_server.url, max_wait_ms=20), model) as running:
        files = [("files", (name, data, "audio/flac")) for name in ("a.flac", "b.flac")]
        submitted = httpx.post(f"{running.url}/v1/jobs", data={"hotwords": HOTWORD}, files=files, timeout=60)
        assert submitted.status_code == 202 and submitted.json()["hotwords"] == [HOTWORD]
        job = wait_job(running.url, submitted.json()["id"])
        results = httpx.get(f"{running.url}/v1/jobs/{job['id']}/results", timeout=60).text.splitlines()
        refused = [httpx.post(f"{running.url}/v1/jobs", data={field: bad},
                              files=[("files", ("a.flac", data, "audio/flac"))], timeout=60)
                   for bad in ("x" * 65, f"{HOTWORD}:0") for field in ("hotwords", "hotwords[]")]
        # `hotwords[]`, as the transcription routes take it: it was ignored on a job, bad ones too
        bracketed = httpx.post(f"{running.url}/v1/jobs", data={"hotwords[]": HOTWORD}, files=files[:1], timeout=60)
        repeated = httpx.post(f"{running.url}/v1/jobs", data={"multichannel": ["true", "false"]},
                              files=files[:1], timeout=60)  # the last was taken without a word
    assert job["status"] == "completed" and [json.loads(line)["text"] for line in results] == [SAID, SAID]
    assert all(r.status_code == 400 and r.json()["error"]["param"] == "hotwords" for r in refused)
    assert bracketed.status_code == 202 and bracketed.json()["hotwords"] == [HOTWORD]
    assert repeated.status_code == 400 and repeated.json()["error"]["param"] == "multichannel"


def test_submit_checks_hotwords_before_it_queues_a_job_straight_into_redis(redis_server, tmp_path, capsys):
    """With --redis-url no server checks them: the job was queued, and each of its items failed on them."""
    path = tmp_path / "said.flac"
    path.write_bytes(b"never read")
    for bad, says in ((f"{HOTWORD}:11", "own boost is more than 0 and at most 10"), ("x" * 65, "1 to 64 characters"),
                      (",".join(f"w{i}" for i in range(MAX_HOTWORDS + 1)), "at most 100 different hotwords")):
        with pytest.raises(SystemExit) as refused:
            main(["submit", "--redis-url", redis_server.url, "--hotwords", bad, str(path)])
        assert refused.value.code == 2 and says in capsys.readouterr().err
    assert not redis_server.client().keys("batchasr:job:*")
    assert len(checked_hotwords(["acme", "acme:3"] * MAX_HOTWORDS)) == 2 * MAX_HOTWORDS  # a phrase twice counts once


def test_the_command_line_boosts_hotwords(spoken, tmp_path, capsys):
    path = tmp_path / "said.flac"
    path.write_bytes(_flac(spoken))
    assert main(["transcribe", "--hotwords", HOTWORD, str(path)]) == 0
    assert capsys.readouterr().out == SAID + "\n"
    assert main(["transcribe", "--hotwords", HOTWORD, "--decoder", "ctc", str(path)]) == 0
    assert capsys.readouterr().out == SAID + "\n"
    for bad, says in (("x" * 65, "1 to 64 characters"), (f"{HOTWORD}:11", "own boost is more than 0 and at most 10")):
        with pytest.raises(SystemExit) as refused:  # refused as the options are read, before the model loads
            main(["transcribe", "--hotwords", bad, str(path)])
        assert refused.value.code == 2 and says in capsys.readouterr().err
