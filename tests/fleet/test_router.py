"""The router's choices, without Ray: prefix affinity, its overload limit, full replicas, and speed-proportional load."""

from __future__ import annotations

import pytest

from kunlun_infer.fleet.router import (PREFIX_BLOCK_TOKENS, Policy, PrefixIndex, RateMeter, ReplicaLoad, choose,
                                       prefix_hashes)

POLICY = Policy(affinity_min_tokens=32, affinity_min_share=0.5, overload_tokens=500, overload_factor=1.5)


def replica(name: str, capacity: int = 8) -> ReplicaLoad:
    return ReplicaLoad(name, capacity=capacity, index=PrefixIndex(1000), up=True)


def send(route, prompt: list[int], cost: float) -> None:
    """What the dispatcher does with a route: the request joins the replica and its prompt joins the index."""
    route.replica.in_flight += 1
    route.replica.outstanding_tokens += cost
    route.replica.index.insert(prefix_hashes(prompt))


def test_prefix_hashes_cover_full_blocks_and_everything_before_them():
    a = list(range(40))
    assert len(prefix_hashes(a)) == 40 // PREFIX_BLOCK_TOKENS
    b = [99] + a[1:]
    assert prefix_hashes(a)[1] != prefix_hashes(b)[1]  # a later block differs when an earlier token does
    assert prefix_hashes(a + [1, 2, 3])[:2] == prefix_hashes(a)[:2]


def test_requests_sharing_a_long_prefix_follow_it_and_short_ones_balance():
    fleet = [replica("a"), replica("b")]
    shared = list(range(200))
    first = choose(fleet, prefix_hashes(shared + [1000]), 201, POLICY)
    send(first, shared + [1000], 201)
    for i in range(5):
        prompt = shared + [2000 + i]
        route = choose(fleet, prefix_hashes(prompt), len(prompt), POLICY)
        assert (route.replica, route.reason, route.cached_tokens) == (first.replica, "prefix", 192)
        send(route, prompt, 9)
    # a prompt sharing too little goes to the least loaded replica
    other = choose(fleet, prefix_hashes(shared[:20] + list(range(500, 600))), 120, POLICY)
    assert other.replica is not first.replica and other.reason == "load"


def test_an_overloaded_replica_loses_its_prefix_affinity():
    a, b = replica("a"), replica("b")
    shared = list(range(64))
    a.index.insert(prefix_hashes(shared))
    a.outstanding_tokens = 400  # within overload_tokens of b: affinity holds
    assert choose([a, b], prefix_hashes(shared + [7]), 65, POLICY).replica is a
    a.outstanding_tokens = 800  # 800 > 0 + 500 and > 1.5 x 0: overloaded
    assert choose([a, b], prefix_hashes(shared + [7]), 65, POLICY).replica is b
    b.outstanding_tokens = 600  # 800 vs 600: within 500 tokens again
    assert choose([a, b], prefix_hashes(shared + [7]), 65, POLICY).replica is a


def test_full_or_down_replicas_take_nothing():
    a, b = replica("a", capacity=1), replica("b", capacity=1)
    a.in_flight = 1
    assert choose([a, b], [], 4, POLICY).replica is b
    b.up = False
    assert choose([a, b], [], 4, POLICY) is None


def test_the_rate_meter_measures_busy_time_only():
    meter = RateMeter()
    meter.observe(0, busy=True, now=0.0)
    meter.observe(100, busy=True, now=1.0)
    assert meter.rate == pytest.approx(100)
    meter.observe(100, busy=False, now=5.0)  # idle seconds do not dilute it
    meter.observe(100, busy=True, now=6.0)
    meter.observe(400, busy=True, now=7.0)
    assert meter.rate == pytest.approx(0.7 * 100 + 0.3 * 300)


def test_replicas_of_different_speed_get_work_in_proportion_to_what_they_finish():
    """Three times the speed, three times the requests: a simulation of equal requests arriving faster than the
    fleet finishes them (800 tokens/s for 300 + 100)."""
    fast, slow = replica("fast", capacity=10**6), replica("slow", capacity=10**6)
    speed = {"fast": 300.0, "slow": 100.0}
    computed = {"fast": 0.0, "slow": 0.0}
    served = {"fast": 0, "slow": 0}
    now, step = 0.0, 0.05
    for arrival in range(2000):
        route = choose([fast, slow], [], 40, POLICY)
        send(route, [], 40)
        served[route.replica.name] += 1
        for r in (fast, slow):  # each replica works off its outstanding tokens at its own speed
            done = min(r.outstanding_tokens, speed[r.name] * step)
            r.outstanding_tokens -= done
            computed[r.name] += done
            r.meter.observe(computed[r.name], busy=True, now=now)
        now += step
    assert served["fast"] / served["slow"] == pytest.approx(3.0, rel=0.15)
    assert fast.meter.rate == pytest.approx(300, rel=0.1) and slow.meter.rate == pytest.approx(100, rel=0.1)
