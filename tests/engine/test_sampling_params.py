"""Bad sampling parameters are refused up front, naming the field and the allowed range."""

import math

import pytest

from kunlun_infer import RequestError
from kunlun_infer.engine.params import SamplingParams, validate_prompt


@pytest.mark.parametrize("kwargs, field, hint", [
    ({"max_tokens": 0}, "max_tokens", ">= 1"),
    ({"temperature": -0.1}, "temperature", ">= 0"),
    ({"temperature": math.nan}, "temperature", ">= 0"),
    ({"top_p": 0.0}, "top_p", "(0, 1]"),
    ({"top_p": 1.5}, "top_p", "(0, 1]"),
    ({"top_k": -1}, "top_k", ">= 0"),
    ({"logprobs": -1}, "logprobs", "[0, 20]"),
    ({"seed": -3}, "seed", "[0, "),
    ({"stop": [""]}, "stop", "non-empty"),
    ({"logit_bias": {5: 100.5}}, "logit_bias", "[-100, 100]"),
    ({"logit_bias": {5: math.inf}}, "logit_bias", "[-100, 100]"),
    ({"logit_bias": {-1: 1.0}}, "logit_bias", "integers >= 0"),
    ({"logit_bias": {"5": 1.0}}, "logit_bias", "integers >= 0"),
    ({"logit_bias": [5]}, "logit_bias", "token ids"),
])
def test_bad_value_names_field_and_range(kwargs, field, hint):
    with pytest.raises(RequestError) as err:
        SamplingParams(**kwargs)
    assert err.value.field == field
    assert field in str(err.value) and hint in str(err.value)
    assert isinstance(err.value, ValueError)


def test_a_single_stop_string_is_accepted():
    assert SamplingParams(stop="END").stop == ("END",)


def test_logit_bias_is_a_dict_of_ids_to_floats_and_empty_is_none():
    assert SamplingParams(logit_bias={7: -100, 3: 2}).logit_bias == {7: -100.0, 3: 2.0}
    assert SamplingParams(logit_bias={}).logit_bias is None


def test_logit_bias_ids_are_checked_against_the_vocabulary():
    validate_prompt([1, 2], SamplingParams(max_tokens=4, logit_bias={99: 1}), vocab_size=100, max_model_len=64)
    with pytest.raises(RequestError) as err:
        validate_prompt([1, 2], SamplingParams(max_tokens=4, logit_bias={100: 1}), vocab_size=100, max_model_len=64)
    assert err.value.field == "logit_bias" and "[0, 99]" in str(err.value) and "100" in str(err.value)


@pytest.mark.parametrize("prompt, max_tokens, field", [
    ([], 4, "prompt"),
    ([1, 2, 500], 4, "prompt"),
    ([1, -2], 4, "prompt"),
    ([1] * 60, 5, "max_tokens"),
])
def test_prompt_checks_against_the_model(prompt, max_tokens, field):
    with pytest.raises(RequestError) as err:
        validate_prompt(prompt, SamplingParams(max_tokens=max_tokens), vocab_size=100, max_model_len=64)
    assert err.value.field == field


def test_request_larger_than_the_kv_cache_is_refused():
    with pytest.raises(RequestError, match="cache.num_blocks"):
        validate_prompt([1] * 10, SamplingParams(max_tokens=10), vocab_size=100, max_model_len=64,
                        max_kv_tokens=16)
