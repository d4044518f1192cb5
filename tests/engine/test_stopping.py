"""The stop decision: stop tokens, stop strings, length and ``min_tokens``, one token at a time."""

import pytest

from kunlun_infer.engine.detokenizer import IncrementalDetokenizer
from kunlun_infer.engine.params import SamplingParams
from kunlun_infer.engine.sequence import Sequence
from kunlun_infer.engine.stopping import stop_reason

EOS = 300


class ByteDecoder:
    """One token per byte; ids past 255 (EOS) decode to nothing, as special tokens do."""

    def decode(self, ids, skip_special_tokens=True):
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


def run(tokens, **params):
    """Feed ``tokens`` one by one as the engine does; ``(tokens taken, reason, final text)``."""
    seq = Sequence(0, "r", list(b"> "), SamplingParams(**params), eos_token_ids=(EOS,))
    text = IncrementalDetokenizer(ByteDecoder(), seq.token_ids, tuple(seq.params.stop))
    streamed = ""
    for token in tokens:
        seq.append_token(token)
        text.add_tokens([token])
        reason = stop_reason(seq, text)
        streamed += text.emit(final=reason is not None)
        if reason is not None:
            assert streamed == text.text  # what was streamed is the final text, never more
            return seq.num_generated_tokens, reason, text.text
    return seq.num_generated_tokens, None, text.text


def test_eos_and_stop_token_ids_stop_with_the_token_kept():
    assert run([*b"ab", EOS, *b"cd"], max_tokens=10) == (3, "stop", "ab")
    assert run(b"abcd", max_tokens=10, stop_token_ids=[ord("c")]) == (3, "stop", "abc")
    assert run([*b"ab", EOS, *b"cd"], max_tokens=4, ignore_eos=True) == (4, "length", "abc")


def test_length_ends_at_max_tokens_unless_a_stop_ends_there_too():
    assert run(b"abcdef", max_tokens=4) == (4, "length", "abcd")
    assert run([*b"abc", EOS], max_tokens=4) == (4, "stop", "abc")
    # a stop string completed by the last allowed token is a stop, and cut
    assert run(b"abXY", max_tokens=4, stop=["XY"]) == (4, "stop", "ab")


def test_stop_string_is_cut_wherever_it_starts_in_text_not_yet_streamed():
    assert run(b"one STOP two", max_tokens=20, stop=["STOP"]) == (8, "stop", "one ")
    assert run(b"xx END yy", max_tokens=20, stop=["STOP", "END"]) == (6, "stop", "xx ")


@pytest.mark.parametrize("min_tokens", [0, 1, 2, 3, 5])
def test_min_tokens_holds_back_stop_tokens_and_stop_strings_alike(min_tokens):
    # the stop token and the stop string each come as the 2nd token; later "XY" (tokens 7-8) can stop
    taken, reason, text = run([*b"aX", EOS, *b"bcdXY", *b"zzzz"], max_tokens=12, stop=["X", "Y"],
                              min_tokens=min_tokens)
    if min_tokens < 2:
        assert (taken, reason, text) == (2, "stop", "a")
    else:  # "X" at token 2 and EOS at token 3 end nothing; the next stop after min_tokens does
        first_stop = 3 if min_tokens < 3 else 7
        assert (taken, reason) == (first_stop, "stop")
        assert text.startswith("aX")
    assert taken > min_tokens or reason == "length"


def test_min_tokens_equal_to_max_tokens_lets_nothing_stop_early():
    assert run([*b"XY", EOS, *b"XY"], max_tokens=5, min_tokens=5, stop=["X"]) == (5, "length", "XYXY")


def test_incomplete_character_at_the_end_is_decoded_and_searched_for_stop_strings():
    # "é" is 0xC3 0xA9; its first byte alone is shown as U+FFFD when the length ends the text
    assert run([*b"ab", 0xC3], max_tokens=3) == (3, "length", "ab\ufffd")
    assert run([*b"ab", 0xC3], max_tokens=3, stop=["b\ufffd"]) == (3, "stop", "a")
