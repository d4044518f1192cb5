"""Fill-in-the-middle prompts for each infilling format, built from tokenizers that have its tokens."""

import pytest
from tokenizers import processors

import kunlun_infer as ki
from kunlun_infer.fim import FIM_FORMATS, fim_format, fim_prompt
from kunlun_infer.models.tokenizer import Tokenizer as ModelTokenizer
from tests.chat_models import byte_tokenizer


def fim_tokenizer(specials, bos=None):
    """A byte-level model tokenizer with ``specials``; with ``bos``, one its post-processor puts first."""
    tok = byte_tokenizer(list(specials) + ([bos] if bos else []))
    if bos:
        tok.post_processor = processors.TemplateProcessing(single=f"{bos} $A",
                                                           special_tokens=[(bos, 256 + len(specials))])
    return ModelTokenizer(tok, {"bos_token": bos} if bos else {})


def byte_ids(tok, text):
    return list(tok.backend.encode(text, add_special_tokens=False).ids)


@pytest.mark.parametrize("fmt", FIM_FORMATS, ids=lambda f: f.name)
def test_each_format_joins_prefix_and_suffix_by_its_tokens(fmt):
    tok = fim_tokenizer(["<|endoftext|>", fmt.prefix, fmt.suffix, fmt.middle])
    p, s, m = (tok.backend.token_to_id(t) for t in (fmt.prefix, fmt.suffix, fmt.middle))
    assert fim_format(tok)[0] == fmt
    ids = fim_prompt(tok, "def add(a, b):\n    ", "\n\nprint(add(1, 2))")
    assert ids == [p, *byte_ids(tok, "def add(a, b):\n    "), s, *byte_ids(tok, "\n\nprint(add(1, 2))"), m]
    assert fim_prompt(tok, "", "x") == [p, s, *byte_ids(tok, "x"), m]


def test_a_bos_the_tokenizer_adds_comes_first():
    fmt = FIM_FORMATS[-1]
    tok = fim_tokenizer([fmt.prefix, fmt.suffix, fmt.middle], bos="<｜begin▁of▁sentence｜>")
    assert tok.encode("a")[0] == tok.bos_token_id
    ids = fim_prompt(tok, "a", "b")
    assert ids[:2] == [tok.bos_token_id, tok.backend.token_to_id(fmt.prefix)] and ids.count(tok.bos_token_id) == 1


def test_a_tokenizer_without_the_tokens_is_a_request_error_naming_the_field():
    partial = fim_tokenizer(["<|fim_prefix|>", "<|fim_suffix|>"])  # no middle token: no format is whole
    assert fim_format(partial) is None
    with pytest.raises(ki.RequestError, match="no fill-in-the-middle tokens") as err:
        fim_prompt(partial, "a", "b")
    assert err.value.field == "suffix"
