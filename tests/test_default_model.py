"""The embedded default model: it ships in the package, transformers agrees with the engine on it, it learned.

``kunlun_infer.LLM()`` with no model path loads ``kunlun_infer/default_model``
(trained by ``scripts/train_default_model.py`` on the CPython standard
library). transformers loads that folder as it is and its greedy output
equals the engine's token for token; the loss over validation windows (files
the training never saw, chosen by the script's own split) computed from the
engine's ``prompt_logprobs`` equals transformers' cross-entropy and is far
below the uniform baseline ``ln(vocab)``; and ``kunlun-infer generate``
prints Python-looking code out of the box.
"""

from __future__ import annotations

import io
import json
import math
import os
import platform
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
import torch

import kunlun_infer as ki
from kunlun_infer.cli import main
from kunlun_infer.commands.generate import DEFAULT_PROMPT
from kunlun_infer.engine.startup import default_model_dir
from tests.scripts import load_script
from tests.torch_threads import one_thread  # noqa: F401 - autouse: one torch thread per test

REPO = Path(__file__).resolve().parents[1]
MODEL_DIR = default_model_dir()
PROMPTS = [DEFAULT_PROMPT, "import os\n", "class Stack:\n    def __init__(self):", "for i in range(10):",
           "    return "]
MAX_NEW_TOKENS = 40
NUM_WINDOWS, WINDOW = 4, 256


@pytest.fixture(scope="module")
def llm():
    with ki.LLM() as llm:
        yield llm


@pytest.fixture(scope="module")
def hf():
    """``(tokenizer, model)`` of transformers, loaded from the shipped folder with no arguments."""
    import transformers as tf

    tokenizer = tf.AutoTokenizer.from_pretrained(MODEL_DIR)
    model = tf.AutoModelForCausalLM.from_pretrained(MODEL_DIR).eval()
    return tokenizer, model


def training_record() -> dict:
    return json.loads((MODEL_DIR / "training.json").read_text())


def test_the_package_ships_the_model_and_llm_uses_it_by_default(llm):
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
                 "generation_config.json"):
        assert (MODEL_DIR / name).is_file(), name
    assert sum(p.stat().st_size for p in MODEL_DIR.iterdir()) < 30 * 2**20
    assert Path(llm.engine.model_path).resolve() == MODEL_DIR.resolve()


def test_transformers_greedy_output_equals_the_engine_token_for_token(llm, hf):
    tokenizer, model = hf
    outputs = llm.generate(PROMPTS, ki.SamplingParams(max_tokens=MAX_NEW_TOKENS, temperature=0), use_tqdm=False)
    for prompt, out in zip(PROMPTS, outputs):
        ids = tokenizer(prompt, return_tensors="pt")["input_ids"]
        assert ids[0].tolist() == out.prompt_token_ids, prompt
        with torch.no_grad():
            reference = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                       max_new_tokens=MAX_NEW_TOKENS)[0, ids.shape[1]:].tolist()
        assert out.token_ids == reference, prompt
        assert out.text == tokenizer.decode(reference, skip_special_tokens=True)


@pytest.fixture(scope="module")
def validation_windows() -> torch.Tensor:
    """``NUM_WINDOWS`` windows of ``WINDOW + 1`` tokens, spread over the script's validation split."""
    from tokenizers import Tokenizer

    script = load_script("scripts/train_default_model.py")
    record = training_record()
    _, val_files, _ = script.collect_corpus(Path(sysconfig.get_paths()["stdlib"]),
                                            record["hyperparameters"]["val_per_10000"])
    assert val_files
    if record["corpus"]["python"] == platform.python_version():
        assert [rel for rel, _ in val_files] == record["corpus"]["val_file_names"]  # the same split as training
    tokenizer = Tokenizer.from_file(str(MODEL_DIR / "tokenizer.json"))
    stream = script.encode_files(tokenizer, [text for _, text in val_files], record["eot_id"])
    windows = script.windows(stream, WINDOW)
    assert len(windows) >= NUM_WINDOWS
    return windows[torch.linspace(0, len(windows) - 1, NUM_WINDOWS).long()]


def test_validation_loss_from_prompt_logprobs_equals_transformers_and_shows_learning(llm, hf, validation_windows):
    _, model = hf
    outputs = llm.generate([w.tolist() for w in validation_windows],
                           ki.SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0), use_tqdm=False)
    scored = [entry[token] for w, out in zip(validation_windows, outputs)
              for token, entry in zip(w.tolist()[1:], out.prompt_logprobs[1:])]
    assert len(scored) == NUM_WINDOWS * WINDOW
    engine_loss = -sum(scored) / len(scored)
    with torch.no_grad():
        logits = model(validation_windows[:, :-1]).logits.float()
    hf_loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                                validation_windows[:, 1:].reshape(-1)).item()
    assert engine_loss == pytest.approx(hf_loss, rel=0.01)
    uniform = math.log(model.config.vocab_size)
    assert engine_loss < 0.6 * uniform, (engine_loss, uniform)


def looks_like_python(text: str) -> bool:
    return "\n" in text and any(mark in text for mark in ("return", "(", ":", "=")) and text.strip() != ""


def test_llm_with_no_arguments_writes_python_looking_code(llm):
    out = llm.generate(DEFAULT_PROMPT, ki.SamplingParams(max_tokens=48, temperature=0), use_tqdm=False)[0]
    assert len(out.token_ids) > 4
    assert looks_like_python(out.text), out.text


def test_generate_command_streams_code_out_of_the_box(llm):
    env = {**os.environ, "PYTHONIOENCODING": "utf-8"}
    proc = subprocess.run([sys.executable, "-m", "kunlun_infer", "generate", f"prompt={DEFAULT_PROMPT}",
                           "max_tokens=48"], capture_output=True, text=True, timeout=300, cwd=REPO, env=env)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith(DEFAULT_PROMPT) and len(proc.stdout) > len(DEFAULT_PROMPT) + 40, proc.stdout
    assert looks_like_python(proc.stdout[len(DEFAULT_PROMPT):]), proc.stdout

    class Recording(io.StringIO):
        def __init__(self):
            super().__init__()
            self.pieces = []

        def write(self, text):
            self.pieces.append(text)
            return super().write(text)

    out = Recording()
    assert main(["generate", "max_tokens=48"], stdout=out, stderr=io.StringIO()) == 0  # the default prompt
    expected = llm.generate(DEFAULT_PROMPT, ki.SamplingParams(max_tokens=48, temperature=0), use_tqdm=False)[0]
    assert out.getvalue() == DEFAULT_PROMPT + expected.text + "\n"
    assert len([p for p in out.pieces if p.strip()]) > 2  # streamed piece by piece, not printed at the end


CONVERSATION = [{"role": "system", "content": "You write Python."},
                {"role": "user", "content": "Write a function\nthat adds two numbers."},
                {"role": "assistant", "content": "def add(a, b):\n    return a + b"},
                {"role": "user", "content": "Now one that subtracts."}]


def test_chat_works_out_of_the_box_with_the_template_transformers_renders(llm, hf):
    tokenizer, _ = hf
    expected = tokenizer.apply_chat_template(CONVERSATION, add_generation_prompt=True)
    expected = list(expected["input_ids"] if not isinstance(expected, list) else expected)
    out = llm.chat(CONVERSATION, ki.SamplingParams(max_tokens=16, temperature=0), use_tqdm=False)[0]
    assert out.prompt_token_ids == expected
    assert len(out.token_ids) > 0 and out.finish_reason in ("stop", "length")
    # the conversation reads as Python comments, the assistant's turn as code ending with the EOS token
    rendered = tokenizer.decode(expected)
    assert rendered.startswith("# system: You write Python.\n# user: Write a function\n# that adds")
    assert "def add(a, b):\n    return a + b<|endoftext|>" in rendered


def test_the_server_answers_chat_completions_on_the_default_model():
    import openai

    from tests.server.harness import RunningServer

    with ki.LLM() as fresh:
        server = RunningServer(fresh.engine, model_name="default")
        try:
            client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
            reply = client.chat.completions.create(model="default", messages=CONVERSATION[:2], max_tokens=12,
                                                   temperature=0)
        finally:
            server.stop()
    assert reply.choices[0].message.role == "assistant"
    assert reply.choices[0].finish_reason in ("stop", "length") and reply.usage.completion_tokens > 0
