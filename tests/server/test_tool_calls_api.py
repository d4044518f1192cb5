"""Tool calls through the official ``openai`` client, on a tiny model trained to call tools.

auto (the model decides), parallel calls, streaming, required and a named
function (forced through structured output, arguments valid against the
schema), none, and the round trip: the tool's result goes back through the
template and the model answers from it.
"""

import json

import httpx
import jsonschema
import pytest

from kunlun_infer.chat import ChatTemplate
from kunlun_infer.server.protocol import ChatCompletionRequest
from tests.server.harness import RunningServer, engine_for
from tests.tool_models import (ASK_PARIS, ASK_TWO, GREET, HERMES_TEMPLATE, LLAMA_TEMPLATE, TOOL_RESULT, TOOLS,
                               build_tool_model)

SCHEMAS = {tool["function"]["name"]: tool["function"]["parameters"] for tool in TOOLS}


@pytest.fixture(scope="module")
def tool_server(tmp_path_factory):
    folder = build_tool_model(tmp_path_factory.mktemp("tool-model"))
    engine = engine_for(folder, model__max_model_len=512, scheduler__max_num_seqs=8)
    running = RunningServer(engine, model_name="tools")
    yield running
    running.stop()
    engine.close()


@pytest.fixture
def client(tool_server):
    import openai

    return openai.OpenAI(base_url=f"{tool_server.url}/v1", api_key="unused", max_retries=0, timeout=120)


def ask(client, messages, **kwargs):
    return client.chat.completions.create(model="tools", messages=messages, tools=TOOLS, temperature=0,
                                          max_tokens=80, **kwargs).choices[0]


def calls_of(choice):
    return [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls or ()]


def streamed(client, messages, **kwargs):
    """Content, calls and finish reason put together from the stream's deltas."""
    content, calls, reasons = "", {}, []
    for chunk in client.chat.completions.create(model="tools", messages=messages, tools=TOOLS, temperature=0,
                                                max_tokens=80, stream=True, **kwargs):
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for piece in delta.tool_calls or ():
            entry = calls.setdefault(piece.index, {"id": None, "name": None, "arguments": ""})
            if piece.id:
                assert entry["id"] is None and piece.type == "function"
                entry["id"], entry["name"] = piece.id, piece.function.name
            entry["arguments"] += piece.function.arguments or ""
        reasons.append(chunk.choices[0].finish_reason)
    return content, [calls[i] for i in sorted(calls)], [r for r in reasons if r]


def test_auto_the_model_calls_a_tool(client):
    choice = ask(client, ASK_PARIS)
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert calls_of(choice) == [("get_weather", {"city": "Paris"})]
    assert choice.message.tool_calls[0].id.startswith("call_") and choice.message.tool_calls[0].type == "function"


def test_auto_the_model_may_answer_in_text(client):
    choice = ask(client, GREET)
    assert choice.finish_reason == "stop" and choice.message.tool_calls is None
    assert choice.message.content == "Hi! Ask me about the weather."


def test_parallel_calls_and_one_call_when_parallel_is_off(client):
    both = ask(client, ASK_TWO)
    assert calls_of(both) == [("get_weather", {"city": "Paris"}), ("get_weather", {"city": "Rome"})]
    assert len({c.id for c in both.message.tool_calls}) == 2
    first = ask(client, ASK_TWO, parallel_tool_calls=False)
    assert calls_of(first) == [("get_weather", {"city": "Paris"})] and first.finish_reason == "tool_calls"


@pytest.mark.parametrize("messages", [ASK_PARIS, ASK_TWO, GREET])
def test_streaming_gives_the_same_calls_piece_by_piece(client, messages):
    whole = ask(client, messages)
    content, calls, reasons = streamed(client, messages)
    assert (content or None) == whole.message.content
    assert [(c["name"], c["arguments"]) for c in calls] == \
        [(c.function.name, c.function.arguments) for c in whole.message.tool_calls or ()]
    assert reasons == [whole.finish_reason]


def test_the_tool_result_goes_back_and_the_model_answers_from_it(client):
    call = ask(client, ASK_PARIS)
    turn = [*ASK_PARIS, call.message.model_dump(exclude_none=True),
            {"role": "tool", "tool_call_id": call.message.tool_calls[0].id, "content": "18 C, sun"}]
    answer = ask(client, turn)
    assert answer.finish_reason == "stop" and answer.message.tool_calls is None
    assert answer.message.content == "It is 18 C and sunny in Paris."


def test_required_and_named_calls_always_fit_the_schema(client):
    for messages in (GREET, ASK_PARIS, ASK_TWO):
        choice = ask(client, messages, tool_choice="required")
        assert choice.finish_reason == "tool_calls" and calls_of(choice)
        for name, arguments in calls_of(choice):
            jsonschema.validate(arguments, SCHEMAS[name])
        named = ask(client, messages, tool_choice={"type": "function", "function": {"name": "get_time"}})
        (name, arguments), = calls_of(named)
        assert name == "get_time" and named.finish_reason == "tool_calls"
        jsonschema.validate(arguments, SCHEMAS["get_time"])
    content, calls, reasons = streamed(client, GREET, tool_choice="required", parallel_tool_calls=False)
    assert not content and len(calls) == 1 and reasons == ["tool_calls"]
    jsonschema.validate(json.loads(calls[0]["arguments"]), SCHEMAS[calls[0]["name"]])


def test_none_leaves_the_text_as_content(client):
    choice = ask(client, ASK_PARIS, tool_choice="none")
    assert choice.message.tool_calls is None and choice.finish_reason == "stop"
    assert choice.message.content.startswith("<tool_call>")  # what the model wrote, unparsed


@pytest.mark.parametrize("body, param", [
    ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "has space"}}]}, "tools[0].function.name"),
    ({"tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
])
def test_bad_tool_requests_are_named(tool_server, body, param):
    payload = {"messages": ASK_PARIS, "tools": TOOLS, **body}
    response = httpx.post(f"{tool_server.url}/v1/chat/completions", json=payload, timeout=60)
    assert response.status_code == 400 and response.json()["error"]["param"] == param, response.text


def test_required_without_tools_and_a_template_without_tool_syntax(server, tool_server):
    response = httpx.post(f"{tool_server.url}/v1/chat/completions", timeout=60,
                          json={"messages": ASK_PARIS, "tool_choice": "required"})
    assert response.status_code == 400 and response.json()["error"]["param"] == "tool_choice"
    response = httpx.post(f"{server.url}/v1/chat/completions", json={"messages": ASK_PARIS, "tools": TOOLS},
                          timeout=60)  # the shared chat model's template has no tool section
    assert response.status_code == 400 and "server.tool_call_parser" in response.json()["error"]["message"]


def test_tools_and_tool_results_render_as_transformers_renders_them(tool_server):
    import transformers as tf

    folder = tool_server.engine.model_path
    tokenizer = tf.AutoTokenizer.from_pretrained(folder)
    request = ChatCompletionRequest(messages=TOOL_RESULT, tools=TOOLS)
    ours = ChatTemplate(HERMES_TEMPLATE).render(request.template_messages(), tools=request.tool_dicts())
    # transformers wants a call's arguments as an object, which is what the server makes of OpenAI's JSON text
    hf_messages = json.loads(json.dumps(TOOL_RESULT))
    for message in hf_messages:
        for call in message.get("tool_calls") or ():
            call["function"]["arguments"] = json.loads(call["function"]["arguments"])
    theirs = tokenizer.apply_chat_template(hf_messages, tools=TOOLS, tokenize=False, add_generation_prompt=True)
    assert ours == theirs and '{"name": "get_weather", "arguments": {"city": "Paris"}}' in ours
    assert "<tool_response>\n18 C, sun\n</tool_response>" in ours


@pytest.fixture(scope="module")
def llama_server(tmp_path_factory):
    folder = build_tool_model(tmp_path_factory.mktemp("llama-tools"), LLAMA_TEMPLATE, max_steps=0)
    engine = engine_for(folder, model__max_model_len=512, scheduler__max_num_seqs=8)
    running = RunningServer(engine, model_name="tools")
    yield running
    running.stop()
    engine.close()


def test_llama3_json_calls_are_forced_and_read_back(llama_server):
    import openai

    client = openai.OpenAI(base_url=f"{llama_server.url}/v1", api_key="unused", max_retries=0, timeout=120)
    choice = ask(client, ASK_TWO, tool_choice="required")
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    for name, arguments in calls_of(choice):
        jsonschema.validate(arguments, SCHEMAS[name])
    content, calls, reasons = streamed(client, ASK_TWO, tool_choice="required")
    assert [(c["name"], c["arguments"]) for c in calls] == \
        [(c.function.name, c.function.arguments) for c in choice.message.tool_calls] and reasons == ["tool_calls"]
    named = ask(client, GREET, tool_choice={"type": "function", "function": {"name": "get_time"}})
    (name, arguments), = calls_of(named)
    assert name == "get_time"
    jsonschema.validate(arguments, SCHEMAS["get_time"])
