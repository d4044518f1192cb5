"""A fleet of two replicas — the host CPU and the simulated chip on a second Ray node — behind one endpoint.

Through the official ``openai`` client: 64 concurrent streams equal a single
engine's greedy outputs and both replicas take work; prompts sharing a long
prefix land where it is cached (its hits show in the replica's ``/metrics``);
a full fleet answers 429; killing a replica's actor mid-run loses no request
and repeats none, and the restarted actor takes work again; a replica that
stops answering, or whose engine hangs in a step, is replaced the same way.
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import time

import httpx
import openai
import pytest

import kunlun_infer as ki
from tests.fleet.conftest import PAIR, FleetServer, fleet_engine_overrides

MAX_QUEUE = 16  # per replica: 16 running + 16 queued each, 64 requests in flight at most
WORDS = ["kettle", "orbit", "lantern", "meadow", "cipher", "harbor", "violet", "summit"]


def prompt(i: int) -> str:
    return f"Request {i}: a note about the {WORDS[i % len(WORDS)]} and number {i * 7 % 13}."


@pytest.fixture(scope="module")
def fleet(ray_cluster, chat_model):
    address, _ = ray_cluster
    with ki.Fleet(overrides=[*PAIR, f"fleet.address={address}", f"server.max_queue={MAX_QUEUE}", "server.model_name=tiny",
                             "fleet.health_timeout_s=10", "fleet.step_timeout_s=10", *fleet_engine_overrides()],
                  model=str(chat_model)) as fleet:
        yield fleet


@pytest.fixture(scope="module")
def server(fleet):
    running = FleetServer(fleet)
    yield running
    running.stop()


@pytest.fixture(scope="module")
def single(chat_model):
    """The same model in one engine in this process: the reference outputs."""
    with ki.LLM(model=str(chat_model), overrides=fleet_engine_overrides()) as llm:
        yield llm


def reference(single, prompts, max_tokens, **extra):
    params = ki.SamplingParams(max_tokens=max_tokens, temperature=0, **extra)
    return [o.text for o in single.generate(prompts, params, use_tqdm=False)]


def per_replica(samples: dict[str, float], family: str) -> dict[str, float]:
    """``{replica: value}`` summed over the other labels of ``kunlun_infer_<family>``."""
    found: dict[str, float] = {}
    for name, value in samples.items():
        match = re.fullmatch(rf"kunlun_infer_{family}\{{(.*)\}}", name)
        if match:
            replica = re.search(r'replica="([^"]+)"', match.group(1))
            if replica:
                found[replica.group(1)] = found.get(replica.group(1), 0.0) + value
    return found


async def stream_all(url: str, prompts: list[str], max_tokens: int, **extra) -> list[str | Exception]:
    """Each prompt streamed through the openai client at once: its text, or the error it ended with."""
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)

    async def one(text: str) -> str | Exception:
        out = ""
        try:
            stream = await client.completions.create(model="tiny", prompt=text, max_tokens=max_tokens,
                                                     temperature=0, stream=True, extra_body=extra or None)
            async for chunk in stream:
                out += chunk.choices[0].text
        except openai.APIError as exc:
            return exc
        return out

    try:
        return await asyncio.gather(*(one(p) for p in prompts))
    finally:
        await client.close()


async def complete_all(url: str, prompts: list[str], max_tokens: int, **extra) -> list[str | Exception]:
    """Each prompt as one non-streaming completion, all at once: its text, or the error it ended with."""
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)

    async def one(text: str) -> str | Exception:
        try:
            answer = await client.completions.create(model="tiny", prompt=text, max_tokens=max_tokens,
                                                     temperature=0, extra_body=extra or None)
        except openai.APIError as exc:
            return exc
        return answer.choices[0].text

    try:
        return await asyncio.gather(*(one(p) for p in prompts))
    finally:
        await client.close()


def test_the_replicas_run_where_their_resources_are(fleet, ray_cluster):
    _, simchip_node = ray_cluster
    replicas = {r["name"]: r for r in fleet.replicas()}
    assert {name: r["state"] for name, r in replicas.items()} == {"cpu": "up", "simchip": "up"}
    assert replicas["simchip"]["node_id"] == simchip_node  # only the second node offers {simchip: 1}
    assert replicas["cpu"]["node_id"] != simchip_node
    assert replicas["simchip"]["plugins"]["device"] == "simchip" and replicas["cpu"]["plugins"]["device"] == "cpu"
    assert replicas["cpu"]["pid"] != replicas["simchip"]["pid"] != os.getpid()


def test_64_concurrent_streams_equal_one_engine_and_both_replicas_work(fleet, server, single):
    prompts = [prompt(i) for i in range(64)]
    before = per_replica(server.metrics(), "requests_finished_total")
    texts = asyncio.run(stream_all(server.url, prompts, 12))
    assert texts == reference(single, prompts, 12)
    after = per_replica(server.metrics(), "requests_finished_total")
    took = {name: after.get(name, 0) - before.get(name, 0) for name in ("cpu", "simchip")}
    assert all(n > 0 for n in took.values()) and sum(took.values()) == 64, took
    # the embedded API routes through the same dispatcher
    assert [o.text for o in fleet.generate(prompts[:4], ki.SamplingParams(max_tokens=12, temperature=0))] \
        == texts[:4]


def test_requests_sharing_a_long_prefix_land_where_it_is_cached(server, single):
    shared = "You are a careful assistant. " * 10  # 290 tokens (one per byte)
    prompts = [f"{shared}Question {i}: what is {i} plus {i}?" for i in range(8)]
    before = server.metrics()
    first = asyncio.run(stream_all(server.url, prompts[:1], 8))  # caches the prefix on one replica
    rest = asyncio.run(stream_all(server.url, prompts[1:], 8))
    assert first + rest == reference(single, prompts, 8)
    after = server.metrics()
    routed = per_replica(after, 'fleet_requests_routed_total')
    by_prefix = {name: v - per_replica(before, "fleet_requests_routed_total").get(name, 0) for name, v in routed.items()}
    holder = max(by_prefix, key=by_prefix.get)
    assert by_prefix[holder] == 8 and sum(by_prefix.values()) == 8, by_prefix  # all eight went to one replica
    assert after[f'kunlun_infer_fleet_requests_routed_total{{reason="prefix",replica="{holder}"}}'] \
        - before.get(f'kunlun_infer_fleet_requests_routed_total{{reason="prefix",replica="{holder}"}}', 0) == 7
    hits = {name: v - per_replica(before, "prefix_cache_hit_tokens_total").get(name, 0)
            for name, v in per_replica(after, "prefix_cache_hit_tokens_total").items()}
    assert hits[holder] >= 7 * 288  # the seven found the 18 full blocks of the prefix
    other = ({"cpu", "simchip"} - {holder}).pop()
    assert hits[other] == 0


def test_a_full_fleet_answers_429_and_aborted_streams_free_the_replicas(fleet, server):
    def generated() -> int:
        return sum(r["stats"].get("num_generated_tokens", 0) for r in fleet.replicas())

    def held() -> int:  # requests the replicas' engines hold, by the stats each poll brings
        return sum(r["stats"].get("num_running", 0) + r["stats"].get("num_waiting", 0) for r in fleet.replicas())

    before = generated()

    async def scenario() -> int:
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as client:
            body = {"prompt": "fill", "max_tokens": 480, "temperature": 0, "ignore_eos": True, "stream": True}
            streams = [client.stream("POST", "/v1/completions", json=body) for _ in range(64)]
            responses = [await s.__aenter__() for s in streams]
            assert all(r.status_code == 200 for r in responses)
            deadline = time.monotonic() + 30
            while sum(r["in_flight"] for r in fleet.replicas()) < 64 or held() < 64:  # the engines have them too
                assert time.monotonic() < deadline, fleet.replicas()
                await asyncio.sleep(0.05)
            refused = await client.post("/v1/completions", json={**body, "stream": False})
            for s in streams:
                await s.__aexit__(None, None, None)
            assert refused.json()["error"]["code"] == "queue_full"
            return refused.status_code

    assert asyncio.run(scenario()) == 429
    deadline = time.monotonic() + 30
    while any(r["in_flight"] for r in fleet.replicas()):  # the clients went away: their requests were aborted
        assert time.monotonic() < deadline, fleet.replicas()
        time.sleep(0.1)
    # and the replicas' engines let them go: nothing left there, and the streams stopped short of their 480 tokens
    # rather than running to the end unread
    while held():
        assert time.monotonic() < deadline, fleet.replicas()
        time.sleep(0.1)
    assert generated() - before < 64 * 480, fleet.replicas()


def test_killing_a_replica_mid_run_loses_no_request_and_it_comes_back(fleet, server, single):
    prompts = [prompt(100 + i) for i in range(48)]  # 24 each: 16 running and 8 queued per replica
    whole = [prompt(150 + i) for i in range(8)]  # and some not streamed: their clients see only the end
    expected = reference(single, prompts + whole, 48, ignore_eos=True)
    victim = next(r for r in fleet.replicas() if r["name"] == "simchip")

    async def run() -> list[str | Exception]:
        task = asyncio.gather(stream_all(server.url, prompts, 48, ignore_eos=True),
                              complete_all(server.url, whole, 48, ignore_eos=True))
        def simchip() -> dict:
            return next(r for r in fleet.replicas() if r["name"] == "simchip")

        start, deadline = simchip()["stats"].get("num_generated_tokens", 0), time.monotonic() + 60
        # its running requests streamed a token or two, and it holds requests now (its stats may lag: a count
        # that only caught up with an earlier test's tokens would have it killed before it got any)
        while (state := simchip())["stats"].get("num_generated_tokens", 0) < start + 32 or not state["in_flight"]:
            assert time.monotonic() < deadline and not task.done(), (
                f"the run ended (or 60 s passed) before the victim held requests after 32 tokens: it stood at "
                f"{state['stats'].get('num_generated_tokens')} tokens from {start}, {state['in_flight']} in flight, "
                f"state {state['state']}; the fleet: {fleet.replicas()}")
            await asyncio.sleep(0.01)
        os.kill(victim["pid"], signal.SIGKILL)  # mid-run: some of its requests streamed, some still queue
        streamed, not_streamed = await task
        return streamed + not_streamed

    results = asyncio.run(run())
    assert results[len(prompts):] == expected[len(prompts):]  # not streamed: all moved if need be, all complete
    completed = [i for i, r in enumerate(results) if isinstance(r, str)]
    errored = [i for i, r in enumerate(results) if isinstance(r, Exception)]
    assert len(completed) + len(errored) == len(prompts) + len(whole)
    assert all(results[i] == expected[i] for i in completed)  # moved requests start over: nothing repeated
    for i in errored:
        assert "replica 'simchip' failed while this request was streaming" in str(results[i])
    samples = server.metrics()
    moved = samples.get('kunlun_infer_fleet_requests_resent_total{replica="simchip"}', 0)
    ended = samples.get('kunlun_infer_fleet_requests_failed_total{replica="simchip"}', 0)
    assert ended == len(errored) and moved + ended >= 1

    deadline = time.monotonic() + 180  # Ray restarts the actor; it rejoins after a one-token health check
    while (state := next(r for r in fleet.replicas() if r["name"] == "simchip"))["state"] != "up":
        assert time.monotonic() < deadline, state
        time.sleep(0.2)
    assert state["restarts"] == 1 and state["pid"] != victim["pid"]
    before = per_replica(server.metrics(), "requests_finished_total").get("simchip", 0)
    more = [prompt(200 + i) for i in range(16)]
    assert asyncio.run(stream_all(server.url, more, 8)) == reference(single, more, 8)
    assert per_replica(server.metrics(), "requests_finished_total")["simchip"] > before


def test_a_replica_that_stops_answering_leaves_rotation_and_ray_restarts_it(fleet, server, single):
    def simchip() -> dict:
        return next(r for r in fleet.replicas() if r["name"] == "simchip")

    victim = simchip()
    prompts = [prompt(300 + i) for i in range(8)]
    os.kill(victim["pid"], signal.SIGSTOP)  # alive but silent: only the health timeout can tell
    try:
        started = time.monotonic()
        texts = asyncio.run(stream_all(server.url, prompts, 8))
        waited = time.monotonic() - started
    finally:
        try:
            os.kill(victim["pid"], signal.SIGCONT)
        except ProcessLookupError:  # killed for not answering, as it should be
            pass
    # the requests it held had streamed nothing: they moved to the CPU replica once it missed the timeout
    assert texts == reference(single, prompts, 8)
    # fleet.health_timeout_s (10 s) runs from the start of the poll it left unanswered, which may have begun a moment
    # before the streams did
    assert waited >= 9
    deadline = time.monotonic() + 180
    while (state := simchip())["state"] != "up" or state["restarts"] != victim["restarts"] + 1:
        assert time.monotonic() < deadline, state
        time.sleep(0.2)
    assert state["pid"] != victim["pid"]
    samples = server.metrics()
    assert samples['kunlun_infer_fleet_replica_restarts_total{replica="simchip"}'] == victim["restarts"] + 1
    assert samples['kunlun_infer_fleet_replica_up{replica="simchip"}'] == 1


def test_a_replica_whose_engine_hangs_in_a_step_is_replaced(fleet, server, single):
    import ray

    def simchip() -> dict:
        return next(r for r in fleet.replicas() if r["name"] == "simchip")

    def stick_in_the_next_step(replica) -> None:
        """Runs inside the replica's actor: its engine's next step never returns (a device that hangs)."""
        def stuck():
            while True:
                time.sleep(1)

        replica.engine.step = stuck

    victim = simchip()
    handle = next(r.handle for r in fleet.loop.replicas if r.name == "simchip")
    ray.get(handle.__ray_call__.remote(stick_in_the_next_step))  # its actor still answers every poll
    prompts = [prompt(400 + i) for i in range(8)]
    started = time.monotonic()
    texts = asyncio.run(stream_all(server.url, prompts, 8))
    # the ones it took were stuck in their first step: nothing streamed, so they moved after fleet.step_timeout_s
    assert texts == reference(single, prompts, 8)
    assert time.monotonic() - started >= 10
    deadline = time.monotonic() + 180
    while (state := simchip())["state"] != "up" or state["restarts"] != victim["restarts"] + 1:
        assert time.monotonic() < deadline, state
        time.sleep(0.2)
    assert state["pid"] != victim["pid"]
