"""``kunlun-infer generate``: streams text in prompt order, reads prompt files, reports bad input in one line."""

import io
import json

import pytest

import kunlun_infer as ki
from kunlun_infer.cli import main
from kunlun_infer.commands.generate import DEFAULT_PROMPT, OrderedStream
from tests.engine.tiny_models import build_tiny_model, engine_overrides


class RecordingStream(io.StringIO):
    """stdout that remembers every write, to see text arrive piece by piece."""

    def __init__(self):
        super().__init__()
        self.writes = []

    def write(self, text):
        self.writes.append(text)
        return super().write(text)


@pytest.fixture(scope="module")
def model_args(tmp_path_factory):
    folder = build_tiny_model(tmp_path_factory.mktemp("cli-model"), "llama")
    return engine_overrides(model__path=str(folder))


def run_cli(*args):
    out, err = RecordingStream(), io.StringIO()
    code = main(["generate", *args], stdout=out, stderr=err)
    return code, out, err.getvalue()


def test_streams_the_prompt_then_the_text_as_it_is_produced(model_args):
    code, out, err = run_cli("prompt=def add(a, b):", "max_tokens=12", "ignore_eos=true", *model_args)
    assert code == 0, err
    with ki.LLM(overrides=model_args) as llm:
        expected = llm.generate("def add(a, b):", ki.SamplingParams(max_tokens=12, temperature=0, ignore_eos=True),
                                use_tqdm=False)[0].text
    assert out.getvalue() == "def add(a, b):" + expected + "\n"
    assert len([w for w in out.writes if w.strip()]) > 2  # several pieces, not one final print


def test_default_prompt_and_json_output(model_args):
    code, out, err = run_cli("max_tokens=3", "--json", *model_args)
    assert code == 0, err
    (line,) = out.getvalue().splitlines()
    record = json.loads(line)
    assert record["prompt"] == DEFAULT_PROMPT and record["finish_reason"] in ("stop", "length")
    assert 1 <= len(record["token_ids"]) <= 3 and record["time_to_first_token_s"] > 0


def test_prompts_file_prints_every_prompt_in_order(model_args, tmp_path):
    path = tmp_path / "prompts.txt"
    path.write_text("first\n\nsecond prompt\nthird\n")
    code, out, err = run_cli(f"prompts_file={path}", "max_tokens=4", "--stats", *model_args)
    assert code == 0, err
    text = out.getvalue()
    positions = [text.index(f"--- prompt {i}/3 ---\n{p}") for i, p in ((1, "first"), (2, "second prompt"),
                                                                        (3, "third"))]
    assert positions == sorted(positions)
    stats = json.loads(err.strip().splitlines()[-1])
    assert stats["num_requests_finished"] == 3 and stats["kv_blocks_free"] == stats["kv_blocks_total"]


def test_bad_sampling_value_is_one_line_naming_the_field(model_args):
    code, out, err = run_cli("max_tokens=0", *model_args)
    assert code != 0 and out.getvalue() == ""
    assert len(err.strip().splitlines()) == 1 and "max_tokens" in err


def test_missing_prompts_file_is_a_usage_error(model_args, tmp_path):
    code, _, err = run_cli(f"prompts_file={tmp_path / 'absent.txt'}", *model_args)
    assert code == 2 and "prompts_file" in err


def test_ordered_stream_holds_later_requests_until_their_turn():
    out = io.StringIO()
    stream = OrderedStream(out, ["a", "b"], ["A:", "B:"])
    stream.feed("b", "bee", False)
    stream.feed("a", "ay", False)
    assert out.getvalue() == "--- prompt 1/2 ---\nA:ay"
    stream.feed("b", "!", True)
    stream.feed("a", ".", True)
    assert out.getvalue() == "--- prompt 1/2 ---\nA:ay.\n--- prompt 2/2 ---\nB:bee!\n"
