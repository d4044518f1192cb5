"""The ``gloo`` comm's all-to-all between ranks of one host: its shared-memory segment against gloo's sockets.

Expert parallelism (``parallel.expert_size``) moves each MoE layer's tokens to the ranks owning their experts
and the results back: three all-to-alls a layer (the pairs' counts per expert, the rows, the results). Two
ranks (processes) of this host each open two comms: one as the engine opens it (every rank on one host: the
collectives go through ``plugins/host_collectives.py``'s segment) and one that keeps to gloo's sockets (told
the ranks are on different hosts). Each case sends a dispatch's rows: ``tokens x top-k`` rows of ``--hidden``
values in ``--dtype``, split evenly between the ranks; both ways run it in turns, ``--turns`` times, the median
microseconds of a call kept. Prints the CPU model and ISA beside the table and writes
``benchmarks/results/host_all_to_all.json``::

    python benchmarks/host_all_to_all.py
    python benchmarks/host_all_to_all.py --tokens 1 8 32 128 --top-k 8 --hidden 2048 --turns 200
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent))
import machine  # noqa: E402  (a sibling file: what every benchmark records of the machine)

RESULTS = Path(__file__).resolve().parent / "results" / "host_all_to_all.json"
RANKS = 2


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank(rank: int, ports: tuple[int, int], args: argparse.Namespace, results: Any) -> None:
    from kunlun_infer.plugins import host_collectives
    from kunlun_infer.plugins.cpu_comm import GlooComm

    torch.set_num_threads(1)
    shared = GlooComm()
    shared.init(rank=rank, world_size=RANKS, init_method=f"tcp://127.0.0.1:{ports[0]}", timeout_s=60)
    real_identity = host_collectives.host_identity
    host_collectives.host_identity = lambda: f"rank-{rank}"  # as if on another host: gloo's sockets
    sockets = GlooComm()
    sockets.init(rank=rank, world_size=RANKS, init_method=f"tcp://127.0.0.1:{ports[1]}", timeout_s=60)
    host_collectives.host_identity = real_identity
    assert shared.host is not None and sockets.host is None
    dtype = getattr(torch, args.dtype)
    rows = []
    for tokens in args.tokens:
        pairs = tokens * args.top_k
        splits = [pairs // RANKS + (1 if r < pairs % RANKS else 0) for r in range(RANKS)]
        x = torch.randn(pairs, args.hidden).to(dtype) + rank
        recv = [splits[rank]] * RANKS
        want = sockets.all_to_all(x, splits, recv)
        assert torch.equal(shared.all_to_all(x, splits, recv), want)
        times: dict[str, list[float]] = {"shared memory": [], "gloo sockets": []}
        for _ in range(args.turns):
            for name, comm in (("shared memory", shared), ("gloo sockets", sockets)):
                comm.barrier()
                start = time.perf_counter()
                comm.all_to_all(x, splits, recv)
                times[name].append(time.perf_counter() - start)
        rows.append({"tokens": tokens, "rows": pairs, "bytes_per_rank": x.numel() * x.element_size(),
                     **{f"{name} us": 1e6 * statistics.median(t) for name, t in times.items()}})
    if rank == 0:
        results.put(rows)
    shared.destroy()
    sockets.destroy()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 8, 32, 128])
    parser.add_argument("--top-k", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    parser.add_argument("--turns", type=int, default=100)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()

    facts = machine.facts()
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    ports = (_free_port(), _free_port())
    procs = [ctx.Process(target=_rank, args=(r, ports, args, results)) for r in range(RANKS)]
    for p in procs:
        p.start()
    rows = results.get(timeout=600)
    for p in procs:
        p.join(timeout=60)
    print(machine.describe(facts))
    print(f"{RANKS} ranks (processes) of this host, one thread each; rows of {args.hidden} {args.dtype} values, "
          f"top-{args.top_k}; median of {args.turns} calls each way, in turns")
    print(f"{'tokens':>6} {'rows':>5} {'KiB/rank':>8} {'shared memory us':>16} {'gloo sockets us':>15} {'speed-up':>8}")
    for r in rows:
        print(f"{r['tokens']:>6} {r['rows']:>5} {r['bytes_per_rank'] / 1024:>8.0f} {r['shared memory us']:>16.0f} "
              f"{r['gloo sockets us']:>15.0f} {r['gloo sockets us'] / r['shared memory us']:>7.1f}x")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"machine": facts, "ranks": RANKS, "hidden": args.hidden, "top_k": args.top_k,
                                    "dtype": args.dtype, "turns": args.turns, "rows": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
