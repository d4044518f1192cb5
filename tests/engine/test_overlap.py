"""Overlapped steps (``scheduler.overlap_steps``, hook API 1.7) give the synchronous engine's results.

The CPU runs every kernel before it returns, so here overlapping saves no
time, but the engine does all the overlapped bookkeeping: a step is
launched with placeholders for its tokens, the next one is launched from the
device's tokens before the first is read back, and the tokens are put in
place and judged one step later. Greedy and seeded requests, stop tokens
inside the run, ``min_tokens``, streamed outputs, requests arriving while
others decode (their prompt chunks launched behind a step in flight), aborts
of a request in flight, KV-block shortage and preemption, prefix caching and
requests that cannot overlap (logprobs, penalties, ``n > 1``) must all come
out as without overlap;
a failure in a launched step ends the requests of both steps in flight and
the engine serves on. ``auto`` follows the streams plugin: the built-in
``sync`` streams (and any plugin written before 1.7) say "not asynchronous".
"""

import pytest
import torch

from kunlun_infer import ConfigError, SamplingParams
from kunlun_infer.engine.overlap import PLACEHOLDER
from kunlun_infer.engine.sampler import Sampler
from kunlun_infer.errors import EngineStepError
from kunlun_infer.plugins import cpu_streams

LENGTHS, MAX_TOKENS = [1, 15, 16, 17, 70, 33, 5], [3, 9, 20, 5, 12, 30, 7]


def prompts(seed: int = 2) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (n,), generator=g).tolist() for n in LENGTHS]


def params(stops: dict[int, list[int]] | None = None, extra: dict[int, dict] | None = None) -> list[SamplingParams]:
    """Greedy and seeded sampled requests of different lengths; request 3 with ``min_tokens``; ``extra[i]``: more
    fields of request ``i``."""
    stops, extra = stops or {}, extra or {}
    return [SamplingParams(max_tokens=m, temperature=0.8 if i % 3 == 1 else 0.0, seed=i, ignore_eos=True,
                           stop_token_ids=stops.get(i), min_tokens=3 if i == 3 else 0, **extra.get(i, {}))
            for i, m in enumerate(MAX_TOKENS)]


def results(outputs) -> list[tuple[list[int], str, object]]:
    return [(list(o.token_ids), o.finish_reason, o.logprobs) for o in outputs]


class LaunchSpy:
    """Counts the engine's launched steps, those launched while another was in flight, and those of them with
    prompt tokens."""

    def __init__(self, engine) -> None:
        self.launched = self.behind = self.prompts_behind = 0
        runner, launch = engine.runner, engine.runner.launch

        def spy(batch, record_event, previous=None):
            self.launched += 1
            self.behind += previous is not None
            self.prompts_behind += previous is not None and batch.num_prefill_tokens > 0
            return launch(batch, record_event, previous)

        runner.launch = spy


def stops_inside_the_run(make_llm, folder) -> dict[int, list[int]]:
    """Stop tokens that end requests 2 and 5 early: tokens the synchronous run draws there; and for request 3
    the token it draws second, which its ``min_tokens=3`` then masks there (the mask counts its tokens so far)."""
    base = make_llm(folder, scheduler__overlap_steps="off").generate(prompts(), params(), use_tqdm=False)
    return {2: [base[2].token_ids[6]], 5: [base[5].token_ids[10]], 3: [base[3].token_ids[1]]}


def test_overlapped_steps_give_the_synchronous_tokens(tiny_model, make_llm):
    folder = tiny_model("llama")
    stops = stops_inside_the_run(make_llm, folder)
    sync = make_llm(folder, scheduler__overlap_steps="off")
    want = results(sync.generate(prompts(), params(stops), use_tqdm=False))
    assert [r[1] for r in want].count("stop") >= 2  # the stops do end requests mid-run
    assert want[3][0][1] != stops[3][0]  # masked where min_tokens holds it back
    llm = make_llm(folder, scheduler__overlap_steps="on")
    assert llm.engine.overlap and not sync.engine.overlap
    spy = LaunchSpy(llm.engine)
    assert results(llm.generate(prompts(), params(stops), use_tqdm=False)) == want
    assert spy.behind >= 8 and spy.launched > spy.behind  # decode steps did go out behind one in flight
    stats = llm.engine.stats()
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"] and stats["num_running"] == 0
    # and again on the same engine (a step may still have been in flight for finished sequences)
    assert results(llm.generate(prompts(), params(stops), use_tqdm=False)) == want


def test_streamed_outputs_never_show_a_placeholder(tiny_model, make_llm):
    folder = tiny_model("llama")
    want = results(make_llm(folder, scheduler__overlap_steps="off").generate(prompts(), params(), use_tqdm=False))
    engine = make_llm(folder, scheduler__overlap_steps="on").engine
    ids = [engine.add_request(p, sp) for p, sp in zip(prompts(), params())]
    seen: dict[str, list[list[int]]] = {i: [] for i in ids}
    final = {}
    while engine.has_unfinished():
        for output in engine.step():
            assert PLACEHOLDER not in output.token_ids
            seen[output.request_id].append(list(output.token_ids))
            if output.finished:
                final[output.request_id] = list(output.token_ids)
    assert [final[i] for i in ids] == [tokens for tokens, _, _ in want]
    for i in ids:  # one output per token, each one token longer than the one before
        assert [len(t) for t in seen[i]] == list(range(1, len(final[i]) + 1))


def test_requests_that_cannot_overlap_are_served_alike(tiny_model, make_llm):
    folder = tiny_model("llama")
    extra = {1: {"logprobs": 2}, 4: {"repetition_penalty": 1.3, "presence_penalty": 0.5}}
    sync = make_llm(folder, scheduler__overlap_steps="off")
    want = results(sync.generate(prompts(), params(extra=extra), use_tqdm=False))
    llm = make_llm(folder, scheduler__overlap_steps="on")
    spy = LaunchSpy(llm.engine)
    assert results(llm.generate(prompts(), params(extra=extra), use_tqdm=False)) == want
    assert want[1][2] is not None and len(want[1][2]) == len(want[1][0])  # logprobs of every token came back
    # while those two run, no step is launched; after they end, the others' decode steps overlap again
    assert spy.launched > 0


def serve_arriving(engine, requests: list[tuple[int, list[int], SamplingParams]]) -> list:
    """Add each ``(step, prompt, params)`` before that step of the engine, run until all finish; each request's
    final outputs (one per sample), in arrival order."""
    pending, ids, final, step = sorted(requests, key=lambda r: r[0]), [], {}, 0
    while pending or engine.has_unfinished():
        while pending and pending[0][0] <= step:
            _, prompt, sp = pending.pop(0)
            ids.append(engine.add_request(prompt, sp))
        for output in engine.step():
            assert PLACEHOLDER not in output.token_ids
            if output.finished:
                final.setdefault(output.request_id, {})[output.index] = output
        step += 1
    return [results(final[i][k] for k in sorted(final[i])) for i in ids]


def arrivals(extra: dict[int, dict] | None = None) -> list[tuple[int, list[int], SamplingParams]]:
    """The seven requests arriving two steps apart, while the ones before decode."""
    return [(2 * i, p, sp) for i, (p, sp) in enumerate(zip(prompts(), params(extra=extra)))]


def test_requests_arriving_while_others_decode_overlap_and_get_the_synchronous_tokens(tiny_model, make_llm):
    folder = tiny_model("llama")
    small = {"scheduler__max_num_batched_tokens": 24}  # the 33- and 70-token prompts come in chunks
    want = serve_arriving(make_llm(folder, scheduler__overlap_steps="off", **small).engine, arrivals())
    engine = make_llm(folder, scheduler__overlap_steps="on", **small).engine
    spy = LaunchSpy(engine)
    assert serve_arriving(engine, arrivals()) == want
    # newcomers' prompts (whole, and chunks of the long ones) went out behind a step in flight
    assert spy.prompts_behind >= 6 and spy.behind >= spy.launched - 3
    stats = engine.stats()
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"] and stats["num_running"] == 0


def test_newcomers_that_cannot_overlap_take_the_step_in_flight_back_and_are_served_alike(tiny_model, make_llm):
    folder = tiny_model("llama")
    extra = {2: {"logprobs": 2}, 3: {"prompt_logprobs": 1}, 4: {"n": 2}}  # (4 samples at 0.8)
    want = serve_arriving(make_llm(folder, scheduler__overlap_steps="off").engine, arrivals(extra))
    engine = make_llm(folder, scheduler__overlap_steps="on").engine
    spy = LaunchSpy(engine)
    got = serve_arriving(engine, arrivals(extra))
    assert got == want
    assert len(got[4]) == 2 and got[4][0] != got[4][1]  # both samples came back, each its own
    assert want[2][0][2] is not None and len(want[2][0][2]) == len(want[2][0][0])  # logprobs of every token
    # before and after the three run (while they do, nothing is launched), the others' steps overlapped,
    # the first newcomer's prompt among them
    assert spy.prompts_behind >= 1 and spy.behind >= 10
    stats = engine.stats()
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"]


def test_a_prompt_alone_comes_in_chunks_each_launched_behind_the_one_before(tiny_model, make_llm):
    folder = tiny_model("llama")
    sp = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    small = {"scheduler__max_num_batched_tokens": 24}  # 70 tokens: chunks of 24, 24 and 22, none sampled but the last
    want = results(make_llm(folder, scheduler__overlap_steps="off", **small).generate([prompts()[4]], sp,
                                                                                     use_tqdm=False))
    llm = make_llm(folder, scheduler__overlap_steps="on", **small)
    sampled = []
    finish = llm.engine.runner.finish

    def counting(launched):
        sampled.append(len(launched.row_of))
        return finish(launched)

    llm.engine.runner.finish = counting
    spy = LaunchSpy(llm.engine)
    assert results(llm.generate([prompts()[4]], sp, use_tqdm=False)) == want
    assert spy.prompts_behind == 2 and sampled[:2] == [0, 0]  # two chunks in flight drew no token


def test_a_prompt_chunked_behind_a_step_in_flight_feeds_the_prefix_cache(tiny_model, make_llm):
    folder = tiny_model("llama")
    sp = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    long = prompts()[4] + prompts()[5]  # 103 tokens: five chunks of 24
    # a short request decodes while the long prompt comes in chunks; the same prompt comes again while those
    # chunks are still coming in (it finds the blocks of those already landed), and once more after
    requests = [(0, prompts()[1], sp), (1, long, sp), (4, long, sp), (30, long, sp)]
    figures = {}
    for mode in ("off", "on"):
        engine = make_llm(folder, scheduler__overlap_steps=mode, scheduler__max_num_batched_tokens=24).engine
        spy = LaunchSpy(engine)
        figures[mode] = (serve_arriving(engine, requests), engine.stats()["prefix_cache_hit_tokens"])
    assert figures["on"][0] == figures["off"][0] and spy.prompts_behind >= 4
    # the last arrival finds all six full blocks; the second at least two (a step later than the synchronous
    # engine, whose chunks are in the cache as soon as they ran: here as soon as they landed)
    assert figures["off"][1] >= 96 + 64 and figures["on"][1] >= 96 + 32


def test_aborting_a_newcomer_whose_prompt_chunk_is_in_flight_frees_its_blocks(tiny_model, make_llm):
    folder = tiny_model("llama")
    sp = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    small = {"scheduler__max_num_batched_tokens": 24}
    want = make_llm(folder, scheduler__overlap_steps="off", **small).generate([prompts()[1]], sp, use_tqdm=False)[0]
    engine = make_llm(folder, scheduler__overlap_steps="on", **small).engine
    spy = LaunchSpy(engine)
    kept = engine.add_request(prompts()[1], sp)
    engine.step()
    engine.step()
    doomed = engine.add_request(prompts()[4], sp)  # 70 tokens: three chunks behind the decodes of ``kept``
    while spy.prompts_behind < 2:
        engine.step()
    launched = engine._launched
    assert any(seq.request_id == doomed for seq in launched.batch.seqs)  # one of its chunks is in flight
    assert engine.abort(doomed)
    outputs = []
    while engine.has_unfinished():
        outputs += engine.step()
    aborted = next(o for o in outputs if o.request_id == doomed)
    assert aborted.finish_reason == "abort" and aborted.token_ids == []
    assert [o for o in outputs if o.request_id == kept][-1].token_ids == want.token_ids
    stats = engine.stats()
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"] and stats["num_running"] == 0


def test_aborting_a_request_in_flight_keeps_its_real_tokens_only(tiny_model, make_llm):
    folder = tiny_model("llama")
    sp = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    want = make_llm(folder, scheduler__overlap_steps="off").generate([prompts()[4]], sp, use_tqdm=False)[0]
    engine = make_llm(folder, scheduler__overlap_steps="on").engine
    spy = LaunchSpy(engine)
    kept = engine.add_request(prompts()[4], sp)
    doomed = engine.add_request(prompts()[1], sp)
    while spy.behind < 3:
        engine.step()
    assert engine._launched is not None  # a step is in flight with the doomed request in it
    assert engine.abort(doomed)
    outputs = []
    while engine.has_unfinished():
        outputs += engine.step()
    aborted = next(o for o in outputs if o.request_id == doomed)
    assert aborted.finish_reason == "abort" and PLACEHOLDER not in aborted.token_ids
    assert 1 <= len(aborted.token_ids) < 12
    assert [o for o in outputs if o.request_id == kept][-1].token_ids == want.token_ids
    stats = engine.stats()
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"]


def test_short_kv_blocks_and_preemption_come_out_alike(tiny_model, make_llm):
    folder = tiny_model("llama")
    sp = params()
    few = {"cache__num_blocks": 14, "cache__prefix_caching": False}  # not all seven fit to the end: preemption
    sync = make_llm(folder, scheduler__overlap_steps="off", **few)
    want = results(sync.generate(prompts(), sp, use_tqdm=False))
    assert sync.engine.stats()["num_preemptions"] > 0
    llm = make_llm(folder, scheduler__overlap_steps="on", **few)
    spy = LaunchSpy(llm.engine)
    assert results(llm.generate(prompts(), sp, use_tqdm=False)) == want
    assert spy.behind > 0
    stats = llm.engine.stats()
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"]


def test_prefix_cache_holds_the_same_blocks(tiny_model, make_llm):
    folder = tiny_model("llama")
    sp = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    figures = []
    for mode in ("off", "on"):
        llm = make_llm(folder, scheduler__overlap_steps=mode)
        first = llm.generate([prompts()[1]], sp, use_tqdm=False)[0]
        # the whole first conversation again as a prompt: its generated tokens' blocks are cached too
        again = llm.generate([prompts()[1] + list(first.token_ids)], sp, use_tqdm=False)[0]
        stats = llm.engine.stats()
        figures.append((first.token_ids, again.token_ids, stats["kv_blocks_cached"], stats["prefix_cache_hit_tokens"]))
    assert figures[0] == figures[1]
    assert figures[1][3] >= 48  # 15 prompt + 39 computed output tokens: three full blocks found


@pytest.mark.parametrize("where", ["launch", "land"])
def test_a_failure_in_flight_ends_the_requests_of_both_steps_and_the_engine_serves_on(tiny_model, make_llm,
                                                                                       where):
    folder = tiny_model("llama")
    sp = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    want = make_llm(folder, scheduler__overlap_steps="off").generate(prompts()[:2], sp, use_tqdm=False)
    llm = make_llm(folder, scheduler__overlap_steps="on")
    engine = llm.engine
    spy = LaunchSpy(engine)
    for p in prompts()[2:4]:
        engine.add_request(p, sp)
    while spy.behind < 2:
        engine.step()
    runner = engine.runner
    name = "compute" if where == "launch" else "finish"
    original = getattr(runner, name)

    def broken(*args, **kwargs):
        raise RuntimeError("device lost the step")

    setattr(runner, name, broken)
    with pytest.raises(EngineStepError, match="device lost the step") as caught:
        engine.step()
    setattr(runner, name, original)
    ended = {o.request_id: o for o in caught.value.outputs}
    assert len(ended) == 2 and all(o.finish_reason == "abort" and o.error for o in ended.values())
    assert all(PLACEHOLDER not in o.token_ids for o in ended.values())
    assert engine._launched is None and engine.stats()["num_running"] == 0
    assert {o.request_id for o in engine.step()} == set(ended)  # their final outputs, as after any failed step
    stats = engine.stats()
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"] and not engine.has_unfinished()
    assert results(llm.generate(prompts()[:2], sp, use_tqdm=False)) == results(want)  # serving on


def test_auto_follows_the_streams_plugin(tiny_model, make_llm, monkeypatch, caplog):
    folder = tiny_model("llama")
    assert cpu_streams.SyncStreams().asynchronous is False  # a streams plugin without the 1.7 property
    with caplog.at_level("INFO", logger="kunlun_infer.framework"):
        engine = make_llm(folder).engine
        assert engine.overlap is False  # auto, and the sync streams run every kernel at once
    assert engine.runner.sampler.waits_are_free  # top-k/top-p may read back mid-draw: nothing is queued
    assert "engine ready" in caplog.text and "overlapped" not in caplog.text
    monkeypatch.setattr(cpu_streams.SyncStreams, "asynchronous", property(lambda self: True))
    caplog.clear()
    with caplog.at_level("INFO", logger="kunlun_infer.framework"):
        engine = make_llm(folder).engine
        assert engine.overlap is True
    assert not engine.runner.sampler.waits_are_free  # filters sort on the device rather than wait for it
    assert "steps overlapped (scheduler.overlap_steps)" in caplog.text  # the start-up log says so
    assert make_llm(folder, scheduler__overlap_steps="off").engine.overlap is False


def test_overlap_on_refuses_speculative_decoding_and_bad_values(tiny_model, make_llm):
    folder = tiny_model("llama")
    with pytest.raises(ConfigError, match="scheduler.overlap_steps=on needs one rank without speculative"):
        make_llm(folder, scheduler__overlap_steps="on", speculative__method="ngram", speculative__num_tokens=3)
    with pytest.raises(ConfigError, match="scheduler.overlap_steps=sometimes"):
        make_llm(folder, scheduler__overlap_steps="sometimes")
    # an unquoted on/off in a YAML file arrives as a boolean, and means the same
    assert make_llm(folder, scheduler__overlap_steps="true").engine.overlap is True
    assert make_llm(folder, scheduler__overlap_steps="false").engine.overlap is False
    # auto with speculative decoding: steps run as before
    assert make_llm(folder, speculative__method="ngram", speculative__num_tokens=3).engine.overlap is False


def test_sampler_draw_leaves_the_tokens_on_the_device_and_equals_a_call():
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(0))
    sp = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.9, seed=1),
          SamplingParams(temperature=0.7, top_k=5), SamplingParams(temperature=1.0, top_p=0.8, min_p=0.05)]

    def gens():
        return [None, torch.Generator().manual_seed(1), None, None]

    tokens, processed = Sampler(torch.Generator().manual_seed(3)).draw(logits, sp, gens())
    assert isinstance(tokens, torch.Tensor) and processed is logits
    assert tokens.tolist() == Sampler(torch.Generator().manual_seed(3))(logits, sp, gens()).token_ids
