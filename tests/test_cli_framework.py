"""The command framework: a command's own key=value parameters and flags, the rest are overrides."""

from __future__ import annotations

import pytest

from kunlun_infer.commands import Command, Flag, Param, UsageError, parse_tokens

GREET = Command(
    name="greet", summary="say hello", run=lambda inv: 0,
    params=(Param("prompt", "what to say", required=True), Param("n", "how often", type=int, default=1),
            Param("file", "extra inputs", multiple=True)),
    flags=(Flag("stream", "stream tokens"), Flag("out", "output file", takes_value=True)),
)


def test_params_flags_and_overrides_are_told_apart():
    params, flags, overrides = parse_tokens(GREET, [
        "prompt=def fibonacci(n):", "device=cpu", "--stream", "n=3", "file=a", "+model.extra=1", "file=b",
        "--out", "x.json", "scheduler.max_num_seqs=8"])
    assert params == {"prompt": "def fibonacci(n):", "n": 3, "file": ["a", "b"]}
    assert flags == {"stream": True, "out": "x.json"}
    assert overrides == ["device=cpu", "+model.extra=1", "scheduler.max_num_seqs=8"]


def test_flag_with_equals_and_defaults():
    params, flags, _ = parse_tokens(GREET, ["prompt=hi", "--out=y"])
    assert params["n"] == 1 and flags == {"stream": False, "out": "y"}


@pytest.mark.parametrize("tokens, message", [
    ([], "needs prompt="),
    (["prompt=x", "n=many"], "n='many'"),
    (["prompt=x", "--stream=yes"], "takes no value"),
    (["prompt=x", "--out"], "needs a value"),
    (["prompt=x", "loose"], "unexpected argument 'loose'"),
])
def test_usage_errors_are_clear(tokens, message):
    with pytest.raises(UsageError, match=message):
        parse_tokens(GREET, tokens)
