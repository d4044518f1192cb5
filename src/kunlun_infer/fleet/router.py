"""Where a request goes: least outstanding tokens, scaled by each replica's speed, with prefix affinity.

The router keeps, per replica, an approximate copy of what its prefix cache
holds: the chained hashes of the :data:`PREFIX_BLOCK_TOKENS`-token blocks of
the prompts it was sent, least recently used dropped first once the
replica's KV cache could not hold more. A request goes to the replica
holding the longest leading run of its prompt's blocks when that run is at
least ``fleet.affinity_min_tokens`` tokens and ``fleet.affinity_min_share``
of the prompt — unless that replica is overloaded: its load exceeds the
least loaded replica's by both ``fleet.overload_tokens`` and the factor
``fleet.overload_factor``. Otherwise the least loaded replica takes it.

A replica's load is its outstanding tokens (prompt tokens still to compute,
the cached prefix left out, plus tokens still to generate) divided by its
relative speed: the tokens per second it computed while busy, measured as
it runs, over the fleet's mean. So a replica twice as fast as another holds
twice the tokens at equal load, and replicas get work in proportion to what
they finish. Nothing here talks to Ray: the dispatcher
(:mod:`kunlun_infer.fleet.dispatch`) owns the replicas' state and calls
:func:`choose` under its lock.
"""

from __future__ import annotations

import collections
import dataclasses
import time
from collections.abc import Sequence
from typing import Any

#: tokens per block of the router's prefix index (independent of the replicas' cache.block_size)
PREFIX_BLOCK_TOKENS = 16
#: weight of the newest measurement in a replica's speed estimate
RATE_SMOOTHING = 0.3
#: shortest busy interval a speed measurement is taken over
RATE_MIN_INTERVAL_S = 0.2


def prefix_hashes(token_ids: Sequence[int]) -> list[int]:
    """One hash per full block of ``token_ids``, each covering every token before it too."""
    hashes, previous = [], 0
    for start in range(0, len(token_ids) - PREFIX_BLOCK_TOKENS + 1, PREFIX_BLOCK_TOKENS):
        previous = hash((previous, tuple(token_ids[start:start + PREFIX_BLOCK_TOKENS])))
        hashes.append(previous)
    return hashes


class PrefixIndex:
    """The prompt blocks one replica was sent, most recently used last, at most ``capacity`` of them."""

    def __init__(self, capacity: int) -> None:
        self.capacity = max(1, capacity)
        self._blocks: collections.OrderedDict[int, None] = collections.OrderedDict()

    def match(self, hashes: Sequence[int]) -> int:
        """How many leading blocks of ``hashes`` this replica holds."""
        count = 0
        for h in hashes:
            if h not in self._blocks:
                break
            count += 1
        return count

    def insert(self, hashes: Sequence[int]) -> None:
        for h in hashes:
            self._blocks[h] = None
            self._blocks.move_to_end(h)
        while len(self._blocks) > self.capacity:
            self._blocks.popitem(last=False)

    def clear(self) -> None:
        self._blocks.clear()

    def __len__(self) -> int:
        return len(self._blocks)


class RateMeter:
    """Tokens per second a replica computes while it has work, smoothed."""

    def __init__(self) -> None:
        self.rate: float | None = None
        self._since: float | None = None
        self._tokens_then = 0.0

    def observe(self, computed_tokens: float, busy: bool, now: float | None = None) -> None:
        """Feed the replica's running count of computed tokens; ``busy``: it had requests in flight."""
        now = time.monotonic() if now is None else now
        if not busy or self._since is None or computed_tokens < self._tokens_then:
            self._since, self._tokens_then = (now if busy else None), computed_tokens
            return
        elapsed = now - self._since
        if elapsed < RATE_MIN_INTERVAL_S:
            return
        sample = (computed_tokens - self._tokens_then) / elapsed
        self.rate = sample if self.rate is None else (1 - RATE_SMOOTHING) * self.rate + RATE_SMOOTHING * sample
        self._since, self._tokens_then = now, computed_tokens

    def reset(self) -> None:
        self.rate, self._since, self._tokens_then = None, None, 0.0


@dataclasses.dataclass(eq=False)
class ReplicaLoad:
    """What the router knows of one replica. The dispatcher updates it; :func:`choose` reads it."""

    name: str
    #: requests it admits at once (its scheduler.max_num_seqs + server.max_queue)
    capacity: int
    index: PrefixIndex
    meter: RateMeter = dataclasses.field(default_factory=RateMeter)
    #: prompt tokens still to compute plus tokens still to generate, over its requests in flight
    outstanding_tokens: float = 0.0
    in_flight: int = 0
    #: in rotation (up and healthy)
    up: bool = False

    @property
    def has_room(self) -> bool:
        return self.up and self.in_flight < self.capacity


@dataclasses.dataclass(frozen=True)
class Policy:
    """The router's thresholds (``fleet.affinity_*``, ``fleet.overload_*``)."""

    affinity_min_tokens: int = 32
    affinity_min_share: float = 0.5
    overload_tokens: int = 2048
    overload_factor: float = 1.5

    @classmethod
    def from_config(cls, fleet: Any) -> Policy:
        return cls(int(fleet.affinity_min_tokens), float(fleet.affinity_min_share), int(fleet.overload_tokens),
                   float(fleet.overload_factor))


@dataclasses.dataclass(frozen=True)
class Route:
    """A routing decision: the replica, why (``prefix`` or ``load``) and the prompt tokens it holds already."""

    replica: ReplicaLoad
    reason: str
    cached_tokens: int


def loads(replicas: Sequence[ReplicaLoad]) -> dict[str, float]:
    """Each replica's outstanding tokens scaled to the fleet's mean speed (unmeasured ones count as average)."""
    rates = [r.meter.rate for r in replicas if r.meter.rate]
    mean = sum(rates) / len(rates) if rates else 1.0
    return {r.name: r.outstanding_tokens * mean / (r.meter.rate or mean) for r in replicas}


def choose(replicas: Sequence[ReplicaLoad], hashes: Sequence[int], prompt_len: int, policy: Policy) -> Route | None:
    """The replica for a prompt with block ``hashes`` (see :func:`prefix_hashes`); ``None`` when all are full."""
    open_ = [r for r in replicas if r.has_room]
    if not open_:
        return None
    load = loads(open_)
    least = min(open_, key=lambda r: (load[r.name], r.in_flight))
    matched = {r.name: r.index.match(hashes) * PREFIX_BLOCK_TOKENS for r in open_}
    best = max(open_, key=lambda r: (matched[r.name], -load[r.name]))
    cached = matched[best.name]
    if cached >= policy.affinity_min_tokens and cached >= policy.affinity_min_share * prompt_len:
        excess = load[best.name] - load[least.name]
        overloaded = excess > policy.overload_tokens and load[best.name] > policy.overload_factor * load[least.name]
        if not overloaded:
            return Route(best, "prefix", cached)
    return Route(least, "load", matched[least.name])
