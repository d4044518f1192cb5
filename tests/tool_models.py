"""A tiny chat model that calls tools: a template with a tools section, trained here to use it.

The tokenizer is a byte-level BPE trained on the lessons' text (so a lesson
is a few hundred tokens, not one per byte), with the chat special tokens and
``<tool_call>``/``</tool_call>`` as ordinary added tokens (as in Qwen's
vocabulary, so they stay in the decoded text). ``HERMES_TEMPLATE``
lists the tools as JSON in a system turn, writes an assistant's calls as
``<tool_call>\\n{"name": ..., "arguments": ...}\\n</tool_call>`` and a tool's
result as a ``<tool_response>`` in a user turn. ``LLAMA_TEMPLATE`` writes
calls the Llama 3.1 way: ``{"name": ..., "parameters": ...}`` and results in
an ``ipython`` turn.

:func:`build_tool_model` trains a random 2-layer model with ``transformers``
and torch for a few hundred steps until its greedy answers to
:data:`LESSONS` are the taught ones: a call, two parallel calls, a reply to a
tool's result, and a plain greeting. The rendered prompts come from the
template itself, so what the server renders is what the model learned.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from tests.chat_models import SPECIAL_TOKENS

TOOL_TOKENS = ["<tool_call>", "</tool_call>"]
VOCAB_SIZE = 640
EOS_IDS = [0, 2]  # <|endoftext|>, <|im_end|>: the special tokens come first

HERMES_TEMPLATE = """{%- if tools %}
<|im_start|>system
{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] }}
{% endif %}Tools you may call:
<tools>
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}</tools>
To call one, answer with <tool_call>
{"name": <name>, "arguments": <object>}
</tool_call><|im_end|>
{% elif messages[0]['role'] == 'system' %}
<|im_start|>system
{{ messages[0]['content'] }}<|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message['role'] == 'assistant' %}
<|im_start|>assistant
{% if message['content'] %}{{ message['content'] }}{% endif %}
{%- for call in message.get('tool_calls') or [] %}
{%- set fn = call['function'] if call['function'] is defined else call %}
{% if not loop.first or message['content'] %}{{ '\n' }}{% endif %}<tool_call>
{"name": {{ fn['name'] | tojson }}, "arguments": {{ fn['arguments'] | tojson }}}
</tool_call>
{%- endfor %}<|im_end|>
{% elif message['role'] == 'tool' %}
<|im_start|>user
<tool_response>
{{ message['content'] }}
</tool_response><|im_end|>
{% elif message['role'] != 'system' %}
<|im_start|>{{ message['role'] }}
{{ message['content'] }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}
<|im_start|>assistant
{% endif %}"""

LLAMA_TEMPLATE = """{%- if tools %}
<|im_start|>system
Environment: ipython. Answer with a JSON function call {"name": ..., "parameters": ...} to one of:
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}<|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message['role'] == 'assistant' and message.get('tool_calls') %}
<|im_start|>assistant
{% for call in message['tool_calls'] %}{% if not loop.first %}; {% endif %}
{{- {"name": call['function']['name'], "parameters": call['function']['arguments']} | tojson }}
{%- endfor %}<|im_end|>
{% elif message['role'] == 'tool' %}
<|im_start|>ipython
{{ message['content'] }}<|im_end|>
{% else %}
<|im_start|>{{ message['role'] }}
{{ message['content'] }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}
<|im_start|>assistant
{% endif %}"""

TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "Weather now",
        "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                                        "unit": {"enum": ["C", "F"]}},
                       "required": ["city"]}}},
    {"type": "function", "function": {
        "name": "get_time", "description": "Local time",
        "parameters": {"type": "object", "properties": {"zone": {"type": "string", "maxLength": 8}},
                       "required": ["zone"]}}},
]


def call(name: str, **arguments) -> dict:
    return {"id": f"call_{name}", "type": "function", "function": {"name": name, "arguments": json.dumps(arguments)}}


ASK_PARIS = [{"role": "user", "content": "Weather in Paris?"}]
ASK_TWO = [{"role": "user", "content": "Weather in Paris and Rome?"}]
PARIS_CALL = {"role": "assistant", "content": None, "tool_calls": [call("get_weather", city="Paris")]}
TOOL_RESULT = [*ASK_PARIS, PARIS_CALL, {"role": "tool", "tool_call_id": "call_get_weather", "content": "18 C, sun"}]
GREET = [{"role": "user", "content": "Hello!"}]

#: (conversation, the assistant message taught as its answer), all with TOOLS offered
LESSONS = [
    (ASK_PARIS, PARIS_CALL),
    (ASK_TWO, {"role": "assistant", "content": None,
               "tool_calls": [call("get_weather", city="Paris"), call("get_weather", city="Rome")]}),
    (TOOL_RESULT, {"role": "assistant", "content": "It is 18 C and sunny in Paris."}),
    (GREET, {"role": "assistant", "content": "Hi! Ask me about the weather."}),
]


def _lesson_texts(template: str) -> list[tuple[str, str]]:
    """(prompt, prompt + taught answer) per lesson, rendered as the server renders a request."""
    from kunlun_infer.chat import ChatTemplate
    from kunlun_infer.server.protocol import ChatMessage

    chat = ChatTemplate(template)
    texts = []
    for messages, answer in LESSONS:  # tool-call arguments become objects, as for any request
        messages = [ChatMessage(**m).for_template() for m in messages]
        answer = ChatMessage(**answer).for_template()
        prompt = chat.render(messages, tools=TOOLS, add_generation_prompt=True)
        whole = chat.render([*messages, answer], tools=TOOLS, add_generation_prompt=False)
        assert whole.startswith(prompt), "the template must render the answer after the prompt"
        texts.append((prompt, whole))
    return texts


def write_tool_tokenizer(folder: Path, template: str, texts: list[str]) -> None:
    """A byte-level BPE of :data:`VOCAB_SIZE` tokens trained on ``texts``, and its ``tokenizer_config.json``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE - len(TOOL_TOKENS), special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    tok.add_tokens(TOOL_TOKENS)
    tok.save(str(folder / "tokenizer.json"))
    config = {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "chat_template": template}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))


def _examples(folder: Path, texts: list[tuple[str, str]]) -> list[tuple[list[int], int]]:
    """(token ids of conversation + taught answer, where the answer starts) per lesson."""
    from kunlun_infer.chat import encode_prompt
    from kunlun_infer.models import load_tokenizer

    tokenizer = load_tokenizer(folder)
    examples = []
    for prompt, whole in texts:
        ids = encode_prompt(tokenizer, whole)
        start = len(encode_prompt(tokenizer, prompt))
        assert ids[:start] == encode_prompt(tokenizer, prompt), "the prompt's tokens must begin the lesson's"
        examples.append((ids, start))
    return examples


def build_tool_model(folder: Path, template: str = HERMES_TEMPLATE, *, max_steps: int = 600) -> Path:
    """Train the tiny tool model into ``folder`` (seeded: the same weights every time on one machine).

    ``max_steps=0`` leaves the weights random (for what structured output forces anyway).
    """
    import transformers as tf

    folder.mkdir(parents=True, exist_ok=True)
    texts = _lesson_texts(template)
    write_tool_tokenizer(folder, template, [whole for _, whole in texts])
    examples = _examples(folder, texts)
    config = tf.Qwen2Config(vocab_size=VOCAB_SIZE, hidden_size=96, intermediate_size=192, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                            eos_token_id=EOS_IDS, bos_token_id=None, pad_token_id=None, tie_word_embeddings=True)
    torch.manual_seed(0)
    model = tf.Qwen2ForCausalLM(config).to(torch.float32)
    width = max(len(ids) for ids, _ in examples)
    inputs = torch.zeros(len(examples), width, dtype=torch.long)
    labels = torch.full((len(examples), width), -100, dtype=torch.long)
    for row, (ids, start) in enumerate(examples):
        inputs[row, :len(ids)] = torch.tensor(ids)
        labels[row, start:len(ids)] = torch.tensor(ids[start:])  # learn the answers only
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    model.train()
    for step in range(max_steps):  # noqa: B007 - the loop's else needs it
        loss = model(input_ids=inputs, labels=labels).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if step % 25 == 24 and _answers_exactly(model, inputs, labels):
            break
    else:
        if max_steps:
            raise AssertionError(f"the tool model did not learn its lessons in {max_steps} steps (loss {loss:.3f})")
    model.eval()
    model.save_pretrained(folder, safe_serialization=True)
    return folder


@torch.no_grad()
def _answers_exactly(model: torch.nn.Module, inputs: torch.Tensor, labels: torch.Tensor) -> bool:
    """Every taught token is the argmax, by a margin no kernel's rounding can flip."""
    model.eval()
    logits = model(input_ids=inputs).logits[:, :-1]
    model.train()
    targets = labels[:, 1:]
    taught = targets != -100
    top2 = logits.topk(2, dim=-1)
    right = top2.indices[..., 0] == targets
    margin = top2.values[..., 0] - top2.values[..., 1]
    return bool((right | ~taught).all()) and bool((margin[taught] > 2.0).all())
