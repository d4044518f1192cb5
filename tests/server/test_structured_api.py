"""Structured output through the official ``openai`` client, on the embedded default model.

Every answer must parse and validate (jsonschema), match the regex, or be one
of the choices — for several schemas and seeds, sent at once so that rows of
different grammars share steps.
"""

import json
import re
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import jsonschema
import pytest

import kunlun_infer
from tests.server.harness import RunningServer, engine_for

SCHEMAS = {
    "person": {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["admin", "user", "guest"]},
    }, "required": ["name", "age", "role"]},
    "order": {"type": "object", "properties": {
        "id": {"type": "integer", "minimum": 1, "maximum": 99999},
        "items": {"type": "array", "minItems": 1, "maxItems": 3, "items": {"type": "object", "properties": {
            "sku": {"type": "string", "maxLength": 8}, "qty": {"type": "integer", "minimum": 1, "maximum": 9}},
            "required": ["sku", "qty"]}},
        "paid": {"type": "boolean"},
    }, "required": ["id", "items", "paid"]},
    "config": {"type": "object", "properties": {
        "server": {"type": "object", "properties": {
            "host": {"type": "string", "maxLength": 15}, "port": {"type": "integer", "minimum": 1, "maximum": 65535},
            "tls": {"type": "object", "properties": {"on": {"type": "boolean"},
                                                     "mode": {"enum": ["strict", "lax"]}},
                    "required": ["on", "mode"]}}, "required": ["host", "port", "tls"]},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 4},
    }, "required": ["server", "tags"]},
    "point": {"type": "object", "properties": {"x": {"type": "number"}, "y": {"type": "number"},
                                               "label": {"type": ["string", "null"], "maxLength": 5}},
              "required": ["x", "y", "label"]},
}
PROMPT = [{"role": "user", "content": "Write the record as JSON."}]


@pytest.fixture(scope="module")
def default_server():
    folder = Path(kunlun_infer.__file__).parent / "default_model"
    engine = engine_for(folder, scheduler__max_num_seqs=32, model__max_model_len=1024)
    running = RunningServer(engine, model_name="default")
    yield running
    running.stop()
    engine.close()


@pytest.fixture
def client(default_server):
    import openai

    return openai.OpenAI(base_url=f"{default_server.url}/v1", api_key="unused", max_retries=0, timeout=300)


def in_parallel(calls):
    with ThreadPoolExecutor(len(calls)) as pool:
        return list(pool.map(lambda call: call(), calls))


def test_json_schema_answers_validate_20_of_20(client):
    cases = [(name, seed) for seed in range(5) for name in SCHEMAS]

    def ask(name, seed):
        return lambda: client.chat.completions.create(
            model="default", messages=PROMPT, max_tokens=300, temperature=1.0, seed=seed,
            response_format={"type": "json_schema", "json_schema": {"name": name, "schema": SCHEMAS[name]}})

    answers = in_parallel([ask(name, seed) for name, seed in cases])
    texts = set()
    for (name, _), answer in zip(cases, answers):
        choice = answer.choices[0]
        assert choice.finish_reason == "stop", choice.message.content
        jsonschema.validate(json.loads(choice.message.content), SCHEMAS[name])
        texts.add(choice.message.content)
    assert len(texts) == len(cases)  # twenty different answers, each valid


def test_json_object_and_guided_json_on_completions(client):
    whole = client.chat.completions.create(model="default", messages=PROMPT, max_tokens=200, temperature=0.7,
                                           seed=1, response_format={"type": "json_object"})
    assert isinstance(json.loads(whole.choices[0].message.content), dict)
    completion = client.completions.create(model="default", prompt="config = ", max_tokens=300, temperature=0.8,
                                           seed=2, extra_body={"guided_json": SCHEMAS["config"]})
    jsonschema.validate(json.loads(completion.choices[0].text), SCHEMAS["config"])
    # completions take OpenAI's response_format as chat does
    formatted = client.completions.create(model="default", prompt="point = ", max_tokens=200, temperature=0.8,
                                          seed=3, extra_body={"response_format": {"type": "json_schema", "json_schema": {
                                              "name": "point", "schema": SCHEMAS["point"]}}})
    assert formatted.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(formatted.choices[0].text), SCHEMAS["point"])


def test_regex_and_choice_answers_always_match(client):
    regex = r"(19|20)[0-9]{2}-(0[1-9]|1[0-2])-[0-2][0-9]"
    choices = ["red", "green", "blue", "dark purple"]
    regex_answers = in_parallel([lambda seed=seed: client.completions.create(
        model="default", prompt="date = ", max_tokens=20, temperature=1.0, seed=seed,
        extra_body={"guided_regex": regex}) for seed in range(20)])
    choice_answers = in_parallel([lambda seed=seed: client.chat.completions.create(
        model="default", messages=PROMPT, max_tokens=16, temperature=1.5, seed=seed,
        extra_body={"guided_choice": choices}) for seed in range(20)])
    assert all(re.fullmatch(regex, a.choices[0].text) for a in regex_answers)
    # room for the longest choice spelt a character a token (11), then the stop token: every answer ends
    assert all(a.choices[0].finish_reason == "stop" for a in choice_answers)
    picked = [a.choices[0].message.content for a in choice_answers]
    assert set(picked) <= set(choices) and len(set(picked)) > 1


def test_a_streamed_json_answer_is_the_whole_answer(client):
    kwargs = dict(model="default", messages=PROMPT, max_tokens=300, temperature=0.9, seed=7,
                  response_format={"type": "json_schema", "json_schema": {"name": "order", "schema": SCHEMAS["order"]}})
    whole = client.chat.completions.create(**kwargs).choices[0].message.content
    streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(stream=True, **kwargs)
                       if c.choices)
    assert streamed == whole
    jsonschema.validate(json.loads(streamed), SCHEMAS["order"])


def test_grammar_and_bad_constraints(client, default_server):
    import openai

    answer = client.completions.create(model="default", prompt="x = ", max_tokens=40, temperature=1.0, seed=3,
                                       extra_body={"guided_grammar": 'root ::= "[" num ("," num)* "]"\n'
                                                                      'num ::= [1-9] [0-9]?'})
    assert re.fullmatch(r"\[[1-9][0-9]?(,[1-9][0-9]?)*\]", answer.choices[0].text) \
        or answer.choices[0].finish_reason == "length"
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="default", messages=PROMPT, response_format={
            "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objekt"}}})
    assert info.value.body["param"] == "response_format" and "cannot be compiled" in info.value.body["message"]
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="default", prompt="x", extra_body={"guided_regex": "(("})
    assert info.value.body["param"] == "guided_regex"
