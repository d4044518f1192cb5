"""Tiny random-weight chat models: a byte-level tokenizer with chat special tokens and a chat template.

The weights come from :func:`tests.engine.tiny_models.build_tiny_model`; the
tokenizer adds ``<|im_start|>``/``<|im_end|>`` (ids 257/258) after the 256
bytes and ``<|endoftext|>``, and ``tokenizer_config.json`` carries a
ChatML-style template. ``RICH_TEMPLATE`` exercises what real templates use:
block whitespace control, ``bos_token``, ``tojson`` of tools, a
``namespace``, loop controls and ``raise_exception``.
"""

from __future__ import annotations

import json
from pathlib import Path

from tests.engine.tiny_models import build_tiny_model

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_VOCAB_SIZE = 256 + len(SPECIAL_TOKENS)
IM_END_ID = 258

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first and message['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou answer briefly.<|im_end|>\\n' }}"
    "{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

RICH_TEMPLATE = """{{ bos_token }}
{% set ns = namespace(system='', turns=0) %}
{% for message in messages %}
    {% if message['role'] == 'system' %}
        {% set ns.system = message['content'] %}
        {% continue %}
    {% endif %}
    {% if (message['role'] == 'user') != (ns.turns % 2 == 0) %}
        {{ raise_exception('Conversation roles must alternate user/assistant/user/...') }}
    {% endif %}
    {% set ns.turns = ns.turns + 1 %}
<|im_start|>{{ message['role'] }}
    {% if loop.index0 <= 1 and ns.system %}
[{{ ns.system | trim }}]
    {% endif %}
{{ message['content'] | trim }}<|im_end|>
{% endfor %}
{% if tools %}
<|im_start|>tools
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}<|im_end|>
{% endif %}
{% if add_generation_prompt %}
<|im_start|>assistant
{% endif %}"""


def byte_tokenizer(specials: list[str]):
    """A byte-level ``tokenizers.Tokenizer`` (one id a byte) with ``specials`` as special tokens, ids from 256 on."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab={ch: i for i, ch in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(specials)
    return tok


def write_chat_tokenizer(folder: Path, chat_template: str | None = CHATML_TEMPLATE, *,
                         specials: list[str] = SPECIAL_TOKENS, **config) -> None:
    """A byte-level ``tokenizer.json`` with the chat special tokens (or ``specials``, ids from 256 on), and its
    ``tokenizer_config.json``."""
    byte_tokenizer(specials).save(str(folder / "tokenizer.json"))
    tokenizer_config = {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", **config}
    if chat_template is not None:
        tokenizer_config["chat_template"] = chat_template
    (folder / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))


def build_chat_model(folder: Path, chat_template: str | None = CHATML_TEMPLATE, arch: str = "qwen2",
                     **tokenizer_config) -> Path:
    """A tiny random ``arch`` model whose tokenizer speaks ChatML (EOS: ``<|im_end|>`` and ``<|endoftext|>``)."""
    build_tiny_model(folder, arch, vocab_size=CHAT_VOCAB_SIZE, eos_token_id=[256, IM_END_ID])
    write_chat_tokenizer(folder, chat_template, **tokenizer_config)
    return folder
