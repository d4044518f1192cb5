"""Text to token ids and back, with the ``tokenizers`` library and a model folder's tokenizer files.

``tokenizer.json`` holds the whole pipeline, including the post-processor that
adds a BOS (or EOS) token; ``tokenizer_config.json`` (optional) names the
special tokens. Both are read the way ``transformers``' tokenizers-backed
tokenizer reads them, so that ``encode`` gives the ids
``AutoTokenizer(text)["input_ids"]`` gives for plain text: named special tokens
the pipeline does not know yet are registered as special tokens, and — as in
``transformers`` 5 — ``add_bos_token``/``add_eos_token`` in the config do not
override the post-processor of ``tokenizer.json``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import tokenizers
from tokenizers import AddedToken

from kunlun_infer.errors import ModelLoadError
from kunlun_infer.models.config import read_json

_NAMED_SPECIAL = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
_CLEANUPS = ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't"),
             (" 'm", "'m"), (" 's", "'s"), (" 've", "'ve"), (" 're", "'re"))


def _token(value: Any) -> AddedToken | None:
    if isinstance(value, str):
        return AddedToken(value, special=True, normalized=False)
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return AddedToken(value["content"], single_word=value.get("single_word", False),
                          lstrip=value.get("lstrip", False), rstrip=value.get("rstrip", False),
                          normalized=value.get("normalized", False), special=True)
    return None


class Tokenizer:
    """A model's tokenizer: ``encode``, ``decode``, special-token ids."""

    def __init__(self, backend: tokenizers.Tokenizer, config: dict[str, Any] | None = None):
        config = config or {}
        self.backend = backend
        named = {key: _token(config.get(key)) for key in _NAMED_SPECIAL}
        extra = config.get("extra_special_tokens") or config.get("additional_special_tokens") or []
        extra = extra.values() if isinstance(extra, dict) else extra
        known = {t.content for t in backend.get_added_tokens_decoder().values()}
        new = [t for t in [*named.values(), *map(_token, extra)] if t is not None and t.content not in known]
        if new:
            backend.add_special_tokens(new)
        self.bos_token = named["bos_token"].content if named["bos_token"] else None
        self.eos_token = named["eos_token"].content if named["eos_token"] else None
        self.bos_token_id = backend.token_to_id(self.bos_token) if self.bos_token else None
        eos_id = backend.token_to_id(self.eos_token) if self.eos_token else None
        self.eos_token_ids: tuple[int, ...] = () if eos_id is None else (eos_id,)
        self.chat_template: str | None = config.get("chat_template")
        self._clean_up_spaces = (bool(config.get("clean_up_tokenization_spaces"))
                                 and type(backend.model).__name__ != "BPE")

    @property
    def vocab_size(self) -> int:
        """Number of ids, added tokens included."""
        return self.backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``, with the special tokens the tokenizer adds (e.g. BOS)."""
        return self.backend.encode(text, add_special_tokens=True).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        """Text of ``ids``."""
        text = self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)
        if self._clean_up_spaces:
            for before, after in _CLEANUPS:
                text = text.replace(before, after)
        return text

    def id_to_token(self, token_id: int) -> str | None:
        """The vocabulary string of one id."""
        return self.backend.id_to_token(token_id)


def load_tokenizer(model_dir: str | Path) -> Tokenizer:
    """The tokenizer of ``model_dir`` (``tokenizer.json`` + optional ``tokenizer_config.json``)."""
    model_dir = Path(model_dir)
    path = model_dir / "tokenizer.json"
    if not path.is_file():
        raise ModelLoadError(f"{path} not found; kunlun_infer needs a fast-tokenizer tokenizer.json "
                             "(transformers writes one with tokenizer.save_pretrained)")
    try:
        backend = tokenizers.Tokenizer.from_file(str(path))
    except Exception as e:
        raise ModelLoadError(f"{path} is not a valid tokenizers file: {e}") from e
    config_path = model_dir / "tokenizer_config.json"
    return Tokenizer(backend, read_json(config_path) if config_path.is_file() else None)
