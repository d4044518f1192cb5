"""Conformance of a comm plugin: collectives (and, from hook API 1.4, point to point and subgroups) give
exact results on every rank.

``check_collectives`` spawns ``world_size`` processes (torch.multiprocessing,
``spawn``), each building the runtime from the same overrides and joining the
group over TCP on a free loopback port; every rank checks its own results and
reports back. Inputs are small integers, so sums are exact in every dtype.
``all_to_all`` (hook API 1.4, expert parallelism) is checked with uneven and
empty splits.
"""

from __future__ import annotations

import queue as queue_module
import socket
import traceback
from collections.abc import Sequence
from typing import Any

import torch

from kunlun_infer.capabilities import Comm, has_point_to_point
from kunlun_infer.testing.compare import ConformanceError
from kunlun_infer.testing.harness import build_runtime


def free_port() -> int:
    """A TCP port that was free on the loopback interface a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _expect_equal(got: torch.Tensor, want: torch.Tensor, what: str, rank: int) -> None:
    if got.dtype != want.dtype or tuple(got.shape) != tuple(want.shape) or not torch.equal(got.cpu(), want.cpu()):
        raise ConformanceError(f"comm: {what} on rank {rank} gave {got.cpu().tolist()} ({got.dtype}), expected "
                               f"{want.cpu().tolist()} ({want.dtype})")


def run_collectives(comm: Comm, device: torch.device, rank: int, world: int) -> None:
    """The checks one rank runs on an initialised comm."""
    ranks = torch.arange(1, world + 1, dtype=torch.float32)
    t = torch.full((4, 3), float(rank + 1), device=device)
    _expect_equal(comm.all_reduce(t), torch.full((4, 3), float(ranks.sum())), "all_reduce(float32)", rank)
    t = torch.full((5,), rank + 1, dtype=torch.int64, device=device)
    _expect_equal(comm.all_reduce(t), torch.full((5,), int(ranks.sum()), dtype=torch.int64), "all_reduce(int64)", rank)
    for dtype in (torch.bfloat16, torch.float16):
        # one rank holds a large value, the others small ones: the sum rounds once, from float32
        values = [256.0 + 3.0] + [1.0] * (world - 1)
        t = torch.full((6,), values[rank], dtype=dtype, device=device)
        want = torch.full((6,), sum(torch.tensor(v, dtype=dtype).float().item() for v in values)).to(dtype)
        _expect_equal(comm.all_reduce(t, accumulate_dtype=torch.float32), want,
                      f"all_reduce({dtype}, accumulate_dtype=float32)", rank)
    part = torch.arange(6, dtype=torch.float32, device=device).reshape(2, 3) + 10 * rank
    want_rows = torch.cat([torch.arange(6, dtype=torch.float32).reshape(2, 3) + 10 * r for r in range(world)], 0)
    _expect_equal(comm.all_gather(part, dim=0), want_rows, "all_gather(dim=0)", rank)
    want_cols = torch.cat([torch.arange(6, dtype=torch.float32).reshape(2, 3) + 10 * r for r in range(world)], -1)
    _expect_equal(comm.all_gather(part, dim=-1), want_cols, "all_gather(dim=-1)", rank)
    src = world - 1
    t = torch.full((3,), 7.0 if rank == src else -1.0, device=device)
    _expect_equal(comm.broadcast(t, src=src), torch.full((3,), 7.0), f"broadcast(src={src})", rank)
    _expect_equal(t, torch.full((3,), 7.0), f"broadcast(src={src}) in place", rank)
    _check_all_to_all(comm, device, rank, world)
    obj = comm.broadcast_object({"step": 3, "ids": [1, 2]} if rank == 0 else None, src=0)
    if obj != {"step": 3, "ids": [1, 2]}:
        raise ConformanceError(f"comm: broadcast_object on rank {rank} gave {obj!r}")
    if has_point_to_point(comm) and world > 1:
        run_point_to_point(comm, device, rank, world)
    comm.barrier()


def run_point_to_point(comm: Comm, device: torch.device, rank: int, world: int) -> None:
    """Hook API 1.4: each rank passes two messages to the next in a ring, in order; then a subgroup reduces."""
    after, before = (rank + 1) % world, (rank - 1) % world
    sent = [torch.full((2, 3), float(10 * rank + k), device=device) for k in range(2)]
    got = [torch.empty(2, 3, device=device) for _ in range(2)]
    steps = [lambda: [comm.send(t, after) for t in sent], lambda: [comm.recv(t, before) for t in got]]
    for step in (steps if rank % 2 == 0 else steps[::-1]):  # even ranks send first: no rank waits on itself
        step()
    for k in range(2):
        _expect_equal(got[k], torch.full((2, 3), float(10 * before + k)), f"recv(src={before}) message {k}", rank)
    members = list(range(world - 1)) if world > 2 else list(range(world))
    if rank in members:
        sub = comm.subgroup(members)
        if (sub.rank, sub.world_size) != (members.index(rank), len(members)):
            raise ConformanceError(f"comm: subgroup({members}) on rank {rank} reports rank={sub.rank}, "
                                   f"world_size={sub.world_size}")
        t = torch.full((3,), float(rank + 1), device=device)
        _expect_equal(sub.all_reduce(t), torch.full((3,), float(sum(r + 1 for r in members))),
                      f"subgroup({members}).all_reduce", rank)


def _check_all_to_all(comm: Comm, device: torch.device, rank: int, world: int) -> None:
    """Rank ``r`` sends ``(r + j) % 3`` rows (some none) to rank ``j``, each row holding ``100 r + j``; in the
    plugin's ``all_to_all`` (hook API 1.4) and in the default one built on ``all_gather``."""
    def rows(src: int, dst: int) -> torch.Tensor:
        return torch.full(((src + dst) % 3, 2), 100 * src + dst, dtype=torch.int64)

    send = torch.cat([rows(rank, j) for j in range(world)]).to(device)
    want = torch.cat([rows(i, rank) for i in range(world)])
    send_splits, recv_splits = [(rank + j) % 3 for j in range(world)], [(i + rank) % 3 for i in range(world)]
    _expect_equal(comm.all_to_all(send, send_splits, recv_splits), want, "all_to_all(int64, uneven splits)", rank)
    _expect_equal(Comm.all_to_all(comm, send.float(), send_splits, recv_splits), want.float(),
                  "all_to_all(float32) built on all_gather (the default for plugins before hook API 1.4)", rank)


def _worker(rank: int, world: int, init_method: str, overrides: list[str], modules: list[str],
            results: Any) -> None:
    try:
        with build_runtime(overrides, modules, local_rank=rank) as rt:
            rt.init_comm(rank=rank, world_size=world, init_method=init_method, timeout_s=60.0)
            _check_layout(rt.comm, rank, world)
            run_collectives(rt.comm, rt.device.torch_device, rank, world)
        results.put((rank, None))
    except BaseException as exc:  # noqa: BLE001 - reported to the parent
        results.put((rank, f"{type(exc).__name__}: {exc}\n{traceback.format_exc(limit=6)}"))


def _check_layout(comm: Comm, rank: int, world: int) -> None:
    if (comm.rank, comm.world_size) != (rank, world):
        raise ConformanceError(f"comm: after init(rank={rank}, world_size={world}) it reports rank={comm.rank}, "
                               f"world_size={comm.world_size}")


def check_collectives(overrides: Sequence[str] = ("comm=gloo",), *, world_size: int = 2,
                      modules: Sequence[str] = (), timeout_s: float = 180.0) -> None:
    """Run :func:`run_collectives` on ``world_size`` spawned ranks; raise naming the failing rank."""
    ctx = torch.multiprocessing.get_context("spawn")
    results = ctx.Queue()
    init_method = f"tcp://127.0.0.1:{free_port()}"
    procs = [ctx.Process(target=_worker, args=(r, world_size, init_method, list(overrides), list(modules), results),
                         daemon=True) for r in range(world_size)]
    for p in procs:
        p.start()
    failures: dict[int, str] = {}
    reported = 0
    try:
        while reported < world_size:
            rank, error = results.get(timeout=timeout_s)
            reported += 1
            if error is not None:
                failures[rank] = error
    except queue_module.Empty:
        failures[-1] = f"not every rank reported within {timeout_s:.0f} s"
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    if failures:
        first = min(failures)
        raise ConformanceError(f"comm: collectives failed on rank(s) {sorted(failures)}; "
                               f"rank {first}: {failures[first]}")
