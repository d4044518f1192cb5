"""A request's way in: tokenized and checked once, its params its own, named by the engine alone."""

import pytest

from kunlun_infer import RequestError, SamplingParams
from kunlun_infer.engine import intake


@pytest.fixture
def counted(monkeypatch):
    """``counted(llm) -> (texts encoded, prompts checked)``, recorded from then on."""

    def count(llm):
        encoded, checked = [], []
        encode, check = llm.tokenizer.encode, intake.validate_prompt

        def counted_encode(text, *args, **kwargs):
            encoded.append(text)
            return encode(text, *args, **kwargs)

        def counted_check(ids, *args, **kwargs):
            checked.append(list(ids))
            return check(ids, *args, **kwargs)

        monkeypatch.setattr(llm.tokenizer, "encode", counted_encode)
        monkeypatch.setattr(intake, "validate_prompt", counted_check)
        return encoded, checked

    return count


def test_generate_tokenizes_and_checks_each_prompt_once(tiny_model, make_llm, counted):
    llm = make_llm(tiny_model("llama"))
    expected = [llm.tokenizer.encode("hello"), llm.tokenizer.encode("world"), [7, 8, 9]]
    encoded, checked = counted(llm)
    outs = llm.generate(["hello", "world", [7, 8, 9]], SamplingParams(max_tokens=3, n=2), use_tqdm=False)
    assert len(outs) == 6 and all(o.finished for o in outs)
    assert encoded == ["hello", "world"]
    assert checked == expected
    assert [o.prompt_token_ids for o in outs[::2]] == expected


def test_a_bad_prompt_in_a_batch_refuses_the_batch_before_anything_runs(tiny_model, make_llm):
    llm = make_llm(tiny_model("llama"))
    with pytest.raises(RequestError) as err:
        llm.generate(["fine", [1, 2, 10_000]], SamplingParams(max_tokens=3), use_tqdm=False)
    assert err.value.field == "prompt"
    assert not llm.engine.has_unfinished() and llm.engine.stats()["num_waiting"] == 0


def test_a_prepared_request_is_queued_as_checked(tiny_model, make_llm, counted):
    engine = make_llm(tiny_model("llama")).engine
    params = SamplingParams(max_tokens=4, temperature=0)
    prepared = engine.prepare_request("abc", params)
    assert prepared.prompt == "abc" and list(prepared.prompt_token_ids) == engine.tokenizer.encode("abc")
    # the params it checked are its own: changing the caller's object, or the copy it hands out, changes nothing
    params.max_tokens = 10**6
    prepared.params.max_tokens = 10**6
    encoded, checked = counted(engine)
    request_id = engine.add_request(prepared)
    assert encoded == [] and checked == []
    final = None
    while engine.has_unfinished():
        final = next((o for o in engine.step() if o.finished), final)
    assert final.request_id == request_id and len(final.token_ids) == 4


def test_a_prepared_request_takes_no_other_params_and_belongs_to_its_engine(tiny_model, make_llm):
    folder = tiny_model("llama")
    engine, other = make_llm(folder).engine, make_llm(folder).engine
    prepared = engine.prepare_request([1, 2, 3])
    with pytest.raises(RequestError) as err:
        engine.add_request(prepared, SamplingParams(max_tokens=2))
    assert err.value.field == "params"
    with pytest.raises(RequestError) as err:
        other.add_request(prepared)
    assert err.value.field == "prompt" and "another engine" in str(err.value)
    assert not engine.has_unfinished() and not other.has_unfinished()


def test_the_engine_names_requests_around_the_names_callers_chose(tiny_model, make_llm):
    engine = make_llm(tiny_model("llama")).engine
    mine = [engine.add_request([1, 2], SamplingParams(max_tokens=2), request_id=f"req-{i}") for i in (0, 2)]
    named = [engine.add_request([1, 2], SamplingParams(max_tokens=2)) for _ in range(3)]
    assert mine == ["req-0", "req-2"] and named == ["req-1", "req-3", "req-4"]
