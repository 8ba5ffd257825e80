"""A StructuredOutputsParams as an xgrammar Grammar, and GPT-2's vocabulary as xgrammar sees
it. Imports xgrammar (and with it torch) on first use: processes that never constrain a
request never pay for it."""
from __future__ import annotations

import functools
import json
import re

from engine.core.request import EOS_TOKEN_ID, StructuredOutputsParams

# xgrammar prefixes its errors with "[hh:mm:ss] /path/file.cc:123: "
_XGRAMMAR_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: ")
# the longest whitespace run between JSON tokens: any formatting up to deep indentation,
# while a model that prefers whitespace cannot pad until max_tokens
MAX_WHITESPACE = 16


def check(spec: StructuredOutputsParams) -> None:
    """Raises ValueError naming the problem when `spec` cannot become a grammar."""
    grammar_of(spec)


def grammar_of(spec: StructuredOutputsParams):
    import xgrammar as xgr

    kind = spec.kinds[0]
    try:
        if kind == "json":
            schema = json.loads(spec.json)
            if not isinstance(schema, (dict, bool)):
                raise ValueError(f"the JSON schema must be an object, got {type(schema).__name__}")
            return xgr.Grammar.from_json_schema(spec.json, strict_mode=True,
                                                any_whitespace=not spec.disable_any_whitespace,
                                                max_whitespace_cnt=MAX_WHITESPACE)
        if kind == "json_object":  # any object, as OpenAI's json_object answers
            return xgr.Grammar.from_json_schema('{"type": "object"}', strict_mode=False,
                                                any_whitespace=not spec.disable_any_whitespace,
                                                max_whitespace_cnt=MAX_WHITESPACE)
        if kind == "regex":
            return xgr.Grammar.from_regex(spec.regex)
        if kind == "choice":
            return xgr.Grammar.from_ebnf(choice_ebnf(spec.choice))
        return xgr.Grammar.from_ebnf(spec.grammar)
    except (RuntimeError, json.JSONDecodeError) as err:
        message = _XGRAMMAR_PREFIX.sub("", str(err).strip())
        raise ValueError(f"structured outputs: the {kind} cannot be compiled: {message}") from None


def choice_ebnf(choices: tuple[str, ...]) -> str:
    """One alternative per choice; JSON string escapes are EBNF string escapes too."""
    return "root ::= " + " | ".join(json.dumps(c) for c in choices)


@functools.lru_cache(maxsize=1)
def compiler():
    """xgrammar's compiler over GPT-2's byte-level vocabulary, EOS its stop token. It caches
    compiled grammars by their text."""
    import xgrammar as xgr

    from engine.output.tokenizer import Tokenizer

    info = xgr.TokenizerInfo(Tokenizer().token_bytes_table, xgr.VocabType.RAW,
                             vocab_size=EOS_TOKEN_ID + 1, stop_token_ids=[EOS_TOKEN_ID])
    # max_threads: the compile's own parallelism, inside the one compile thread
    return xgr.GrammarCompiler(info, max_threads=2)
