"""Built-in plugin ``xgrammar``: structured output with the xgrammar library (``structured.backend=xgrammar``).

xgrammar compiles a JSON schema, a regex, an EBNF grammar or a structural
tag against the model's vocabulary once (compiled grammars are cached by the
engine), and a ``GrammarMatcher`` per sequence tracks where its text stands.
Every step the matchers of the constrained rows fill one int32 bitmask
together (``BatchGrammarMatcher``, on the host), which the op table's
``apply_token_bitmask`` applies to the logits on the device. xgrammar is an
optional dependency (``pip install 'kunlun-infer[structured]'``); it is
imported when the first structured request arrives.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
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


def _ebnf_literal(text: str) -> str:
    """``text`` as an EBNF string literal (JSON's escapes are the grammar's)."""
    return json.dumps(text, ensure_ascii=False)


class Compiled:
    """A compiled grammar and the control characters its JSON may not hold raw (``None``: no such rule)."""

    def __init__(self, grammar: Any, raw_controls_allowed: frozenset[int] | None) -> None:
        self.grammar = grammar
        self.raw_controls_allowed = raw_controls_allowed


class XGrammarState(ConstraintState):
    """One sequence's ``GrammarMatcher`` (and the bitmask row that forbids raw control characters, if any)."""

    def __init__(self, matcher: Any, control_mask: torch.Tensor | None) -> None:
        self.matcher = matcher
        self.control_mask = control_mask

    def accept(self, token_id: int) -> bool:
        return bool(self.matcher.accept_token(token_id))

    def rollback(self, num_tokens: int) -> None:
        if num_tokens:
            self.matcher.rollback(num_tokens)


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
            keep = set(self.info.special_token_ids) | set(self.info.stop_token_ids)
            allowed_tokens = torch.ones(self._bitmask.shape[1] * 32, dtype=torch.bool)
            for token, text in enumerate(self.info.decoded_vocab):
                if token not in keep and not bad.isdisjoint(text):
                    allowed_tokens[token] = False
            bits = allowed_tokens.view(-1, 32).to(torch.int64) << torch.arange(32)
            self._control_masks[allowed] = bits.sum(-1).to(torch.int32)  # int64 sum wraps into int32 bits
        return self._control_masks[allowed]

    def new_state(self, compiled: Compiled, *, stop_token_ids: frozenset[int]) -> XGrammarState:
        if not stop_token_ids:
            raise RequestError("structured output needs a stop token to end the text; the request has none",
                               field=FIELD)
        matcher = self.xgr.GrammarMatcher(compiled.grammar, override_stop_tokens=sorted(stop_token_ids))
        allowed = compiled.raw_controls_allowed
        return XGrammarState(matcher, None if allowed is None else self._control_mask(allowed))

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
