"""Grammars for constrained decoding (llguidance): JSON outputs and forced tool calls.

The gateway turns ``response_format`` and ``tool_choice: required``/named into one
llguidance grammar string, checks that it compiles against the checkpoint's vocabulary
(an uncompilable schema is a 400 naming the field), and ships it to the engines inside the
request's sampling parameters (``SamplingParams.grammar``); the engines turn it into a
token mask (``dualpath.structured.constraint``).

JSON is generated compactly with ``", "`` and ``": "`` separators (what ``json.dumps``
writes and models are trained on) and no free whitespace: a model cannot stall in
whitespace, and greedy decoding stays exact.
"""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path
from typing import Any

import llguidance as llg

from dualpath.chat.errors import GrammarError

__all__ = ["JSON_OPTIONS", "check_grammar", "json_object_grammar", "json_schema_grammar", "lark_grammar", "lark_json_rule", "vocabulary"]

JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


@lru_cache(maxsize=8)
def vocabulary(model_dir: str, n_vocab: int | None = None) -> llg.LLTokenizer:
    """The llguidance vocabulary of a checkpoint, cached (building it takes ~1 s for 150K tokens).

    EOS: every id the serving tokenizer ends on. ``n_vocab`` is the logits width when it
    exceeds the tokenizer (padded embedding rows).
    """
    from dualpath.model.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(model_dir)
    text = (Path(model_dir) / "tokenizer.json").read_text(encoding="utf-8")
    return llg.LLTokenizer(text, n_vocab=n_vocab, eos_token=sorted(tok.eos_token_ids) or None)


def _closed(node: Any) -> Any:
    """``node`` with ``additionalProperties: false`` wherever an object schema lists properties
    and leaves it unset (xgrammar's strict mode, vLLM's default): a model is not invited to
    invent keys."""
    if isinstance(node, list):
        return [_closed(x) for x in node]
    if not isinstance(node, dict):
        return node
    out = {k: (v if k in ("const", "enum", "default", "examples") else _closed(v)) for k, v in node.items()}
    if isinstance(out.get("properties"), dict) and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out


def _with_options(schema: dict[str, Any]) -> dict[str, Any]:
    return {**_closed(schema), "x-guidance": {**JSON_OPTIONS, **(schema.get("x-guidance") or {})}}


def json_schema_grammar(schema: Any, *, param: str = "response_format.json_schema.schema") -> str:
    """Grammar of one JSON value matching ``schema`` (a dict, or ``True`` for any JSON).

    Raises:
        GrammarError: ``schema`` is not a JSON object (naming ``param``).
    """
    if schema is True:
        schema = {}
    if not isinstance(schema, dict):
        raise GrammarError(f"{param} must be a JSON schema object", param=param)
    try:
        return llg.LLMatcher.grammar_from_json_schema(_with_options(schema))
    except (ValueError, TypeError) as exc:
        raise GrammarError(f"{param} is not a usable JSON schema: {exc}", param=param) from None


def json_object_grammar() -> str:
    """Grammar of ``response_format: {"type": "json_object"}``: any JSON object."""
    return json_schema_grammar({"type": "object"}, param="response_format")


def lark_grammar(lark: str) -> str:
    """A Lark grammar (with ``%json{...}`` rules) as an llguidance grammar string (the Lark
    text itself: ``LLMatcher`` takes Lark or its JSON form)."""
    return llg.LLMatcher.grammar_from_lark(lark)


def lark_json_rule(schema: dict[str, Any]) -> str:
    """A Lark right-hand side generating one JSON value matching ``schema``."""
    return "%json " + json.dumps(_with_options(schema))


def check_grammar(grammar: str, tokenizer: llg.LLTokenizer | None, *, param: str) -> None:
    """Compile ``grammar`` (against the vocabulary when given); results are cached, since an
    agent sends the same tools and schemas every turn.

    Raises:
        GrammarError: it does not compile; the message is llguidance's, ``param`` the field.
    """
    error = _compile_error(grammar, tokenizer)
    if error:
        raise GrammarError(f"{param} cannot be compiled into a grammar: {error}", param=param)


@lru_cache(maxsize=256)
def _compile_error(grammar: str, tokenizer: llg.LLTokenizer | None) -> str:
    try:
        is_error, messages = llg.LLMatcher.validate_grammar_with_warnings(grammar, tokenizer)
        return "; ".join(messages) if is_error else ""
    except (ValueError, TypeError, RuntimeError) as exc:
        return str(exc)
