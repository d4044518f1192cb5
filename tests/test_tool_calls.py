"""Tool-call syntax read back into OpenAI calls, whole or streamed in any pieces, and the forced format."""

import json

import pytest

from kunlun_infer.tool_calls import STYLES, ToolCallParser, detect_style, forced_calls, parse_tool_calls

HERMES, LLAMA = STYLES["hermes"], STYLES["llama3_json"]
PARIS = '{"name": "get_weather", "arguments": {"city": "Paris", "days": [1, 2], "note": "a \\"}\\" b"}}'


def stream(style, text, sizes, parallel=True):
    """Feed ``text`` in pieces of the given sizes (cycled); the content and calls the deltas add up to."""
    parser = ToolCallParser(style, parallel=parallel)
    content, calls, at, i = "", {}, 0, 0
    deltas = []
    while at < len(text):
        size = sizes[i % len(sizes)]
        deltas.append(parser.feed(text[at:at + size]))
        at, i = at + size, i + 1
    deltas.append(parser.finish())
    for delta in deltas:
        content += delta.content
        for call in delta.calls:
            entry = calls.setdefault(call["index"], {"id": None, "name": None, "arguments": ""})
            if "id" in call:
                assert entry["id"] is None, "a call is announced once"
                entry.update(id=call["id"], name=call["name"])
            entry["arguments"] += call["arguments"]
    return content, [calls[i] for i in sorted(calls)], parser


CASES = [
    (HERMES, f"<tool_call>\n{PARIS}\n</tool_call>", None, [("get_weather", json.loads(PARIS)["arguments"])]),
    (HERMES, f"Let me look that up.\n<tool_call>\n{PARIS}\n</tool_call>\n<tool_call>\n"
             '{"name": "get_time", "arguments": {}}\n</tool_call>', "Let me look that up.",
     [("get_weather", json.loads(PARIS)["arguments"]), ("get_time", {})]),
    (HERMES, "No tools needed: 2 < 3 and <tool is not a tag.", "No tools needed: 2 < 3 and <tool is not a tag.", []),
    (HERMES, '<tool_call>\n{"arguments": {"x": 1}, "name": "late"}\n</tool_call>', None, [("late", {"x": 1})]),
    (HERMES, "<tool_call>\nnot json at all\n</tool_call> tail", "<tool_call>\nnot json at all\n</tool_call> tail",
     []),
    (LLAMA, '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Rome"}}; '
            '{"name": "get_time", "parameters": {"tz": "UTC", "n": 3}}', None,
     [("get_weather", {"city": "Rome"}), ("get_time", {"tz": "UTC", "n": 3})]),
    (LLAMA, '  {"name": "f", "parameters": {"deep": {"a": [{"b": "}"}]}}}', None, [("f", {"deep": {"a": [{"b": "}"}]}})]),
    (LLAMA, "Rome is sunny today.", "Rome is sunny today.", []),
]


@pytest.mark.parametrize("style, text, content, calls", CASES)
@pytest.mark.parametrize("sizes", [[len("x" * 10000)], [1], [3, 1, 7], [2, 5]])
def test_streamed_in_any_pieces_equals_whole(style, text, content, calls, sizes):
    whole_content, whole_calls = parse_tool_calls(style, text)
    assert whole_content == content
    assert [(c.name, json.loads(c.arguments)) for c in whole_calls] == calls
    streamed_content, streamed_calls, _ = stream(style, text, sizes)
    assert (streamed_content or None) == content
    assert [(c["name"], json.loads(c["arguments"])) for c in streamed_calls] == calls
    assert all(c["id"].startswith("call_") for c in streamed_calls) and len({c["id"] for c in streamed_calls}) == len(
        calls)


def test_arguments_are_the_raw_text_streamed_before_the_call_ends():
    parser = ToolCallParser(HERMES)
    first = parser.feed('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa')
    assert first.calls[0]["name"] == "get_weather" and first.calls[0]["arguments"] == '{"city": "Pa'
    second = parser.feed('ris"}}\n</tool_call>')
    assert second.calls == [{"index": 0, "arguments": 'ris"}'}] and not second.content
    assert parser.calls[0].arguments == '{"city": "Paris"}'


def test_one_call_when_parallel_calls_are_off():
    text = '<tool_call>\n{"name": "a", "arguments": {}}\n</tool_call>\n<tool_call>\n{"name": "b", "arguments": {}}\n' \
           '</tool_call>'
    content, calls, parser = stream(HERMES, text, [4], parallel=False)
    assert [c["name"] for c in calls] == ["a"] and [c.name for c in parser.calls] == ["a"] and not content


def test_a_call_cut_short_keeps_what_was_announced():
    content, calls = parse_tool_calls(HERMES, '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par')
    assert content is None and calls[0].name == "get_weather" and calls[0].arguments == '{"city": "Par'


def test_styles_are_detected_from_the_template():
    assert detect_style("{% if tools %}<tools>{{ tools }}</tools> answer with <tool_call>{...}</tool_call>") == "hermes"
    assert detect_style("<|start_header_id|>ipython<|end_header_id|> {\"name\": ..., \"parameters\": ...}") \
        == "llama3_json"
    assert detect_style("{{ messages }}") is None


def test_forced_calls_name_each_function_and_its_schema():
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}},
             {"type": "function", "function": {"name": "ping"}}]
    spec = forced_calls(HERMES, tools, parallel=False)
    tags = spec.tagged.tags
    assert spec.tagged.max_count == 1 and spec.tagged.separator == "\n"
    assert tags[0].begin == "<tool_call>\n" and tags[0].end == "\n</tool_call>"
    assert tags[0].schema_dict["properties"]["name"] == {"enum": ["get_weather"]}
    assert tags[0].schema_dict["properties"]["arguments"]["required"] == ["city"]
    assert tags[1].schema_dict["properties"]["arguments"] == {"type": "object"}
    llama = forced_calls(LLAMA, tools, parallel=True)
    assert llama.tagged.max_count is None and llama.tagged.separator == "; "
    assert "parameters" in llama.tagged.tags[0].schema_dict["properties"]
