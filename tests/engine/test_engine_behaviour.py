"""What a user of the online engine sees: batching invariance, seeds, prefix hits, aborts, stops, logprobs."""

import json
import shutil

import pytest
import torch

from tests.engine.tiny_models import hf_greedy
from kunlun_infer import RequestError, SamplingParams


def random_prompts(n, length, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (length + 3 * i,), generator=g).tolist() for i in range(n)]


def run_all(engine):
    """Step until idle; the final output of every request, by id."""
    finals = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
    stats = engine.stats()
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"]
    return finals


def test_greedy_output_alone_equals_output_inside_a_batch_of_16(tiny_model, make_llm):
    llm = make_llm(tiny_model("llama"))
    prompts = random_prompts(16, 20)
    params = SamplingParams(max_tokens=12, temperature=0)
    batch = llm.generate(prompts, params, use_tqdm=False)
    for i in (0, 7, 15):
        alone = llm.generate([prompts[i]], params, use_tqdm=False)[0]
        assert alone.token_ids == batch[i].token_ids


def test_seeded_sampling_is_reproducible_whatever_else_is_in_the_batch(tiny_model, make_llm):
    llm = make_llm(tiny_model("qwen2"))
    prompt = random_prompts(1, 25, seed=3)[0]
    seeded = SamplingParams(max_tokens=16, temperature=1.0, top_k=50, top_p=0.9, seed=1234)
    alone = llm.generate([prompt], seeded, use_tqdm=False)[0].token_ids
    others = random_prompts(6, 10, seed=4)
    mixed = llm.generate(others[:3] + [prompt] + others[3:],
                         [SamplingParams(max_tokens=9, temperature=0.8)] * 3 + [seeded]
                         + [SamplingParams(max_tokens=20, temperature=0)] * 3, use_tqdm=False)[3].token_ids
    assert mixed == alone
    other_seed = llm.generate([prompt], SamplingParams(max_tokens=16, temperature=1.0, seed=99),
                              use_tqdm=False)[0].token_ids
    assert other_seed != alone


def test_a_steps_sampled_rows_are_drawn_in_one_call_of_the_cpu_ops_pass(tiny_model, make_llm, monkeypatch):
    """On the CPU every row of a step with a sampled one goes to the ``cpu`` ops' ``sample_tokens`` (hook API 1.10)
    in one call, greedy rows among them taking their argmax there: they decode as they do alone."""
    from kunlun_infer.plugins import cpu_kernels

    calls = []
    native = cpu_kernels.sample_tokens
    monkeypatch.setattr(cpu_kernels, "sample_tokens", lambda *args: calls.append(args[0].shape[0]) or native(*args))
    llm = make_llm(tiny_model("qwen2"))
    prompts = random_prompts(4, 12, seed=9)
    greedy = SamplingParams(max_tokens=10, temperature=0)
    sampled = SamplingParams(max_tokens=10, temperature=0.9, top_p=0.9, top_k=40)
    outs = llm.generate(prompts, [greedy, sampled, greedy, sampled], use_tqdm=False)
    assert calls and max(calls) == 4
    calls.clear()
    assert llm.generate([prompts[2]], greedy, use_tqdm=False)[0].token_ids == outs[2].token_ids
    assert calls == []  # greedy alone: the argmax pass, no draw


def test_shared_prefix_workload_hits_the_cache_and_matches_uncached(tiny_model, make_llm):
    folder = tiny_model("llama")
    system = random_prompts(1, 64, seed=5)[0]
    prompts = [system + tail for tail in random_prompts(6, 5, seed=6)]
    params = SamplingParams(max_tokens=8, temperature=0)
    cached = make_llm(folder)
    first = cached.generate(prompts[:1], params, use_tqdm=False)
    rest = cached.generate(prompts[1:], params, use_tqdm=False)
    assert cached.engine.stats()["prefix_cache_hit_tokens"] >= 5 * 64
    assert all(o.num_cached_tokens == 64 for o in rest)
    uncached = make_llm(folder, cache__prefix_caching="false").generate(prompts, params, use_tqdm=False)
    assert [o.token_ids for o in first + rest] == [o.token_ids for o in uncached]


def test_abort_frees_blocks_at_once_and_reports_abort(tiny_model, make_llm):
    engine = make_llm(tiny_model("llama")).engine
    keep = engine.add_request(random_prompts(1, 40)[0], SamplingParams(max_tokens=20, temperature=0))
    doomed = engine.add_request(random_prompts(1, 70, seed=2)[0], SamplingParams(max_tokens=20, temperature=0))
    engine.step()
    engine.step()
    free_before = engine.stats()["kv_blocks_free"]
    assert engine.abort(doomed)
    assert engine.stats()["kv_blocks_free"] >= free_before + 5  # its 72 tokens sat in 5 blocks
    outputs = {o.request_id: o for o in engine.step()}
    assert outputs[doomed].finished and outputs[doomed].finish_reason == "abort"
    assert not engine.abort(doomed)
    finals = run_all(engine)
    assert finals[keep].finish_reason == "length" and len(finals[keep].token_ids) == 20


def test_requests_join_a_running_batch(tiny_model, make_llm):
    engine = make_llm(tiny_model("llama")).engine
    params = SamplingParams(max_tokens=6, temperature=0)
    first = engine.add_request([1, 2, 3], params)
    engine.step()
    engine.step()
    late = engine.add_request([4, 5, 6], params)
    progressed = {o.request_id for o in engine.step()}
    assert progressed == {first, late}
    run_all(engine)


def test_stop_token_ids_end_generation_with_the_token_kept(tiny_model, make_llm):
    llm = make_llm(tiny_model("qwen3"))
    prompt = random_prompts(1, 30, seed=8)[0]
    free_run = llm.generate([prompt], SamplingParams(max_tokens=16, temperature=0), use_tqdm=False)[0].token_ids
    stop_token = free_run[5]
    cut = free_run.index(stop_token) + 1
    out = llm.generate([prompt], SamplingParams(max_tokens=16, temperature=0, stop_token_ids=[stop_token]),
                       use_tqdm=False)[0]
    assert out.token_ids == free_run[:cut] and out.finish_reason == "stop"


def test_stop_string_is_cut_from_the_text(tiny_model, make_llm):
    llm = make_llm(tiny_model("llama"))
    prompt = list("def fibonacci(n):".encode())
    free_run = llm.generate([prompt], SamplingParams(max_tokens=24, temperature=0), use_tqdm=False)[0]
    text = free_run.text
    stop = next(text[i:i + 2] for i in range(3, len(text) - 2) if "\ufffd" not in text[i:i + 2])
    out = llm.generate([prompt], SamplingParams(max_tokens=24, temperature=0, stop=[stop]), use_tqdm=False)[0]
    assert out.finish_reason == "stop"
    assert out.text == text[:text.index(stop)]
    assert out.token_ids == free_run.token_ids[:len(out.token_ids)]


def test_min_tokens_holds_back_stop_strings_and_the_length_token_can_still_stop(tiny_model, make_llm):
    llm = make_llm(tiny_model("llama"))
    prompt = list("def fibonacci(n):".encode())
    free_run = llm.generate([prompt], SamplingParams(max_tokens=32, temperature=0, ignore_eos=True),
                            use_tqdm=False)[0]
    text = free_run.text
    stop = next(text[i:i + 2] for i in range(1, len(text) - 2) if "\ufffd" not in text[i:i + 2])
    # the token whose text completes the first occurrence of the stop string
    completes = next(k for k in range(1, 33) if stop in llm.tokenizer.decode(free_run.token_ids[:k]))
    greedy = {"temperature": 0, "ignore_eos": True, "stop": [stop]}
    stopped = llm.generate([prompt], SamplingParams(max_tokens=32, **greedy), use_tqdm=False)[0]
    assert len(stopped.token_ids) == completes and stopped.finish_reason == "stop" and stop not in stopped.text
    # the same stop string as the very last allowed token: a stop, cut from the text
    at_length = llm.generate([prompt], SamplingParams(max_tokens=completes, **greedy), use_tqdm=False)[0]
    assert (at_length.token_ids, at_length.text, at_length.finish_reason) == (
        stopped.token_ids, stopped.text, "stop")
    # within min_tokens the stop string is plain text, and generation goes on
    held = llm.generate([prompt], SamplingParams(max_tokens=32, min_tokens=completes, **greedy), use_tqdm=False)[0]
    assert held.token_ids == free_run.token_ids[:len(held.token_ids)]
    assert len(held.token_ids) > completes
    assert held.text.startswith(llm.tokenizer.decode(free_run.token_ids[:completes]))


def test_streamed_text_adds_up_to_the_decoded_tokens(tiny_model, make_llm):
    llm = make_llm(tiny_model("qwen2"))
    engine = llm.engine
    request = engine.add_request("héllo wörld, 你好", SamplingParams(max_tokens=40, temperature=0, ignore_eos=True))
    pieces, final = [], None
    while engine.has_unfinished():
        for out in engine.step():
            pieces.append(out.delta_text)
            assert out.text == "".join(pieces)
            final = out
    assert final.request_id == request and final.finished
    assert "".join(pieces) == llm.tokenizer.decode(final.token_ids)
    assert final.prompt == "héllo wörld, 你好"
    assert final.prompt_token_ids == llm.tokenizer.encode("héllo wörld, 你好")


def test_final_only_requests_end_as_streamed_ones_and_report_only_then(tiny_model, make_llm):
    """``add_request(..., final_only=True)`` (what ``LLM.generate`` uses): no output until a sample finishes, and
    the final outputs equal a streamed request's, stop strings within ``min_tokens`` and n > 1 included."""
    llm = make_llm(tiny_model("llama"))
    engine = llm.engine
    prompt = list(b"def fibonacci(n):")
    free_run = llm.generate([prompt], SamplingParams(max_tokens=24, temperature=0, ignore_eos=True),
                            use_tqdm=False)[0].text
    stop = next(free_run[i:i + 2] for i in range(1, len(free_run) - 2) if "\ufffd" not in free_run[i:i + 2])
    cases = [SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, stop=[stop]),
             SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, stop=[stop], min_tokens=12, logprobs=2),
             SamplingParams(max_tokens=20, temperature=0.9, seed=4, ignore_eos=True, n=2)]
    for params in cases:
        streamed = engine.add_request(prompt, params)
        final_only = engine.add_request(prompt, params, final_only=True)
        seen: dict[str, list] = {streamed: [], final_only: []}
        while engine.has_unfinished():
            for out in engine.step():
                seen[out.request_id].append(out)
        assert all(out.finished for out in seen[final_only]) and len(seen[final_only]) == params.n
        assert len(seen[streamed]) > 2 * params.n  # the streamed one reported as it went
        finals = {rid: sorted((o for o in outs if o.finished), key=lambda o: o.index) for rid, outs in seen.items()}
        for a, b in zip(finals[streamed], finals[final_only]):
            assert (a.token_ids, a.text, a.finish_reason, a.logprobs) == (b.token_ids, b.text, b.finish_reason,
                                                                           b.logprobs)
            assert b.metrics.num_generated_tokens == len(b.token_ids) and b.metrics.time_to_first_token > 0
    # an aborted final-only request still reports its end
    request = engine.add_request(prompt, SamplingParams(max_tokens=50, ignore_eos=True), final_only=True)
    assert engine.step() == []
    engine.abort(request)
    ended = [o for o in engine.step() if o.request_id == request]
    assert len(ended) == 1 and ended[0].finish_reason == "abort"
    stats = engine.stats()
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"]


def test_eos_stops_unless_ignored(tiny_model, make_llm, hf_model, tmp_path):
    source = tiny_model("llama")
    prompt = random_prompts(1, 12, seed=9)[0]
    reference = hf_greedy(hf_model(source), prompt, 16)
    # make the 4th greedy token the model's end-of-sequence token
    folder = tmp_path / "eos-model"
    shutil.copytree(source, folder)
    eos = reference[3]
    for name in ("config.json", "generation_config.json"):
        data = json.loads((folder / name).read_text())
        data["eos_token_id"] = eos
        (folder / name).write_text(json.dumps(data))
    llm = make_llm(folder)
    stopped = llm.generate([prompt], SamplingParams(max_tokens=16, temperature=0), use_tqdm=False)[0]
    assert stopped.token_ids == reference[:reference.index(eos) + 1]
    assert stopped.finish_reason == "stop"
    ignored = llm.generate([prompt], SamplingParams(max_tokens=16, temperature=0, ignore_eos=True),
                           use_tqdm=False)[0]
    assert ignored.token_ids == reference and ignored.finish_reason == "length"


def test_logprobs_match_transformers_log_softmax(tiny_model, make_llm, hf_model):
    folder = tiny_model("qwen3")
    prompt = random_prompts(1, 20, seed=10)[0]
    out = make_llm(folder).generate([prompt], SamplingParams(max_tokens=6, temperature=0, logprobs=3),
                                    use_tqdm=False)[0]
    with torch.no_grad():
        logits = hf_model(folder)(torch.tensor([prompt + out.token_ids])).logits[0].float()
    expected = torch.log_softmax(logits[len(prompt) - 1:-1], dim=-1)
    assert len(out.logprobs) == len(out.token_ids) == 6
    for step, (token, entry) in enumerate(zip(out.token_ids, out.logprobs)):
        top3 = expected[step].topk(3).indices.tolist()
        assert set(entry) == set(top3) | {token}
        for tid, value in entry.items():
            assert value == pytest.approx(expected[step, tid].item(), abs=1e-4)


def test_metrics_report_time_to_first_token_and_per_token(tiny_model, make_llm):
    out = make_llm(tiny_model("llama")).generate([[1, 2, 3]], SamplingParams(max_tokens=5, temperature=0),
                                                 use_tqdm=False)[0]
    m = out.metrics
    assert m.time_to_first_token > 0 and m.time_per_output_token > 0
    assert m.num_generated_tokens == 5 and m.finished_time >= m.last_token_time >= m.first_token_time


BAD_REQUESTS = [
    ([], {}, "prompt"),
    ([1, 2, 999], {}, "prompt"),
    ([1] * 500, {"max_tokens": 20}, "max_tokens"),
    ([1, 2], {"max_tokens": 0}, "max_tokens"),
    ([1, 2], {"temperature": -1.0}, "temperature"),
    ([1, 2], {"temperature": float("nan")}, "temperature"),
    ([1, 2], {"top_p": 0.0}, "top_p"),
    ([1, 2], {"top_p": 1.01}, "top_p"),
    ([1, 2], {"top_k": -5}, "top_k"),
    ([1, 2], {"logprobs": 1000}, "logprobs"),
    ([1, 2], {"stop_token_ids": [500]}, "stop_token_ids"),
    (3.5, {}, "prompt"),
]


def test_bad_requests_are_refused_alone_while_others_complete(tiny_model, make_llm):
    engine = make_llm(tiny_model("llama")).engine
    good = [engine.add_request(p, SamplingParams(max_tokens=20, temperature=0)) for p in random_prompts(3, 10)]
    with pytest.raises(RequestError) as err:
        engine.add_request([1], SamplingParams(), request_id=good[0])
    assert err.value.field == "request_id"
    engine.step()
    for prompt, kwargs, field in BAD_REQUESTS:
        with pytest.raises(RequestError) as err:
            engine.add_request(prompt, SamplingParams(**kwargs))
        assert err.value.field == field, (prompt, kwargs)
        assert field in str(err.value)
        engine.step()
    finals = run_all(engine)
    assert sorted(finals) == sorted(good)
    assert all(len(finals[r].token_ids) == 20 for r in good)


def test_default_kv_cache_is_bounded_by_what_the_concurrency_can_use(tiny_model, make_llm):
    engine = make_llm(tiny_model("llama"), scheduler__max_num_seqs=4, model__max_model_len=256).engine
    assert engine.stats()["kv_blocks_total"] == 4 * 256 // 16
