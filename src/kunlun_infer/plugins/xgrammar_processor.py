"""Built-in plugin ``xgrammar``: structured output with the xgrammar library (``structured.backend=xgrammar``).

xgrammar compiles a JSON schema, a regex, an EBNF grammar or a structural
tag against the model's vocabulary once (compiled grammars are cached by the
engine), and a ``GrammarMatcher`` per sequence tracks where its text stands.
Every step the matchers of the constrained rows fill one int32 bitmask
together (``BatchGrammarMatcher``, on the host), which the op table's
``apply_token_bitmask`` applies to the logits on the device. Two rows of
this plugin's own are ANDed into a sequence's mask where xgrammar's rules
are looser than the text they stand for: tokens with raw control
characters (JSON), and tokens that would make the bytes so far malformed
UTF-8 (a UTF-16 surrogate, an overlong form, a stray continuation byte):
xgrammar counts such a 3-byte sequence as one character, so a JSON string
of ``maxLength: 6`` could hold one that decodes to three replacement
characters, and a regex's ``.`` a byte that is no text at all. xgrammar is an
optional dependency (``pip install 'kunlun-infer[structured]'``); it is
imported when the first structured request arrives.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Sequence
from typing import Any

import tokenizers
import torch

from kunlun_infer.capabilities import ConstraintState, LogitsProcessor, LogitsProcessorContext
from kunlun_infer.engine.structured_output import FIELD, StructuredOutput, TaggedSequence
from kunlun_infer.errors import RequestError
from kunlun_infer.hookspecs import PluginInfo, hookimpl
from kunlun_infer.version import __version__, distribution_version

PLUGIN_NAME = "xgrammar"
INSTALL_HINT = ("structured output needs the xgrammar library: pip install 'kunlun-infer[structured]' "
                "(or pip install xgrammar)")
#: at most this many blanks between the elements of JSON inside a tag (the model's own spacing fits)
TAG_JSON_MAX_WHITESPACE = 1
#: the time and source location xgrammar's C++ checks put before their messages
_LOG_PREFIX = re.compile(r"^\[[0-9:]+\] \S+:[0-9]+: ")


def _import_xgrammar() -> Any:
    try:
        import xgrammar
    except ImportError as exc:
        raise RequestError(f"{INSTALL_HINT}; importing it failed: {exc}", field=FIELD) from exc
    return xgrammar


#: where a sequence's bytes stand in UTF-8 (RFC 3629): how many continuation bytes the character begun still
#: needs, and the range the next one must fall in
Utf8State = tuple[int, int, int]
UTF8_READY: Utf8State = (0, 0x80, 0xBF)


def utf8_after(state: Utf8State, data: bytes) -> Utf8State | None:
    """The state after ``data`` follows ``state``, or ``None`` where the bytes stop being well-formed UTF-8
    (they may end inside a character: the next token can finish it)."""
    need, low, high = state
    for byte in data:
        if need:
            if not low <= byte <= high:
                return None
            need, low, high = need - 1, 0x80, 0xBF
        elif byte < 0x80:
            continue
        elif 0xC2 <= byte <= 0xDF:
            need, low, high = 1, 0x80, 0xBF
        elif 0xE0 <= byte <= 0xEF:  # E0: no overlong forms; ED: no UTF-16 surrogates
            need, low, high = 2, 0xA0 if byte == 0xE0 else 0x80, 0x9F if byte == 0xED else 0xBF
        elif 0xF0 <= byte <= 0xF4:  # F0: no overlong forms; F4: nothing past U+10FFFF
            need, low, high = 3, 0x90 if byte == 0xF0 else 0x80, 0x8F if byte == 0xF4 else 0xBF
        else:  # a continuation byte with no character begun, C0/C1 (overlong), F5-FF (past Unicode)
            return None
    return need, low, high


def _ebnf_literal(text: str) -> str:
    """``text`` as an EBNF string literal (JSON's escapes are the grammar's)."""
    return json.dumps(text, ensure_ascii=False)


class Compiled:
    """A compiled grammar and the control characters its JSON may not hold raw (``None``: no such rule)."""

    def __init__(self, grammar: Any, raw_controls_allowed: frozenset[int] | None) -> None:
        self.grammar = grammar
        self.raw_controls_allowed = raw_controls_allowed


class XGrammarState(ConstraintState):
    """One sequence's ``GrammarMatcher``, the bitmask row that forbids raw control characters (if any) and
    where its bytes stand in UTF-8 (one state per accepted token, for rollbacks)."""

    def __init__(self, matcher: Any, control_mask: torch.Tensor | None, token_bytes: Sequence[bytes],
                 always: frozenset[int]) -> None:
        self.matcher = matcher
        self.control_mask = control_mask
        self._token_bytes = token_bytes
        self._always = always  # stop and special tokens: no text
        self.utf8: list[Utf8State] = [UTF8_READY]

    def accept(self, token_id: int) -> bool:
        after = self.utf8[-1] if token_id in self._always else utf8_after(self.utf8[-1], self._token_bytes[token_id])
        if after is None or not self.matcher.accept_token(token_id):
            return False
        self.utf8.append(after)
        return True

    def rollback(self, num_tokens: int) -> None:
        if num_tokens:
            self.matcher.rollback(num_tokens)
            del self.utf8[-num_tokens:]


class XGrammarProcessor(LogitsProcessor):
    """xgrammar's compiler and batched bitmask fill; the mask itself is the op table's ``apply_token_bitmask``."""

    name = PLUGIN_NAME

    def __init__(self, context: LogitsProcessorContext) -> None:
        xgr = self.xgr = _import_xgrammar()
        from transformers import PreTrainedTokenizerFast  # a dependency of xgrammar's, heavy to import

        if context.tokenizer is None:
            raise RequestError("structured output needs the model's tokenizer.json, which this model lacks",
                               field=FIELD)
        if not context.eos_token_ids:
            raise RequestError("structured output needs an EOS token to end the text, and this model names none "
                               "(eos_token_id in config.json or eos_token in tokenizer_config.json)", field=FIELD)
        # a private copy: wrapping the tokenizer must not change the engine's own
        hf = PreTrainedTokenizerFast(tokenizer_object=tokenizers.Tokenizer.from_str(context.tokenizer.to_str()))
        self.vocab_size = int(context.vocab_size)
        info = self.info = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=self.vocab_size,
                                                              stop_token_ids=list(context.eos_token_ids))
        self.compiler = xgr.GrammarCompiler(info, max_threads=1)
        self.batch = xgr.BatchGrammarMatcher(max_threads=1)
        self.device = context.torch_device
        self.apply_bitmask = context.ops.apply_token_bitmask
        self._bitmask = xgr.allocate_token_bitmask(16, self.vocab_size)
        self._control_masks: dict[frozenset[int], torch.Tensor] = {}
        self._always = frozenset(self.info.special_token_ids) | frozenset(self.info.stop_token_ids)
        self._token_bytes = self.info.decoded_vocab  # (xgrammar builds the list anew on every read)
        self._utf8_masks: dict[Utf8State, torch.Tensor] = {}

    # ------------------------------------------------------------------ compile

    def compile(self, spec: StructuredOutput) -> Any:
        kind = spec.kind
        try:
            if kind == "json":
                return Compiled(self.compiler.compile_json_schema(spec.json, any_whitespace=False), frozenset())
            if kind == "json_object":
                return Compiled(self.compiler.compile_json_schema('{"type": "object"}', any_whitespace=False),
                                frozenset())
            if kind == "regex":
                return Compiled(self.compiler.compile_regex(spec.regex), None)
            if kind == "choice":
                return Compiled(self.compiler.compile_grammar(
                    "root ::= " + " | ".join(map(_ebnf_literal, spec.choice))), None)
            if kind == "grammar":
                return Compiled(self.compiler.compile_grammar(spec.grammar), None)
            tagged = spec.tagged
            literals = "".join(t.begin + t.end for t in tagged.tags) + tagged.separator + " \n"
            return Compiled(self.compiler.compile_structural_tag(self._structural_tag(tagged)),
                            frozenset(ord(c) for c in literals if ord(c) < 0x20))
        except RequestError:
            raise
        except Exception as exc:  # noqa: BLE001 - xgrammar reports a bad schema/regex/grammar many ways
            what = {"json": "JSON schema", "json_object": "JSON object", "regex": "regex", "choice": "choice",
                    "grammar": "EBNF grammar", "tagged": "tagged JSON (tool calls)"}[kind]
            detail = _LOG_PREFIX.sub("", " ".join(str(exc).split()))
            raise RequestError(f"{FIELD}: the {what} cannot be compiled: {detail}", field=FIELD) from exc

    def _structural_tag(self, tagged: TaggedSequence) -> Any:
        from xgrammar import structural_tag as st

        tags = [st.TagFormat(begin=t.begin, end=t.end, content=st.JSONSchemaFormat(
            json_schema=t.schema_dict, max_whitespace_cnt=TAG_JSON_MAX_WHITESPACE)) for t in tagged.tags]
        one = tags[0] if len(tags) == 1 else st.OrFormat(elements=tags)
        if tagged.max_count == 1:
            body: Any = one
        else:
            more: Any = st.SequenceFormat(elements=[st.ConstStringFormat(value=tagged.separator), one]) \
                if tagged.separator else one
            rest = (st.StarFormat(content=more) if tagged.max_count is None
                    else st.RepeatFormat(min=0, max=tagged.max_count - 1, content=more))
            body = st.SequenceFormat(elements=[one, rest])
        return st.StructuralTag(format=body)

    # ------------------------------------------------------------------ per sequence and per step

    def _control_mask(self, allowed: frozenset[int]) -> torch.Tensor:
        """A bitmask row forbidding every token whose text holds a control character outside ``allowed``.

        JSON never holds a raw control character (inside strings they are
        escaped), yet xgrammar's rule for strings with a ``maxLength`` lets
        them through; this row, ANDed with the grammar's, keeps them out.
        """
        if allowed not in self._control_masks:
            bad = frozenset(range(0x20)) - allowed
            self._control_masks[allowed] = self._mask_row(lambda text: bad.isdisjoint(text))
        return self._control_masks[allowed]

    def _utf8_mask(self, state: Utf8State) -> torch.Tensor:
        """A bitmask row allowing the tokens whose bytes keep a text standing at ``state`` well-formed UTF-8."""
        if state not in self._utf8_masks:
            self._utf8_masks[state] = self._mask_row(lambda text: utf8_after(state, text) is not None)
        return self._utf8_masks[state]

    def _mask_row(self, allows: Callable[[bytes], bool]) -> torch.Tensor:
        """A bitmask row of the tokens whose text ``allows(text)`` accepts, stop and special tokens always."""
        allowed_tokens = torch.ones(self._bitmask.shape[1] * 32, dtype=torch.bool)
        for token, text in enumerate(self._token_bytes):
            if token not in self._always and not allows(text):
                allowed_tokens[token] = False
        bits = allowed_tokens.view(-1, 32).to(torch.int64) << torch.arange(32)
        return bits.sum(-1).to(torch.int32)  # int64 sum wraps into int32 bits

    def new_state(self, compiled: Compiled, *, stop_token_ids: frozenset[int]) -> XGrammarState:
        if not stop_token_ids:
            raise RequestError("structured output needs a stop token to end the text; the request has none",
                               field=FIELD)
        matcher = self.xgr.GrammarMatcher(compiled.grammar, override_stop_tokens=sorted(stop_token_ids))
        allowed = compiled.raw_controls_allowed
        return XGrammarState(matcher, None if allowed is None else self._control_mask(allowed),
                             self._token_bytes, self._always)

    def apply(self, logits: torch.Tensor, rows: Sequence[int], states: Sequence[ConstraintState]) -> None:
        if len(rows) > self._bitmask.shape[0]:
            self._bitmask = self.xgr.allocate_token_bitmask(max(len(rows), 2 * self._bitmask.shape[0]),
                                                            self.vocab_size)
        bitmask = self._bitmask[:len(rows)]
        matchers = [state.matcher for state in states]  # type: ignore[attr-defined]
        self.batch.batch_fill_next_token_bitmask(matchers, bitmask)
        for i, state in enumerate(states):
            if state.control_mask is not None:  # type: ignore[attr-defined]
                bitmask[i] &= state.control_mask  # type: ignore[attr-defined]
            bitmask[i] &= self._utf8_mask(state.utf8[-1])  # type: ignore[attr-defined]
        self.apply_bitmask(logits, bitmask.to(self.device), torch.tensor(list(rows), dtype=torch.int64,
                                                                         device=self.device))

    def close(self) -> None:
        self.compiler.clear_cache()


def _factory(*, context: LogitsProcessorContext) -> XGrammarProcessor:
    return XGrammarProcessor(context)


@hookimpl
def kunlun_infer_plugin_info() -> PluginInfo:
    return PluginInfo(name=PLUGIN_NAME, version=__version__, api=">=1.2,<2",
                      stack={"torch": torch.__version__,
                             "xgrammar": distribution_version("xgrammar") or "not installed"},
                      description="structured output (JSON schema, regex, choice, EBNF, tool calls) with xgrammar")


@hookimpl
def kunlun_infer_logits_processor_factories() -> dict[str, Any]:
    return {PLUGIN_NAME: _factory}
