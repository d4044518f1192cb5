"""Fill-in-the-middle prompts: the text before and after a hole, for a code model to write what goes between.

Code models trained for infilling read the prefix and the suffix between
three special tokens of their vocabulary, prefix first, and write the middle
after the last (ending with their EOS). :data:`FIM_FORMATS` holds the token
sets of the model families that do so; a tokenizer that has all three
tokens of one (each a single id) gets that one. The prefix and the suffix
are tokenized as a plain prompt's text is (without the tokens added around
a whole prompt) and joined by the three tokens' ids; whatever the tokenizer
puts before any text (a BOS) comes first.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from kunlun_infer.errors import RequestError


class FimFormat(NamedTuple):
    """The special tokens of one infilling format: ``prefix`` + text + ``suffix`` + text + ``middle``."""

    name: str
    prefix: str
    suffix: str
    middle: str


#: the infilling formats known, in the order they are looked for
FIM_FORMATS = (
    FimFormat("qwen-coder", "<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"),  # Qwen2.5-Coder, Qwen3-Coder
    FimFormat("starcoder", "<fim_prefix>", "<fim_suffix>", "<fim_middle>"),  # StarCoder, StarCoder2
    FimFormat("santacoder", "<fim-prefix>", "<fim-suffix>", "<fim-middle>"),
    FimFormat("deepseek-coder", "<｜fim▁begin｜>", "<｜fim▁hole｜>", "<｜fim▁end｜>"),
)


def fim_format(tokenizer: Any) -> tuple[FimFormat, tuple[int, int, int]] | None:
    """The first of :data:`FIM_FORMATS` whose three tokens ``tokenizer`` has, with their ids; ``None`` if none."""
    for fmt in FIM_FORMATS:
        ids = tuple(tokenizer.backend.token_to_id(token) for token in (fmt.prefix, fmt.suffix, fmt.middle))
        if all(i is not None for i in ids):
            return fmt, ids  # type: ignore[return-value]
    return None


def fim_prompt(tokenizer: Any, prefix: str, suffix: str, *, field: str = "suffix") -> list[int]:
    """Token ids asking the model for the text between ``prefix`` and ``suffix``; :class:`RequestError` naming
    ``field`` when the model has no infilling tokens."""
    found = fim_format(tokenizer) if tokenizer is not None else None
    if found is None:
        known = "; ".join(f"{f.prefix} {f.suffix} {f.middle}" for f in FIM_FORMATS)
        raise RequestError(f"{field}: this model's tokenizer has no fill-in-the-middle tokens (looked for: {known}), "
                           f"so it cannot fill a hole; send the text before it as the prompt, without {field}",
                           field=field)
    _, (prefix_id, suffix_id, middle_id) = found
    bos = tokenizer.bos_token_id
    lead = [bos] if bos is not None and tokenizer.encode("")[:1] == [bos] else []  # a BOS the tokenizer adds

    def text(part: str) -> list[int]:
        return list(tokenizer.backend.encode(part, add_special_tokens=False).ids) if part else []

    return [*lead, prefix_id, *text(prefix), suffix_id, *text(suffix), middle_id]
