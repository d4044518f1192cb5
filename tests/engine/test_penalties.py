"""Penalties, min_p and min_tokens: each matches its usual definition computed directly on the logits."""

import dataclasses
import gc
import weakref

import pytest
import torch

from kunlun_infer.engine.params import SamplingParams
from kunlun_infer.engine.penalties import apply_penalties
from kunlun_infer.engine.sampler import Sampler, apply_min_p
from kunlun_infer.errors import RequestError
from tests.engine.tiny_models import EOS_ID

VOCAB = 12


@dataclasses.dataclass
class History:
    token_ids: list[int]
    num_prompt_tokens: int
    stop_token_ids: frozenset = frozenset()


HISTORIES = [History([1, 2, 2, 3, 5, 5, 5], 4), History([7, 0], 1), History([4], 1)]


def random_logits(rows=3, seed=0):
    return torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3


def greedy(**keys):
    return SamplingParams(temperature=0.0, **keys)


def test_repetition_penalty_matches_transformers_over_prompt_and_output():
    from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

    logits = random_logits()
    for penalty in (1.5, 0.7):
        ours = apply_penalties(logits, HISTORIES, [greedy(repetition_penalty=penalty)] * 3)
        for row, h in enumerate(HISTORIES):
            theirs = RepetitionPenaltyLogitsProcessor(penalty)(torch.tensor([h.token_ids]), logits[row:row + 1].clone())
            torch.testing.assert_close(ours[row:row + 1], theirs)
            for t in range(VOCAB):  # and the definition, token by token
                raw = logits[row, t].item()
                want = (raw / penalty if raw > 0 else raw * penalty) if t in h.token_ids else raw
                assert ours[row, t].item() == pytest.approx(want)


def test_presence_and_frequency_penalties_count_output_tokens_only():
    logits = random_logits()
    params = [greedy(presence_penalty=0.5, frequency_penalty=0.25), greedy(presence_penalty=-1.0),
              greedy(frequency_penalty=2.0)]
    ours = apply_penalties(logits, HISTORIES, params)
    for row, (h, p) in enumerate(zip(HISTORIES, params)):
        output = h.token_ids[h.num_prompt_tokens:]
        for t in range(VOCAB):
            count = output.count(t)
            want = logits[row, t].item() - p.frequency_penalty * count - p.presence_penalty * (count > 0)
            assert ours[row, t].item() == pytest.approx(want), (row, t)
    # the prompt's tokens (2, 3 in row 0) are untouched by presence/frequency
    assert ours[0, 3].item() == pytest.approx(logits[0, 3].item())


def dense_penalties(logits, histories, params):
    """The penalties' definition, over the whole vocabulary of every row."""
    vocab = logits.shape[-1]
    want = logits.clone()
    for row, (h, p) in enumerate(zip(histories, params)):
        output = torch.bincount(torch.tensor(h.token_ids[h.num_prompt_tokens:], dtype=torch.int64),
                                minlength=vocab).float()
        seen = torch.bincount(torch.tensor(h.token_ids), minlength=vocab) > 0
        if p.repetition_penalty != 1:
            raw = want[row]
            want[row] = torch.where(seen, torch.where(raw > 0, raw / p.repetition_penalty,
                                                      raw * p.repetition_penalty), raw)
        want[row] = want[row] - p.frequency_penalty * output - p.presence_penalty * (output > 0)
    return want


LONG_PARAMS = [greedy(repetition_penalty=1.3, presence_penalty=0.4, frequency_penalty=0.1), greedy(),
               greedy(repetition_penalty=0.8), greedy(frequency_penalty=-0.5), greedy(presence_penalty=1.5),
               greedy(repetition_penalty=1.05, frequency_penalty=0.2)]


def test_penalties_over_long_histories_equal_their_definition_on_the_whole_vocabulary():
    g = torch.Generator().manual_seed(4)
    vocab, rows = 3000, 6
    logits = torch.randn(rows, vocab, generator=g) * 4
    histories = [History(torch.randint(0, 400, (300 + 50 * r,), generator=g).tolist(), 200) for r in range(rows)]
    assert torch.equal(apply_penalties(logits, histories, LONG_PARAMS), dense_penalties(logits, histories, LONG_PARAMS))


@dataclasses.dataclass(eq=False)  # hashable and weakly referable, as the engine's sequences are
class Tracked:
    token_ids: list[int]
    num_prompt_tokens: int
    stop_token_ids: frozenset = frozenset()


class CountingList(list):
    """A list that counts the elements read through slices."""

    read = 0

    def __getitem__(self, index):
        got = super().__getitem__(index)
        if isinstance(index, slice):
            CountingList.read += len(got)
        return got


def test_tallies_follow_histories_step_by_step_and_read_only_the_new_tokens():
    g = torch.Generator().manual_seed(5)
    vocab, rows = 3000, 6
    histories = [Tracked(CountingList(torch.randint(0, 400, (150 + 40 * r,), generator=g).tolist()), 100 + r)
                 for r in range(rows)]
    tallies = weakref.WeakKeyDictionary()
    for step in range(30):  # past 64 distinct tokens a row: the tallies' storage grows
        logits = torch.randn(rows, vocab, generator=g) * 4
        CountingList.read = 0
        ours = apply_penalties(logits, histories, LONG_PARAMS, tallies)
        read = CountingList.read
        assert torch.equal(ours, dense_penalties(logits, histories, LONG_PARAMS)), step
        if step:  # one token added to each penalized row since the last step, and only that one read
            assert read == rows - 1
        for r, h in enumerate(histories):
            h.token_ids.append(int(torch.randint(0, 400 if step % 3 else vocab, (1,), generator=g)) + r)
    assert len(tallies) == rows - 1  # the row without penalties has none


def test_a_history_changed_behind_its_tally_is_counted_again():
    g = torch.Generator().manual_seed(6)
    vocab = 500
    h = Tracked(torch.randint(0, 50, (80,), generator=g).tolist(), 30)
    params = [greedy(repetition_penalty=1.4, frequency_penalty=0.3, presence_penalty=0.2)]
    tallies = weakref.WeakKeyDictionary()
    logits = torch.randn(1, vocab, generator=g) * 4

    def check():
        assert torch.equal(apply_penalties(logits, [h], params, tallies), dense_penalties(logits, [h], params))

    check()
    del h.token_ids[-5:]  # tokens taken back
    check()
    h.token_ids[-1] = 400  # the last token replaced, same length
    check()
    del h.token_ids[-3:]
    h.token_ids += [401, 402, 403, 404]  # taken back and others put in their place, longer than before
    check()
    h.token_ids, h.num_prompt_tokens = h.token_ids[:40], 40  # a new prompt of the same tokens
    check()


def test_the_samplers_tallies_drop_with_their_sequences():
    sampler = Sampler(torch.Generator().manual_seed(0))
    histories = [Tracked([1, 2, 3, 4], 2), Tracked([5, 6], 1)]
    params = [greedy(repetition_penalty=1.5), greedy(frequency_penalty=0.5)]
    sampler(torch.randn(2, VOCAB), params, [None, None], histories)
    assert len(sampler.tallies) == 2
    del histories
    gc.collect()
    assert len(sampler.tallies) == 0


def test_rows_without_penalties_are_untouched_in_a_mixed_batch():
    logits = random_logits()
    ours = apply_penalties(logits, HISTORIES, [greedy(), greedy(repetition_penalty=2.0), greedy()])
    torch.testing.assert_close(ours[0], logits[0])
    torch.testing.assert_close(ours[2], logits[2])
    assert not torch.equal(ours[1], logits[1])


def test_greedy_sampler_picks_the_argmax_of_the_penalized_logits():
    logits = torch.zeros(1, VOCAB)
    logits[0, 5], logits[0, 6] = 3.0, 2.0  # 5 is best, but it was already generated three times
    sampler = Sampler(torch.Generator().manual_seed(0))
    assert sampler(logits, [greedy()], [None], HISTORIES[:1]).token_ids == [5]
    assert sampler(logits, [greedy(frequency_penalty=0.5)], [None], HISTORIES[:1]).token_ids == [6]
    assert sampler(logits, [greedy(repetition_penalty=2.0)], [None], HISTORIES[:1]).token_ids == [6]
    # logprobs stay those of the model's raw distribution
    out = sampler(logits, [greedy(frequency_penalty=0.5, logprobs=0)], [None], HISTORIES[:1])
    assert out.logprobs[0][6] == pytest.approx(torch.log_softmax(logits[0], -1)[6].item())


def test_min_p_drops_tokens_below_a_fraction_of_the_best_one():
    probs = torch.tensor([[0.5, 0.3, 0.12, 0.08], [0.25, 0.25, 0.25, 0.25]])
    kept = apply_min_p(probs.clone(), torch.tensor([0.2, 0.9])) > 0
    # row 0: threshold 0.1 drops 0.08; row 1: all equal to the best, all kept
    assert kept.tolist() == [[True, True, True, False], [True] * 4]
    logits = probs[:1].log().expand(3000, 4).contiguous()
    draws = Sampler(torch.Generator().manual_seed(1))(logits, [SamplingParams(min_p=0.3)] * 3000, [None] * 3000,
                                                      [History([0], 1)] * 3000)
    counts = torch.bincount(torch.tensor(draws.token_ids), minlength=4).float() / 3000
    assert counts[2] == 0 and counts[3] == 0  # 0.12 and 0.08 < 0.3 * 0.5
    assert counts[0].item() == pytest.approx(0.5 / 0.8, abs=0.04)  # the survivors renormalized


def test_min_tokens_masks_stop_tokens_until_reached():
    logits = torch.zeros(2, VOCAB)
    logits[:, 9] = 5.0  # 9 is a stop token and by far the most likely
    stop = frozenset({9})
    rows = [History([1, 2], 1, stop), History([1, 2, 3, 4], 1, stop)]  # 1 and 3 tokens generated
    sampler = Sampler(torch.Generator().manual_seed(0))
    assert sampler(logits, [greedy(min_tokens=3)] * 2, [None] * 2, rows).token_ids == [0, 9]
    # sampled rows short of min_tokens never draw it either
    draws = sampler(logits[:1].expand(500, VOCAB).contiguous(), [SamplingParams(min_tokens=3)] * 500, [None] * 500,
                    rows[:1] * 500)
    assert 9 not in draws.token_ids


@pytest.mark.parametrize("field, value", [("repetition_penalty", 0.0), ("repetition_penalty", float("inf")),
                                          ("presence_penalty", 2.5), ("frequency_penalty", -3),
                                          ("min_p", 1.5), ("min_p", -0.1), ("min_tokens", -1), ("min_tokens", 99),
                                          ("n", 0), ("n", 1.5)])
def test_bad_values_name_the_field(field, value):
    with pytest.raises(RequestError) as err:
        SamplingParams(max_tokens=16, **{field: value})
    assert err.value.field == field and field in str(err.value)


# ---------------------------------------------------------------- end to end, against the model's own logits


def penalized_greedy_reference(hf, prompt, steps, penalize):
    """Greedy decoding with transformers' logits and ``penalize(logits, prompt, output)`` applied directly."""
    tokens = list(prompt)
    with torch.no_grad():
        for _ in range(steps):
            logits = hf(torch.tensor([tokens])).logits[0, -1].float()
            tokens.append(int(penalize(logits, prompt, tokens[len(prompt):]).argmax()))
    return tokens[len(prompt):]


def test_engine_repetition_penalty_equals_transformers_generate(tiny_model, hf_model, make_llm):
    folder = tiny_model("llama")
    hf = hf_model(folder)
    llm = make_llm(folder)
    prompt = [3, 4, 3, 4, 3, 4, 3]
    out = llm.generate([prompt], greedy(max_tokens=12, repetition_penalty=1.8, ignore_eos=True), use_tqdm=False)
    expected = hf.generate(torch.tensor([prompt]), max_new_tokens=12, min_new_tokens=12, do_sample=False,
                           repetition_penalty=1.8, pad_token_id=EOS_ID)[0, len(prompt):].tolist()
    assert out[0].token_ids == expected
    plain = llm.generate([prompt], greedy(max_tokens=12, ignore_eos=True), use_tqdm=False)[0].token_ids
    assert plain != expected  # the penalty changed what was generated


def test_engine_presence_and_frequency_penalties_equal_a_direct_computation(tiny_model, hf_model, make_llm):
    folder = tiny_model("llama")
    hf = hf_model(folder)
    llm = make_llm(folder)
    prompt = [10, 11, 12, 10]
    params = greedy(max_tokens=10, presence_penalty=1.5, frequency_penalty=1.0, ignore_eos=True)

    def penalize(logits, _prompt, output):
        logits = logits.clone()
        for t in set(output):
            logits[t] -= 1.5 + 1.0 * output.count(t)
        return logits

    assert llm.generate([prompt], params, use_tqdm=False)[0].token_ids == \
        penalized_greedy_reference(hf, prompt, 10, penalize)


def test_engine_min_tokens_keeps_going_past_a_stop_token(tiny_model, make_llm):
    llm = make_llm(tiny_model("llama"))
    first = llm.generate([[5, 6, 7]], greedy(max_tokens=8), use_tqdm=False)[0].token_ids[0]
    stopped = llm.generate([[5, 6, 7]], greedy(max_tokens=8, stop_token_ids=[first]), use_tqdm=False)[0]
    assert stopped.token_ids == [first] and stopped.finish_reason == "stop"
    held = llm.generate([[5, 6, 7]], greedy(max_tokens=8, stop_token_ids=[first], min_tokens=4), use_tqdm=False)[0]
    assert len(held.token_ids) >= 4 and first not in held.token_ids[:4]


def test_logprobs_mode_reports_the_raw_or_the_penalized_distribution():
    from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

    logits = random_logits()
    params = [greedy(logprobs=2, repetition_penalty=1.8), greedy(logprobs=2, repetition_penalty=1.8,
                                                                logprobs_mode="processed"), greedy(logprobs=0)]
    out = Sampler(torch.Generator())(logits.clone(), params, [None] * 3, HISTORIES)
    penalized = RepetitionPenaltyLogitsProcessor(1.8)(torch.tensor([HISTORIES[1].token_ids]), logits[1:2].clone())[0]
    raw_row0, processed_row1 = torch.log_softmax(logits[0], -1), torch.log_softmax(penalized, -1)
    assert out.logprobs[0] == {t: pytest.approx(float(raw_row0[t]), abs=1e-6) for t in out.logprobs[0]}
    assert out.logprobs[1] == {t: pytest.approx(float(processed_row1[t]), abs=1e-6) for t in out.logprobs[1]}
    assert set(out.logprobs[1]) >= set(processed_row1.topk(2).indices.tolist())
    assert out.token_ids[1] == int(penalized.argmax())  # the same distribution the token was drawn from


def test_a_steps_logits_are_penalized_in_place_unless_a_row_wants_its_raw_logprobs():
    """Where no row's logprobs are of the raw logits the penalties reshape the step's logits themselves (a copy of
    a 128-row step over a 151936-token vocabulary is 78 MB of fresh pages each step), and the processed logprobs
    and tokens are those of the penalized rows; one row asking for raw logprobs keeps every row as it came."""
    from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

    logits = random_logits()
    penalty = RepetitionPenaltyLogitsProcessor(1.8)
    penalized = torch.stack([penalty(torch.tensor([h.token_ids]), logits[i:i + 1].clone())[0]
                             for i, h in enumerate(HISTORIES)])
    params = [greedy(logprobs=2, repetition_penalty=1.8, logprobs_mode="processed"), greedy(repetition_penalty=1.8),
              greedy(repetition_penalty=1.8)]
    given = logits.clone()
    out = Sampler(torch.Generator())(given, params, [None] * 3, HISTORIES)
    assert torch.allclose(given, penalized)  # in place
    row0 = torch.log_softmax(penalized[0], -1)
    assert out.logprobs[0] == {t: pytest.approx(float(row0[t]), abs=1e-6) for t in out.logprobs[0]}
    assert out.token_ids == penalized.argmax(-1).tolist()
    given = logits.clone()
    raw = [greedy(logprobs=1, repetition_penalty=1.8), *params[1:]]
    out = Sampler(torch.Generator())(given, raw, [None] * 3, HISTORIES)
    assert torch.equal(given, logits) and out.token_ids == penalized.argmax(-1).tolist()
