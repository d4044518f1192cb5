"""One engine loop for every connection: concurrent streams batch together, disconnects free KV, overload is a 429."""

import asyncio
import json
import threading
import time

import httpx
import pytest

import kunlun_infer as ki
from tests.server.harness import RunningServer, engine_for, fail_next_step
from tests.server.test_no_paths import assert_no_paths

NUM_CLIENTS = 32


async def stream_completion(client, url, prompt, max_tokens):
    text, finish = "", None
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True}
    async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if not line or line == "data: [DONE]":
                continue
            choice = json.loads(line.removeprefix("data: "))["choices"][0]
            text += choice["text"]
            finish = choice["finish_reason"] or finish
    return text, finish


def hold_first_step_until(engine, monkeypatch, ready, timeout_s: float = 60.0) -> None:
    """The engine's next forward waits until ``ready()`` (or ``timeout_s``): clients that connect one by one
    are all in the loop before it steps on, however fast the model steps beside them."""
    runner = engine.runner
    real_compute = runner.compute
    held = []

    def compute_after_ready(inputs):
        if not held:
            held.append(1)
            deadline = time.monotonic() + timeout_s
            while not ready() and time.monotonic() < deadline:
                time.sleep(0.005)
        return real_compute(inputs)

    monkeypatch.setattr(runner, "compute", compute_after_ready)


def test_concurrent_streaming_clients_all_finish_correctly_in_shared_batches(server, llm, monkeypatch):
    prompts = [f"client {i}: {'ab' * (i % 5)}" for i in range(NUM_CLIENTS)]
    expected = [o.text for o in llm.generate(prompts, ki.SamplingParams(max_tokens=12, temperature=0),
                                             use_tqdm=False)]
    before = server.metrics()
    hold_first_step_until(server.engine, monkeypatch, lambda: server.loop.num_in_flight >= NUM_CLIENTS)

    async def run_all():
        limits = httpx.Limits(max_connections=NUM_CLIENTS)
        async with httpx.AsyncClient(timeout=120, limits=limits) as client:
            return await asyncio.gather(*(stream_completion(client, server.url, p, 12) for p in prompts))

    results = asyncio.run(run_all())
    assert [text for text, _ in results] == expected
    assert all(finish in ("stop", "length") for _, finish in results)
    after = server.metrics()
    steps = after["kunlun_infer_batch_size_count"] - before["kunlun_infer_batch_size_count"]
    single = after['kunlun_infer_batch_size_bucket{le="1"}'] - before['kunlun_infer_batch_size_bucket{le="1"}']
    # far fewer steps than tokens, most of them running many sequences at once
    assert steps < NUM_CLIENTS * 12 / 4 and single < steps / 2
    assert after['kunlun_infer_batch_size_bucket{le="8"}'] < after["kunlun_infer_batch_size_count"]


def wait_until(condition, timeout=30.0):
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def kv_all_free(server):
    stats = server.loop.stats
    return (stats["num_running"] == 0 and stats["num_waiting"] == 0
            and stats["kv_blocks_free"] == stats["kv_blocks_total"] and server.loop.num_in_flight == 0)


def test_a_client_leaving_mid_stream_aborts_its_request_and_frees_kv(server):
    assert wait_until(lambda: kv_all_free(server))
    aborted_before = server.metrics().get('kunlun_infer_requests_finished_total{reason="abort"}', 0)
    body = {"prompt": "a long story", "max_tokens": 400, "ignore_eos": True, "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=30) as r:
        lines = r.iter_lines()
        for _ in range(3):
            next(lines)
        assert server.loop.stats["kv_blocks_free"] < server.loop.stats["kv_blocks_total"]
    # the connection is closed: the engine drops the request long before 400 tokens
    assert wait_until(lambda: kv_all_free(server), timeout=20)
    metrics = server.metrics()
    assert metrics['kunlun_infer_requests_finished_total{reason="abort"}'] == aborted_before + 1
    assert metrics["kunlun_infer_kv_cache_usage_ratio"] == 0


def test_a_non_streaming_client_timing_out_aborts_its_request(server, monkeypatch):
    assert wait_until(lambda: kv_all_free(server))
    aborted_before = server.metrics().get('kunlun_infer_requests_finished_total{reason="abort"}', 0)
    client_gone = threading.Event()
    step = server.engine.step

    def step_held_until_the_client_gave_up():  # however fast this machine is, the request is still running
        outputs = step()
        client_gone.wait(timeout=30)
        return outputs

    monkeypatch.setattr(server.engine, "step", step_held_until_the_client_gave_up)
    body = {"prompt": "another long story", "max_tokens": 450, "ignore_eos": True, "temperature": 0}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.url}/v1/completions", json=body, timeout=httpx.Timeout(30, read=0.3))
    client_gone.set()
    assert wait_until(lambda: kv_all_free(server), timeout=20)
    assert server.metrics()['kunlun_infer_requests_finished_total{reason="abort"}'] == aborted_before + 1


@pytest.fixture
def small_server(chat_folder):
    """Capacity 2: one running sequence (scheduler.max_num_seqs=1) and one waiting (server.max_queue=1)."""
    engine = engine_for(chat_folder, scheduler__max_num_seqs=1)
    running = RunningServer(engine, max_queue=1)
    yield running
    running.stop()
    assert not running.thread.is_alive() and not running.loop.alive
    engine.close()


def test_overload_gets_a_429_at_once_not_a_hang(small_server):
    url = small_server.url
    body = {"prompt": "busy", "max_tokens": 300, "ignore_eos": True, "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=30) as first, \
            httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=30) as second:
        assert first.status_code == 200 and second.status_code == 200
        started = time.monotonic()
        refused = httpx.post(f"{url}/v1/completions", json={"prompt": "one too many", "max_tokens": 2}, timeout=10)
        assert time.monotonic() - started < 5
        assert refused.status_code == 429 and refused.headers["retry-after"] == "1"
        error = refused.json()["error"]
        assert error["code"] == "queue_full" and "server.max_queue" in error["message"]
        assert_no_paths(refused.text)
    metrics = small_server.metrics()
    assert metrics['kunlun_infer_requests_rejected_total{reason="queue_full"}'] == 1
    assert metrics['kunlun_infer_http_requests_total{endpoint="/v1/completions",status="429"}'] == 1
    # once the two streams are gone, there is room again
    assert wait_until(lambda: kv_all_free(small_server))
    ok = httpx.post(f"{url}/v1/completions", json={"prompt": "now", "max_tokens": 2}, timeout=30)
    assert ok.status_code == 200


def test_shutdown_ends_open_streams_and_refuses_new_work(small_server):
    body = {"prompt": "endless", "max_tokens": 450, "ignore_eos": True, "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{small_server.url}/v1/completions", json=body, timeout=30) as r:
        lines = r.iter_lines()
        next(lines)
        small_server.loop.shutdown()  # what the app's lifespan does once uvicorn stops accepting
        rest = [line for line in lines if line]
    assert rest[-1] == "data: [DONE]" and "aborted" in rest[-2]
    assert httpx.get(f"{small_server.url}/health").status_code == 503
    refused = httpx.post(f"{small_server.url}/v1/completions", json={"prompt": "x"}, timeout=10)
    assert refused.status_code == 503 and refused.json()["error"]["code"] == "engine_unavailable"
    assert_no_paths(refused.text)



def test_a_failed_engine_step_is_a_500_for_its_requests_and_the_server_serves_on(small_server, monkeypatch):
    fail_next_step(small_server.engine, monkeypatch, RuntimeError("simulated kernel failure"))
    failed = httpx.post(f"{small_server.url}/v1/completions", json={"prompt": "x", "max_tokens": 3}, timeout=30)
    assert failed.status_code == 500
    error = failed.json()["error"]
    assert error["type"] == "server_error" and "simulated kernel failure" in error["message"]
    ok = httpx.post(f"{small_server.url}/v1/completions", json={"prompt": "x", "max_tokens": 3}, timeout=30)
    assert ok.status_code == 200 and httpx.get(f"{small_server.url}/health").status_code == 200

    # a prompt scored alone (echo, max_tokens=0) shows no token, but its failure is still a failure
    fail_next_step(small_server.engine, monkeypatch, RuntimeError("simulated kernel failure"))
    scored = {"prompt": "x y", "max_tokens": 0, "echo": True, "logprobs": 0}
    failed = httpx.post(f"{small_server.url}/v1/completions", json=scored, timeout=30)
    assert failed.status_code == 500 and "simulated kernel failure" in failed.json()["error"]["message"]
    ok = httpx.post(f"{small_server.url}/v1/completions", json=scored, timeout=30)
    assert ok.status_code == 200 and ok.json()["choices"][0]["text"] == "x y"
