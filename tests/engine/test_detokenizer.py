"""Streaming text: no broken multi-byte characters, no partial stop strings."""

from kunlun_infer.engine.detokenizer import IncrementalDetokenizer


class ByteDecoder:
    """Each token is one byte, like the byte fallback of a BPE vocabulary."""

    def decode(self, ids, skip_special_tokens=True):
        return bytes(ids).decode("utf-8", errors="replace")


def stream(text, stop=(), prompt="ab"):
    detok = IncrementalDetokenizer(ByteDecoder(), list(prompt.encode()), tuple(stop))
    pieces = []
    for byte in text.encode():
        detok.add_tokens([byte])
        stopped = detok.cut_at_stop_string()
        pieces.append(detok.emit())
        if stopped:
            break
    pieces.append(detok.emit(final=True))
    return pieces, detok.text


def test_multibyte_characters_are_never_split():
    text = "héllo 😀 世界"
    pieces, final = stream(text)
    assert "".join(pieces) == text == final
    assert all("\ufffd" not in p for p in pieces)


def test_stop_string_is_cut_and_never_partially_emitted():
    pieces, final = stream("one two STOP three", stop=["STOP"])
    assert final == "one two "
    assert "".join(pieces) == "one two "
    assert not any("S" in p for p in pieces)


def test_text_resembling_a_stop_string_is_released_once_it_diverges():
    pieces, final = stream("a STAR is born", stop=["STOP"])
    assert final == "a STAR is born" == "".join(pieces)


def test_earliest_of_several_stop_strings_wins():
    _, final = stream("xx END yy STOP", stop=["STOP", "END"])
    assert final == "xx "


def test_incomplete_character_at_the_end_is_shown_on_finish():
    detok = IncrementalDetokenizer(ByteDecoder(), [97])
    detok.add_tokens([104, 0xE4, 0xB8])  # "h" then 2 of 3 bytes of a CJK character
    assert detok.emit() == "h"
    assert detok.emit(final=True) == "\ufffd"
