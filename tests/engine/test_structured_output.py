"""Structured output: every constrained row is masked by its own grammar state, whatever else the step holds."""

import json
import re
import sys

import jsonschema
import pytest
import torch

import kunlun_infer as ki
from kunlun_infer import RequestError, SamplingParams
from kunlun_infer.engine.structured_output import StructuredOutput
from tests.engine.tiny_models import EOS_ID, hf_greedy

PROMPT = list(range(40, 80))
SCHEMA = {"type": "object", "properties": {
    "id": {"type": "integer", "minimum": 0, "maximum": 999},
    "kind": {"enum": ["cat", "dog", "bird"]},
    "tags": {"type": "array", "items": {"type": "string", "maxLength": 4}, "maxItems": 3},
    "owner": {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6}}, "required": ["name"]},
}, "required": ["id", "kind", "tags", "owner"]}


def hf_constrained_greedy(model, folder, prompt, spec_kwargs, max_new_tokens):
    """transformers' logits, masked step by step by an xgrammar matcher of its own: the reference.

    JSON never holds a raw control character, so for a schema tokens holding one are masked too.
    """
    import tokenizers
    import transformers as tf
    import xgrammar as xgr

    hf_tok = tf.PreTrainedTokenizerFast(tokenizer_object=tokenizers.Tokenizer.from_file(str(folder / "tokenizer.json")))
    vocab = model.config.vocab_size
    info = xgr.TokenizerInfo.from_huggingface(hf_tok, vocab_size=vocab, stop_token_ids=[EOS_ID])
    compiler = xgr.GrammarCompiler(info)
    if "json" in spec_kwargs:
        compiled = compiler.compile_json_schema(json.dumps(spec_kwargs["json"]), any_whitespace=False)
    else:
        compiled = compiler.compile_regex(spec_kwargs["regex"])
    matcher = xgr.GrammarMatcher(compiled)
    bitmask = xgr.allocate_token_bitmask(1, vocab)
    controls = [t for t, text in enumerate(info.decoded_vocab) if t != EOS_ID and any(b < 0x20 for b in text)]
    ids, out = list(prompt), []
    with torch.no_grad():
        for _ in range(max_new_tokens):
            logits = model(torch.tensor([ids])).logits[0, -1:].float()
            matcher.fill_next_token_bitmask(bitmask)
            xgr.apply_token_bitmask_inplace(logits, bitmask)
            if "json" in spec_kwargs:
                logits[0, controls] = float("-inf")
            token = int(logits.argmax())
            assert matcher.accept_token(token)
            out.append(token)
            ids.append(token)
            if token == EOS_ID:
                break
    return out


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_constrained_greedy_equals_transformers_masked_by_the_same_grammar(arch, tiny_model, hf_model, make_llm):
    folder = tiny_model(arch)
    llm = make_llm(folder)
    constrained = [({"json": SCHEMA}, PROMPT), ({"regex": r"[0-9]{2,4}(-[a-f]+)?;"}, [5, 6, 7])]
    # constrained and free requests in one batch: the mask lands on its own rows only
    prompts = [PROMPT, [5, 6, 7], [9, 8, 7, 6]]
    params = [SamplingParams(max_tokens=150, temperature=0.0, structured=spec) for spec, _ in constrained]
    params.append(SamplingParams(max_tokens=12, temperature=0.0))
    outs = llm.generate(prompts, params, use_tqdm=False)
    for (spec, prompt), out in zip(constrained, outs):
        assert out.token_ids == hf_constrained_greedy(hf_model(folder), folder, prompt, spec, 150)
    assert outs[2].token_ids == hf_greedy(hf_model(folder), [9, 8, 7, 6], 12)
    assert outs[0].finish_reason == "stop" and outs[0].token_ids[-1] == EOS_ID
    jsonschema.validate(json.loads(outs[0].text), SCHEMA)
    assert re.fullmatch(r"[0-9]{2,4}(-[a-f]+)?;", outs[1].text)


def test_each_sample_of_n_keeps_its_own_state(tiny_model, make_llm):
    llm = make_llm(tiny_model("qwen2"))
    outs = llm.generate([PROMPT], SamplingParams(n=4, max_tokens=120, temperature=1.0, seed=11,
                                                 structured={"json": SCHEMA}), use_tqdm=False)
    assert sorted(o.index for o in outs) == [0, 1, 2, 3]
    for out in outs:
        assert out.finish_reason == "stop", out.text
        jsonschema.validate(json.loads(out.text), SCHEMA)
    assert len({o.text for o in outs}) > 1  # sampled, not copies of one state


def test_sampled_strings_stay_well_formed_utf8_and_within_their_max_length(tiny_model, make_llm):
    """xgrammar counts a 3-byte UTF-16 surrogate (ED A0-BF xx) as one character of a JSON string; the
    plugin's own UTF-8 row keeps such bytes out, so no string decodes to replacement characters past its
    ``maxLength``."""
    llm = make_llm(tiny_model("qwen2"))
    outs = [out for seed in range(12) for out in llm.generate(
        [PROMPT], SamplingParams(n=4, max_tokens=120, temperature=1.0, seed=seed, structured={"json": SCHEMA}),
        use_tqdm=False)]
    assert len(outs) == 48
    for out in outs:
        assert out.finish_reason == "stop" and "\ufffd" not in out.text, out.text
        jsonschema.validate(json.loads(out.text), SCHEMA)
    assert any(max(map(ord, out.text)) > 0x7F for out in outs)  # multi-byte characters were drawn


def test_the_utf8_state_refuses_malformed_bytes_and_rolls_back():
    from kunlun_infer.plugins.xgrammar_processor import UTF8_READY, XGrammarState, utf8_after

    for text in ["a", "é", "€", "😀", "日本", "\U0010ffff"]:
        assert utf8_after(UTF8_READY, text.encode()) == UTF8_READY
    for bad in [b"\xed\xa0\x80", b"\xe0\x80\x80", b"\xc0\x80", b"\xf4\x90\x80\x80", b"\x80", b"\xf5", b"\xe2a"]:
        assert utf8_after(UTF8_READY, bad) is None, bad
    assert utf8_after(UTF8_READY, b"\xe2\x82") == (1, 0x80, 0xBF)  # a character begun, not yet malformed
    assert utf8_after(UTF8_READY, b"\xed") == (2, 0x80, 0x9F)  # after ED only what stays below the surrogates

    class Matcher:
        def __init__(self):
            self.tokens = []

        def accept_token(self, token):
            self.tokens.append(token)
            return True

        def rollback(self, n):
            del self.tokens[-n:]

    token_bytes = [b"a", b"\xe2", b"\x82", b"\xac", b"\xed", b"\xa0", b"\x9f", b""]
    state = XGrammarState(Matcher(), None, token_bytes, always=frozenset({7}))
    assert state.accept(1) and state.accept(2) and state.utf8[-1] == (1, 0x80, 0xBF)
    assert not state.accept(0) and state.matcher.tokens == [1, 2]  # "a" inside a character: refused, unchanged
    assert state.accept(7) and state.accept(3) and state.utf8[-1] == UTF8_READY  # a stop token has no bytes
    state.rollback(3)
    assert state.utf8[-1] == (2, 0x80, 0xBF) and state.matcher.tokens == [1]
    state.rollback(1)
    assert state.accept(4) and not state.accept(5) and state.accept(6)  # ED A0 is a surrogate, ED 9F is not


def test_regex_choice_and_grammar_hold_under_sampling(tiny_model, make_llm):
    llm = make_llm(tiny_model("llama"))
    choices = ["yes", "no", "ask \"later\"\n", "日本"]
    grammar = 'root ::= "sum(" num ("+" num)* ")"\nnum ::= [1-9] [0-9]?'
    for seed in range(4):
        regex, choice, gram = llm.generate([PROMPT] * 3, [
            SamplingParams(max_tokens=40, temperature=1.0, seed=seed, structured={"regex": r"[A-Z][a-z]{1,5} [0-9]{3}"}),
            SamplingParams(max_tokens=40, temperature=1.0, seed=seed, structured={"choice": choices}),
            SamplingParams(max_tokens=60, temperature=1.0, seed=seed, structured={"grammar": grammar})], use_tqdm=False)
        assert re.fullmatch(r"[A-Z][a-z]{1,5} [0-9]{3}", regex.text), regex.text
        assert choice.text in choices
        assert gram.finish_reason == "length" or re.fullmatch(r"sum\([1-9][0-9]?(\+[1-9][0-9]?)*\)", gram.text)


def test_preemption_and_prefix_cache_keep_the_grammar_state(tiny_model, make_llm):
    folder = tiny_model("llama")
    prompts = [PROMPT[:20 + 3 * i] for i in range(6)]
    params = SamplingParams(max_tokens=60, temperature=0.0, structured={"json": SCHEMA})
    roomy = [o.token_ids for o in make_llm(folder).generate(prompts, params, use_tqdm=False)]
    tight = make_llm(folder, cache__num_blocks=12, cache__block_size=8)
    again = tight.generate(prompts, params, use_tqdm=False)
    assert tight.engine.stats()["num_preemptions"] > 0
    assert [o.token_ids for o in again] == roomy
    # the same request once more: its prompt comes from the prefix cache, its text from a fresh state
    cached = tight.generate([prompts[3]], params, use_tqdm=False)[0]
    assert cached.num_cached_tokens > 0 and cached.token_ids == roomy[3]


def test_logprobs_raw_or_after_the_mask(tiny_model, hf_model, make_llm):
    folder = tiny_model("llama")
    llm = make_llm(folder)
    spec = {"choice": ["ab", "cd", "ef"]}
    raw, processed = llm.generate([PROMPT, PROMPT], [
        SamplingParams(max_tokens=4, temperature=0.0, logprobs=5, structured=spec),
        SamplingParams(max_tokens=4, temperature=0.0, logprobs=5, structured=spec, logprobs_mode="processed")],
        use_tqdm=False)
    assert raw.token_ids == processed.token_ids
    with torch.no_grad():
        first = torch.log_softmax(hf_model(folder)(torch.tensor([PROMPT])).logits[0, -1].float(), -1)
    token = raw.token_ids[0]
    assert raw.logprobs[0][token] == pytest.approx(float(first[token]), abs=1e-4)
    # after the mask only 'a', 'c' and 'e' remain: three alternatives whose probabilities sum to one
    allowed = {llm.engine.tokenizer.encode(c)[0] for c in "ace"}
    assert set(processed.logprobs[0]) == allowed
    assert sum(torch.tensor(list(processed.logprobs[0].values())).exp()) == pytest.approx(1.0, abs=1e-4)
    # second token: the grammar leaves one choice, so its processed logprob is 0
    assert processed.logprobs[1] == {processed.token_ids[1]: pytest.approx(0.0, abs=1e-6)}


def test_bad_constraints_are_refused_alone(tiny_model, make_llm):
    llm = make_llm(tiny_model("llama"))
    engine = llm.engine
    for spec, words in [({"regex": "(("}, "regex cannot be compiled"),
                        ({"json": {"type": "objekt"}}, "JSON schema cannot be compiled"),
                        ({"grammar": "root ::= missing"}, "grammar cannot be compiled")]:
        with pytest.raises(RequestError, match=words) as info:
            engine.add_request(PROMPT, SamplingParams(structured=spec))
        assert info.value.field == "structured" and "/project/" not in str(info.value)
    assert not engine.has_unfinished()
    for kwargs, field in [({"ignore_eos": True}, "ignore_eos"), ({"min_tokens": 2}, "min_tokens")]:
        with pytest.raises(RequestError, match="cannot be combined with structured output") as info:
            SamplingParams(structured={"regex": "a+"}, **kwargs)
        assert info.value.field == field
    for bad, words in [({}, "exactly one of"), ({"regex": "a", "choice": ["b"]}, "exactly one of"),
                       ({"choice": []}, "non-empty list"), ({"json": "{not json"}, "not JSON"),
                       ({"jsonschema": {}}, "unknown field")]:
        with pytest.raises(RequestError, match=words):
            SamplingParams(structured=bad)
    with pytest.raises(RequestError, match="logprobs_mode must be one of raw, processed"):
        SamplingParams(logprobs_mode="final")
    out = llm.generate([PROMPT], SamplingParams(max_tokens=8, temperature=0.0, structured={"regex": "[0-9]+!"}),
                       use_tqdm=False)[0]
    assert re.fullmatch("[0-9]+!", out.text) or out.finish_reason == "length"


def test_without_the_grammar_library_the_error_says_how_to_install(tiny_model, make_llm, monkeypatch):
    llm = make_llm(tiny_model("llama"))
    monkeypatch.setitem(sys.modules, "xgrammar", None)  # import xgrammar now raises ImportError
    with pytest.raises(RequestError, match=r"pip install 'kunlun-infer\[structured\]'"):
        llm.engine.add_request(PROMPT, SamplingParams(structured={"json_object": True}))
    out = llm.generate([PROMPT], SamplingParams(max_tokens=3, temperature=0.0), use_tqdm=False)[0]
    assert len(out.token_ids) == 3  # unconstrained requests are served as before


def test_structured_output_spec_is_frozen_and_hashable():
    a = StructuredOutput(json={"type": "object", "properties": {"b": {}, "a": {}}})
    b = StructuredOutput(json='{"type": "object", "properties": {"b": {}, "a": {}}}')
    assert a == b and hash(a) == hash(b) and list(a.schema["properties"]) == ["b", "a"]
    assert SamplingParams(structured={"choice": ["x"]}).structured == StructuredOutput(choice=("x",))
    assert ki.SamplingParams().structured is None
