"""Fleet routing on this machine: does each replica get work in proportion to its speed, and do shared prefixes stay
where they are cached?

Starts ``fleet=cpu_simchip`` (a CPU replica and a simulated-chip replica, which differ in speed) on a Ray cluster
of its own with the embedded default model, then

1. load: two bursts of many requests at once, more than the fleet runs side by side; per replica the tokens it
   computed, its speed as the router measured it (tokens/s while busy) and its share of the work against its
   share of the speed (the first burst is routed before any speed is known, the second with the speeds of the
   first);
2. prefix affinity: groups of requests sharing a long prefix, the first of each sent alone; per group how many
   landed on one replica, and the prompt tokens the replicas found in their prefix caches.

    python benchmarks/fleet_routing.py [--requests 128] [--out benchmarks/results/fleet_routing.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any


import kunlun_infer as ki

sys.path.insert(0, str(Path(__file__).resolve().parent))
import machine  # noqa: E402  (a sibling file: what every benchmark records of the machine)


def snapshot(fleet: ki.Fleet) -> dict[str, dict[str, Any]]:
    return {r["name"]: r for r in fleet.replicas()}


def load_phase(fleet: ki.Fleet, count: int) -> dict[str, Any]:
    prompts = [f"Item {i}: write about the number {i} and its neighbours {i - 1} and {i + 1}." for i in range(count)]
    before = snapshot(fleet)
    started = time.perf_counter()
    outs = fleet.generate(prompts, ki.SamplingParams(max_tokens=48, temperature=0, ignore_eos=True))
    wall = time.perf_counter() - started
    after = snapshot(fleet)
    computed = {n: after[n]["stats"]["num_computed_tokens"] - before[n]["stats"]["num_computed_tokens"] for n in after}
    rates = {n: after[n]["tokens_per_s"] or 0.0 for n in after}
    total, total_rate = sum(computed.values()), sum(rates.values()) or 1.0
    return {"requests": count, "wall_s": wall, "output_tokens": sum(len(o.token_ids) for o in outs),
            "replicas": {n: {"computed_tokens": computed[n], "work_share": computed[n] / total,
                             "measured_tokens_per_s": rates[n], "speed_share": rates[n] / total_rate}
                         for n in after}}


def prefix_phase(fleet: ki.Fleet, groups: int, per_group: int) -> dict[str, Any]:
    before = snapshot(fleet)
    landed = []
    for g in range(groups):
        shared = f"Group {g} shares this long preamble about rivers, bridges and the towns between them. " * 4
        prompts = [f"{shared}Question {q}: which town comes next?" for q in range(per_group)]
        params = ki.SamplingParams(max_tokens=8, temperature=0)
        mid = snapshot(fleet)
        fleet.generate(prompts[:1], params)
        fleet.generate(prompts[1:], params)
        end = snapshot(fleet)
        took = {n: end[n]["stats"]["num_requests_finished"] - mid[n]["stats"]["num_requests_finished"] for n in end}
        landed.append(max(took.values()) / per_group)
    after = snapshot(fleet)
    hits = {n: after[n]["stats"]["prefix_cache_hit_tokens"] - before[n]["stats"]["prefix_cache_hit_tokens"]
            for n in after}
    queried = {n: after[n]["stats"]["prefix_cache_query_tokens"] - before[n]["stats"]["prefix_cache_query_tokens"]
               for n in after}
    return {"groups": groups, "per_group": per_group, "share_on_one_replica": landed,
            "prefix_hit_tokens": hits, "prompt_tokens_looked_up": queried,
            "hit_ratio": sum(hits.values()) / max(1, sum(queried.values()))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=128)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "fleet_routing.json")
    args = parser.parse_args()
    overrides = ["model.dtype=float32", "scheduler.max_num_seqs=16", "cache.num_blocks=512", "fleet.num_cpus=2",
                 "server.max_queue=256"]
    with ki.Fleet("cpu_simchip", overrides=overrides) as fleet:
        fleet.generate(["warm up"] * 4, ki.SamplingParams(max_tokens=4, temperature=0))
        result = {"machine": machine.facts(), "fleet": "cpu_simchip", "model": "embedded default (Llama, 6 layers)",
                  # the first burst is routed before the router has measured any replica's speed, the second after
                  "load_first_burst": load_phase(fleet, args.requests),
                  "load_second_burst": load_phase(fleet, args.requests), "prefix": prefix_phase(fleet, 6, 8)}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
