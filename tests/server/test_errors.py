"""Refused requests: 400 with the OpenAI error shape naming the field, 404 for an unknown model or route."""

import httpx
import openai
import pytest

from tests.server.test_no_paths import assert_no_paths


def post(server, path, body, **kwargs):
    if isinstance(body, str):
        return httpx.post(f"{server.url}{path}", content=body, headers={"content-type": "application/json"},
                          timeout=30, **kwargs)
    return httpx.post(f"{server.url}{path}", json=body, timeout=30, **kwargs)


def assert_openai_error(response, status, param):
    assert response.status_code == status, response.text
    assert_no_paths(response.text)
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] == param and error["message"]
    if param not in (None, "body"):
        assert param.split("[")[0].split(".")[0] in error["message"]
    return error


@pytest.mark.parametrize("body", ['{"prompt": "x", ', "not json at all", '{"prompt": "x"} trailing'])
def test_malformed_json_is_a_400(server, body):
    error = assert_openai_error(post(server, "/v1/completions", body), 400, "body")
    assert "JSON" in error["message"]


@pytest.mark.parametrize("body, param", [
    ({"prompt": "x", "temperature": "hot"}, "temperature"),
    ({"prompt": "x", "temperature": -0.5}, "temperature"),
    ({"prompt": "x", "top_p": 0}, "top_p"),
    ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "x", "max_tokens": 10**6}, "max_tokens"),
    ({"prompt": "x", "n": 0}, "n"),
    ({"prompt": "x", "n": 1000}, "n"),
    ({"prompt": "x", "presence_penalty": 3}, "presence_penalty"),
    ({"prompt": "x", "frequency_penalty": -9}, "frequency_penalty"),
    ({"prompt": "x", "repetition_penalty": 0}, "repetition_penalty"),
    ({"prompt": "x", "min_p": 2}, "min_p"),
    ({"prompt": "x", "min_tokens": 50, "max_tokens": 5}, "min_tokens"),
    ({"prompt": "x", "logprobs": 99}, "logprobs"),
    ({"prompt": "x", "stop": 5}, "stop"),
    ({"prompt": "x", "stop": [""]}, "stop"),
    ({"prompt": "x", "seed": "abc"}, "seed"),
    ({"prompt": "x", "logit_bias": {"five": 1}}, "logit_bias"),
    ({"prompt": "x", "logit_bias": {"\u00b2": 1}}, "logit_bias"),
    ({"prompt": "x", "logit_bias": {"5": 101}}, "logit_bias"),
    ({"prompt": "x", "logit_bias": {"99999999": 1}}, "logit_bias"),
    ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "x", "echo": True, "max_tokens": 0, "min_tokens": 1}, "min_tokens"),
    ({"prompt": "x", "response_format": {"type": "xml"}}, "response_format.type"),
    ({"prompt": "x", "response_format": {"type": "json_object"}, "guided_regex": "a+"}, "guided_regex"),
    ({"prompt": "x", "temprature": 0.5}, "temprature"),
    ({"prompt": [1, "a"]}, "prompt"),
    ({"prompt": []}, "prompt"),
    ({"prompt": [[5, 10**6]]}, "prompt"),
    ({}, "prompt"),
    ([], "body"),
])
def test_bad_completion_parameters_are_named(server, body, param):
    assert_openai_error(post(server, "/v1/completions", body), 400, param)


@pytest.mark.parametrize("body, param", [
    ({"messages": []}, "messages"),
    ({"messages": "hi"}, "messages"),
    ({"messages": [{"content": "no role"}]}, "messages[0].role"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
    ({"messages": [{"role": "user"}]}, "messages[0].content"),
    ({"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": None}]},
     "messages[1].content"),
    ({"messages": [{"role": "user", "content": "x"}, {"role": "assistant"}]}, "messages[1].content"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
     "messages[0].content"),
    ({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, "top_logprobs"),
    ({"messages": [{"role": "user", "content": "x"}], "store": True}, "store"),
    ({"messages": [{"role": "user", "content": "x"}], "service_tier": "priority"}, "service_tier"),
    ({"messages": [{"role": "user", "content": "x"}], "modalities": ["text", "audio"]}, "modalities"),
    ({"messages": [{"role": "user", "content": "x"}], "metadata": {"run": 3}}, "metadata.run"),
    ({"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": -1}, "max_completion_tokens"),
    ({"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "xml"}}, "response_format.type"),
    ({"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "json_schema"}},
     "response_format.json_schema"),
    ({"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "json_object"},
      "guided_regex": "a+"}, "guided_regex"),
    ({"messages": [{"role": "user", "content": "x"}], "guided_regex": "(("}, "guided_regex"),
    ({"messages": [{"role": "user", "content": "x"}], "guided_choice": []}, "guided_choice"),
    ({"messages": [{"role": "user", "content": "x"}], "logprobs_mode": "final"}, "logprobs_mode"),
    ({"messages": [{"role": "user", "content": "x"}],
      "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objekt"}}}},
     "response_format"),
])
def test_bad_chat_parameters_are_named(server, body, param):
    assert_openai_error(post(server, "/v1/chat/completions", body), 400, param)


def test_a_conversation_longer_than_the_model_is_refused(server):
    body = {"messages": [{"role": "user", "content": "x" * 600}]}
    assert_openai_error(post(server, "/v1/chat/completions", body), 400, "messages")


def test_unknown_model_and_route(server):
    error = assert_openai_error(post(server, "/v1/completions", {"prompt": "x", "model": "gpt-9"}), 404, "model")
    assert error["code"] == "model_not_found"
    response = httpx.get(f"{server.url}/v1/nothing-here")
    assert response.status_code == 404 and "error" in response.json()
    assert_no_paths(response.text)
    wrong_method = httpx.delete(f"{server.url}/v1/completions")
    assert wrong_method.status_code == 405 and "error" in wrong_method.json()
    assert_no_paths(wrong_method.text)


def test_openai_client_sees_the_error_and_the_server_keeps_serving(client, server):
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=server.model_name, prompt="x", temperature=-1)
    assert err.value.status_code == 400 and "temperature" in str(err.value)
    ok = client.completions.create(model=server.model_name, prompt="x", max_tokens=2, temperature=0)
    assert ok.choices[0].finish_reason in ("stop", "length")
