"""Streamed text through the engine: deltas add up to the final text, never a broken character or a partial stop.

The tiny models' tokenizer is byte-level, one token per byte, so a
multi-byte character always arrives over several steps.
"""

import pytest

from kunlun_infer import SamplingParams
from kunlun_infer.engine.detokenizer import IncrementalDetokenizer
from kunlun_infer.models import load_tokenizer

TEXT = "naïve café — 数据 😀 ok"


def stream(engine, prompt, params):
    """Run one request to the end; ``{index: [delta, ...]}`` and ``{index: final output}``."""
    engine.add_request(prompt, params)
    deltas, finals = {}, {}
    while engine.has_unfinished():
        for out in engine.step():
            pieces = deltas.setdefault(out.index, [])
            assert out.text == "".join(pieces) + out.delta_text  # text only ever grows by the delta
            pieces.append(out.delta_text)
            if out.finished:
                finals[out.index] = out
    return deltas, finals


def test_real_tokenizer_streams_multibyte_characters_whole(tiny_model):
    tokenizer = load_tokenizer(tiny_model("llama"))
    ids = tokenizer.encode(TEXT)
    assert len(ids) == len(TEXT.encode())  # one token per byte
    for stop in ((), ("数据",), ("😀 o",)):
        detok = IncrementalDetokenizer(tokenizer, tokenizer.encode("prompt: "), stop)
        pieces = []
        for token in ids:
            detok.add_tokens([token])
            stopped = detok.cut_at_stop_string()
            pieces.append(detok.emit())
            if stopped:
                break
        pieces.append(detok.emit(final=True))
        expected = TEXT[:TEXT.index(stop[0])] if stop else TEXT
        assert "".join(pieces) == expected == detok.text
        assert not any("\ufffd" in p for p in pieces)
        if stop:  # nothing of the stop string leaked before it was complete
            assert stop[0][0] not in "".join(pieces)


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_engine_deltas_add_up_to_the_full_decode(tiny_model, make_llm, seed):
    llm = make_llm(tiny_model("llama"))
    params = SamplingParams(max_tokens=40, temperature=1.0, seed=seed, ignore_eos=True, n=2)
    deltas, finals = stream(llm.engine, "héllo 数", params)
    for index, final in finals.items():
        full = llm.tokenizer.decode(final.token_ids)
        assert "".join(deltas[index]) == final.text == full
        # a character whose bytes were still arriving was never shown broken: every streamed U+FFFD is in the
        # full decode at the same place
        streamed = "".join(deltas[index])
        assert [i for i, ch in enumerate(streamed) if ch == "\ufffd"] == [i for i, ch in enumerate(full)
                                                                          if ch == "\ufffd"]


def test_engine_never_streams_part_of_a_stop_string(tiny_model, make_llm):
    llm = make_llm(tiny_model("llama"))
    base = SamplingParams(max_tokens=40, temperature=1.0, seed=5, ignore_eos=True)
    text = llm.generate("Once upon", base, use_tqdm=False)[0].text
    start = next(i for i in range(4, len(text) - 3) if "\ufffd" not in text[i:i + 3])
    stop = text[start:start + 3]
    cut = text[:text.index(stop)]
    deltas, finals = stream(llm.engine, "Once upon", SamplingParams(max_tokens=40, temperature=1.0, seed=5,
                                                                      ignore_eos=True, stop=[stop]))
    assert finals[0].finish_reason == "stop"
    assert "".join(deltas[0]) == finals[0].text == cut
