"""The tokenizer gives transformers' ids for plain prompts and reads special tokens from the folder."""

from __future__ import annotations

import json

import pytest
import transformers

from kunlun_infer.errors import ModelLoadError
from kunlun_infer.models import load_tokenizer
from tests.models.hf_factory import BOS_ID, EOS_ID, save_tiny_tokenizer

TEXTS = ["Hello world", "The quick brown fox", "  leading spaces and\ttabs\n", "Ünïcödé 中文 🙂",
         "text with </s> inside and <s> too", "x", "def f(a, b):\n    return a + b"]


def edit_config(folder, **changes):
    path = folder / "tokenizer_config.json"
    config = {k: v for k, v in {**json.loads(path.read_text()), **changes}.items() if v is not None}
    path.write_text(json.dumps(config))


@pytest.mark.parametrize("add_bos_token", [False, True])
def test_encode_and_decode_match_autotokenizer(add_bos_token, tmp_path):
    # transformers 5 lets tokenizer.json's post-processor decide; add_bos_token does not override it
    save_tiny_tokenizer(tmp_path, add_bos_token=add_bos_token)
    ours, hf = load_tokenizer(tmp_path), transformers.AutoTokenizer.from_pretrained(tmp_path)
    for text in TEXTS:
        ids = ours.encode(text)
        assert ids == hf(text)["input_ids"], text
        assert ours.decode(ids) == hf.decode(ids, skip_special_tokens=True)
        assert ours.decode(ids, skip_special_tokens=False) == hf.decode(ids, skip_special_tokens=False)
    assert ours.encode("a </s> b").count(EOS_ID) == 1  # a named special token is matched whole
    assert ours.eos_token_ids == (EOS_ID,) and ours.bos_token_id == BOS_ID
    assert ours.vocab_size == len(hf)


@pytest.mark.parametrize("template", ["<s> $A", "<s> $A </s>"])
def test_post_processor_of_tokenizer_json_adds_special_tokens(template, tmp_path):
    from tokenizers import Tokenizer, processors

    save_tiny_tokenizer(tmp_path)
    tok = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    tok.post_processor = processors.TemplateProcessing(single=template,
                                                       special_tokens=[("<s>", BOS_ID), ("</s>", EOS_ID)])
    tok.save(str(tmp_path / "tokenizer.json"))
    ours, hf = load_tokenizer(tmp_path), transformers.AutoTokenizer.from_pretrained(tmp_path)
    for text in TEXTS:
        ids = ours.encode(text)
        assert ids == hf(text)["input_ids"] and ids[0] == BOS_ID
        assert (ids[-1] == EOS_ID) == template.endswith("</s>")
        assert ours.decode(ids) == hf.decode(ids, skip_special_tokens=True)


def test_special_token_missing_from_vocab_is_added_like_transformers(tmp_path):
    save_tiny_tokenizer(tmp_path)
    edit_config(tmp_path, eos_token="<|im_end|>")
    ours, hf = load_tokenizer(tmp_path), transformers.AutoTokenizer.from_pretrained(tmp_path)
    assert ours.eos_token_ids == (hf.eos_token_id,)
    assert ours.encode("a<|im_end|>b") == hf("a<|im_end|>b")["input_ids"]


def test_folder_without_tokenizer_json(tmp_path):
    with pytest.raises(ModelLoadError, match="tokenizer.json not found"):
        load_tokenizer(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{}")
    with pytest.raises(ModelLoadError, match="tokenizer.json is not a valid tokenizers file"):
        load_tokenizer(tmp_path)


@pytest.mark.parametrize("clean_up", [False, True])
def test_word_level_decode_cleans_up_spaces_like_transformers(clean_up, tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = ["<unk>", "</s>", "hello", ",", "world", ".", "it", "'s", "n't", "?"]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "</s>", "unk_token": "<unk>",
         "clean_up_tokenization_spaces": clean_up}))
    ours, hf = load_tokenizer(tmp_path), transformers.AutoTokenizer.from_pretrained(tmp_path)
    text = "hello , world . it 's n't ?"
    ids = ours.encode(text)
    assert ids == hf(text)["input_ids"]
    assert ours.decode(ids) == hf.decode(ids, skip_special_tokens=True)
    assert (ours.decode(ids) == "hello, world. it'sn't?") == clean_up
