"""The built-in comm plugins: ``single`` identities, ``gloo`` accumulation in float32 by default."""

from __future__ import annotations

import threading

import pytest
import torch
from omegaconf import OmegaConf

from kunlun_infer.plugins.cpu_comm import GlooComm, SingleComm, make_gloo, parse_dtype
from kunlun_infer.testing.comm import free_port


def test_single_is_a_world_of_one():
    comm = SingleComm()
    comm.init(rank=0, world_size=1)
    t = torch.ones(3)
    assert comm.all_reduce(t) is t and comm.all_gather(t) is t and comm.broadcast_object({"a": 1}) == {"a": 1}
    with pytest.raises(ValueError, match="choose comm=gloo"):
        SingleComm().init(rank=1, world_size=2)


def test_accumulate_dtype_parsing():
    assert parse_dtype("float32") is torch.float32 and parse_dtype("none") is None
    with pytest.raises(ValueError, match="comm.accumulate_dtype='float33'"):
        parse_dtype("float33")


def _ranks_on_threads(world, body, timeout_s=60, make_comm=GlooComm):
    """``body(comm)`` on each rank (a thread) of one group of ``make_comm()`` comms; returns every rank's result."""
    url = f"tcp://127.0.0.1:{free_port()}"
    results, errors = [None] * world, []

    def rank(r):
        comm = make_comm()
        try:
            comm.init(rank=r, world_size=world, init_method=url, timeout_s=timeout_s)
            results[r] = body(comm)
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)
        finally:
            comm.destroy()

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors, errors
    return results


def _all_reduce_on_threads(make_comm, inputs):
    """Each input on its own rank (a thread) of one gloo group; returns every rank's result."""

    def body(comm):
        total = comm.all_reduce(inputs[comm.rank].clone())
        comm.barrier()
        return total

    return _ranks_on_threads(len(inputs), body, make_comm=make_comm)


def test_gloo_bf16_all_reduce_accumulates_in_float32_by_default():
    g = torch.Generator().manual_seed(0)
    inputs = [(torch.randn(2048, generator=g) * 10 ** r).to(torch.bfloat16) for r in range(3)]
    exact = sum(t.double() for t in inputs).to(torch.bfloat16)

    widened = _all_reduce_on_threads(lambda: make_gloo(config=OmegaConf.create({}), device=None), inputs)
    assert all(torch.equal(r, exact) and r.dtype == torch.bfloat16 for r in widened)

    narrow = _all_reduce_on_threads(
        lambda: make_gloo(config=OmegaConf.create({"accumulate_dtype": "none"}), device=None), inputs)
    assert not torch.equal(narrow[0], exact)  # summing in bf16 loses bits: why float32 is the default


def test_gloo_used_before_init_says_so():
    with pytest.raises(RuntimeError, match="before init"):
        GlooComm().all_reduce(torch.ones(1))


class OutOfOrderGloo(GlooComm):
    """Delivers a rank's messages the wrong way round: what a broken point-to-point plugin would do."""

    def recv(self, tensor, src):
        if not hasattr(self, "held"):
            self.held = super().recv(tensor.clone(), src)
            second = super().recv(tensor, src)
            return second
        tensor.copy_(self.held)
        return tensor


@pytest.mark.parametrize("comm_class", [GlooComm, OutOfOrderGloo])
def test_point_to_point_conformance_passes_gloo_and_catches_messages_out_of_order(comm_class):
    from kunlun_infer.testing.comm import run_point_to_point
    from kunlun_infer.testing.compare import ConformanceError

    url, errors = f"tcp://127.0.0.1:{free_port()}", [None, None]

    def rank(r):
        comm = comm_class()
        try:
            comm.init(rank=r, world_size=2, init_method=url, timeout_s=20)
            run_point_to_point(comm, torch.device("cpu"), r, 2)
        except Exception as exc:  # noqa: BLE001 - checked below
            errors[r] = exc
        finally:
            comm.destroy()

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    if comm_class is GlooComm:
        assert errors == [None, None]
    else:
        assert all(isinstance(e, ConformanceError) and "message 0" in str(e) for e in errors), errors


def test_gloo_keeps_a_collectives_tensors_until_the_group_is_gone_and_no_longer_than_a_few_collectives():
    # torch < 2.8 destroys a gloo group holding the GIL while its worker thread may still be letting go of the last
    # collective; a tensor freed by then needs the GIL in that thread, and destroy() would hang for ever
    import weakref

    from kunlun_infer.plugins.process_group import SETTLING_COLLECTIVES

    comm = make_gloo(config=OmegaConf.create({}), device=None)
    comm.init(rank=0, world_size=1, init_method=f"tcp://127.0.0.1:{free_port()}", timeout_s=30)
    given = torch.ones(4)
    gathered = comm.all_to_all(torch.arange(3.0), [3], [3])
    kept, parts = weakref.ref(given), weakref.ref(gathered)
    assert torch.equal(comm.all_reduce(given), torch.ones(4))
    del given, gathered
    assert kept() is not None and parts() is not None  # still the comm's, though the caller let go

    comm.destroy()
    assert kept() is None and parts() is None  # released once the group is gone

    comm.init(rank=0, world_size=1, init_method=f"tcp://127.0.0.1:{free_port()}", timeout_s=30)
    first = torch.ones(2)
    comm.all_reduce(first)
    first_ref = weakref.ref(first)
    del first
    for _ in range(SETTLING_COLLECTIVES):
        comm.barrier()
    assert first_ref() is None  # a bounded window, not a leak
    comm.destroy()


def _ours_in(folder):
    import os

    return [name for name in os.listdir(folder) if name.startswith("kunlun_infer-")]


needs_native = pytest.mark.skipif(
    __import__("kunlun_infer.plugins.cpu_native", fromlist=["library"]).library() is None,
    reason="the host's shared-memory collectives need the native CPU kernels")


@needs_native
@pytest.mark.parametrize("world", [2, 3])
def test_gloo_ranks_on_one_host_meet_in_shared_memory_with_gloos_results(world):
    from kunlun_infer.plugins import host_collectives

    g = torch.Generator().manual_seed(world)
    big = host_collectives.SLOT_BYTES // 4 * 2 + 5  # float32 values: three pieces through a slot
    inputs = [{"bf16": (torch.randn(2048, generator=g) * 10 ** r).to(torch.bfloat16),
               "big": torch.randn(big, generator=g), "ints": torch.arange(6, dtype=torch.int64) * (r + 1),
               "strided": torch.randn(8, 6, generator=g).t(), "rows": torch.randn(3, 5, generator=g) + r}
              for r in range(world)]

    def body(comm):
        mine = inputs[comm.rank]
        out = {"segment": comm.host is not None and comm.buffer_bytes() == comm.host.nbytes}
        for key in ("bf16", "big", "ints", "strided"):
            out[key] = comm.all_reduce(mine[key].clone())
        out["gathered"] = comm.all_gather(mine["rows"], dim=1)
        out["gathered_big"] = comm.all_gather(mine["big"], dim=0)
        out["from_last"] = comm.broadcast(mine["big"].clone(), src=world - 1)
        out["object"] = comm.broadcast_object({"rank": comm.rank, "text": "x" * 3000} if comm.rank == 1 else None, 1)
        comm.barrier()
        return out

    results = _ranks_on_threads(world, body)
    assert all(r["segment"] for r in results)
    exact_bf16 = sum(x["bf16"].double() for x in inputs).to(torch.bfloat16)  # summed in float32: every bit kept
    for r in results:
        assert torch.equal(r["bf16"], exact_bf16) and r["bf16"].dtype == torch.bfloat16
        assert torch.allclose(r["big"], sum(x["big"] for x in inputs), atol=1e-5)
        assert torch.equal(r["ints"], sum(x["ints"] for x in inputs))
        assert torch.allclose(r["strided"], sum(x["strided"] for x in inputs), atol=1e-6)
        assert torch.equal(r["gathered"], torch.cat([x["rows"] for x in inputs], dim=1))
        assert torch.equal(r["gathered_big"], torch.cat([x["big"] for x in inputs]))
        assert torch.equal(r["from_last"], inputs[-1]["big"])
        assert r["object"] == {"rank": 1, "text": "x" * 3000}
        for key in ("big", "strided"):  # every rank sums in rank order: the same bits everywhere
            assert torch.equal(r[key], results[0][key])
    assert _ours_in(host_collectives.SHM_DIR) == []  # the segment's name went once every rank had it


@needs_native
@pytest.mark.parametrize("world", [2, 3])
def test_all_to_all_on_one_host_goes_through_shared_memory_in_rounds_and_a_wrong_split_is_named(world, monkeypatch):
    from kunlun_infer.plugins import host_collectives
    from kunlun_infer.plugins.process_group import ProcessGroupComm

    def not_gloo(self, *args):
        raise AssertionError("an all-to-all between ranks of one host went through gloo's sockets")

    monkeypatch.setattr(ProcessGroupComm, "all_to_all", not_gloo)
    monkeypatch.setattr(host_collectives, "SLOT_BYTES", 4096)  # a few KiB a destination: rows go in rounds

    def rows(src, dst, many, width, dtype):
        n = (src + dst) % 3 * many  # some pairs send nothing
        return (torch.arange(n * width, dtype=torch.float64).view(n, width) + 1000 * src + 100 * dst).to(dtype)

    cases = {"rounds": (150, 10, torch.float32), "bf16": (7, 5, torch.bfloat16), "one-row": (1, 1, torch.int64)}

    def body(comm):
        me, out = comm.rank, {}
        for name, (many, width, dtype) in cases.items():
            send = torch.cat([rows(me, j, many, width, dtype) for j in range(world)])
            out[name] = comm.all_to_all(send.squeeze(1) if width == 1 else send,
                                        [(me + j) % 3 * many for j in range(world)],
                                        [(i + me) % 3 * many for i in range(world)])
        nothing = torch.empty(0, 4)  # a rank that sends nothing at all, and receives nothing
        splits = [0] * world if me == 0 else [0] + [1] * (world - 1)
        out["empty"] = comm.all_to_all(nothing if me == 0 else torch.full((world - 1, 4), float(me)), splits, splits)
        wrong = [(i + me) % 3 for i in range(world)]
        if me == 1:
            wrong[0] += 1  # expects a row rank 0 does not send
        try:
            comm.all_to_all(torch.cat([rows(me, j, 1, 2, torch.float32) for j in range(world)]),
                            [(me + j) % 3 for j in range(world)], wrong)
            out["error"] = None
        except ValueError as exc:
            out["error"] = str(exc)
        out["after"] = comm.all_reduce(torch.ones(2))  # every rank took the same rounds: still in step
        return out

    results = _ranks_on_threads(world, body)
    for me, r in enumerate(results):
        for name, (many, width, dtype) in cases.items():
            want = torch.cat([rows(i, me, many, width, dtype) for i in range(world)])
            assert torch.equal(r[name], want.squeeze(1) if width == 1 else want), (name, me)
        others = torch.arange(1, world, dtype=torch.float32)[:, None].expand(world - 1, 4)
        assert torch.equal(r["empty"], torch.empty(0, 4) if me == 0 else others)
        if me == 1:
            sent = [(i + 1) % 3 for i in range(world)]
            assert r["error"] == (f"all_to_all: rank 1 expected {[sent[0] + 1, *sent[1:]]} rows, the ranks send "
                                  f"{sent}")
        else:
            assert r["error"] is None
        assert torch.equal(r["after"], torch.full((2,), float(world)))


@needs_native
def test_gloo_keeps_to_sockets_where_the_ranks_are_on_different_hosts_or_no_segment_can_be_made(monkeypatch,
                                                                                                tmp_path):
    import errno

    from kunlun_infer.plugins import host_collectives

    def body(comm):
        return comm.host, comm.all_reduce(torch.full((3,), float(comm.rank + 1))), comm.all_gather(
            torch.tensor([comm.rank]), dim=0)

    monkeypatch.setattr(host_collectives, "host_identity", lambda: threading.current_thread().name)
    for host, total, gathered in _ranks_on_threads(2, body):
        assert host is None and torch.equal(total, torch.full((3,), 3.0)) and gathered.tolist() == [0, 1]
    monkeypatch.undo()

    def no_room(fd, offset, length):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(host_collectives, "SHM_DIR", str(tmp_path))
    monkeypatch.setattr(host_collectives.os, "posix_fallocate", no_room)
    for host, total, gathered in _ranks_on_threads(2, body):
        assert host is None and torch.equal(total, torch.full((3,), 3.0)) and gathered.tolist() == [0, 1]
    assert _ours_in(tmp_path) == []  # the segment that could not be reserved is not left behind


@needs_native
def test_a_rank_that_never_arrives_times_out_naming_it():
    import time

    def body(comm):
        if comm.rank == 1:
            return None  # never joins the all-reduce
        started = time.monotonic()
        with pytest.raises(RuntimeError, match=r"rank 1 \(pid \d+\) did not arrive .*comm.timeout_s=2s \(timed out\)"):
            comm.all_reduce(torch.ones(4))
        return time.monotonic() - started

    waited = _ranks_on_threads(2, body, timeout_s=2)[0]
    assert 2 <= waited < 4


@needs_native
def test_point_to_point_messages_on_one_host_go_through_shared_memory_in_order_and_in_pieces(monkeypatch):
    from kunlun_infer.plugins import host_collectives
    from kunlun_infer.plugins.process_group import ProcessGroupComm

    def not_gloo(self, *args):
        raise AssertionError("a message between ranks of one host went through gloo's sockets")

    monkeypatch.setattr(ProcessGroupComm, "send", not_gloo)
    monkeypatch.setattr(ProcessGroupComm, "recv", not_gloo)
    piece = host_collectives.p2p_piece_bytes(3)
    g = torch.Generator().manual_seed(5)
    # more pieces than a ring holds (the sender waits for the receiver), an empty one, bf16 and int64 rows
    messages = [torch.randn(piece * host_collectives.P2P_SLOTS // 4 * 3 + 7, generator=g),
                torch.empty(0), (torch.randn(5, 7, generator=g) * 100).to(torch.bfloat16),
                torch.arange(12, dtype=torch.int64).view(3, 4)]

    def body(comm):
        after, before = (comm.rank + 1) % 3, (comm.rank - 1) % 3
        if comm.rank == 0:  # rank 0 sends first and receives last: the others pass the ring on as they go
            for m in messages:
                comm.send(m, after)
        got = []
        for m in messages:
            target = torch.empty(m.shape[::-1], dtype=m.dtype).t() if m.dim() == 2 else torch.empty_like(m)
            got.append(comm.recv(target, before))  # a 2-D target that is not contiguous is filled all the same
            if comm.rank != 0:
                comm.send(got[-1], after)
        return got

    for got in _ranks_on_threads(3, body):
        assert [t.dtype for t in got] == [m.dtype for m in messages]
        assert all(torch.equal(t, m) for t, m in zip(got, messages))


@needs_native
def test_a_message_received_into_the_wrong_size_or_never_sent_fails_naming_the_ranks():
    import time

    def body(comm):
        if comm.rank == 0:
            comm.send(torch.ones(6), 1)
            started = time.monotonic()
            with pytest.raises(RuntimeError, match=r"rank 1 \(pid \d+\) sent nothing to rank 0 through shared "
                                                   r"memory within comm.timeout_s=2s \(timed out\)"):
                comm.recv(torch.empty(3), 1)
            return time.monotonic() - started
        with pytest.raises(RuntimeError, match=r"rank 0 sent a message of 24 bytes where rank 1 received into 20 "
                                               r"\(\(5,\) torch.float32\); a recv's tensor must have the size"):
            comm.recv(torch.empty(5), 0)
        return None

    waited = _ranks_on_threads(2, body, timeout_s=2)[0]
    assert 2 <= waited < 4


@needs_native
def test_the_native_all_reduce_gives_the_bits_of_the_python_one_and_counts_its_collectives_alike():
    from kunlun_infer.plugins import host_collectives

    g = torch.Generator().manual_seed(11)
    big = host_collectives.SLOT_BYTES // 4 + 3  # float32 values (bf16 widened alike): two pieces
    inputs = [{"f32": torch.randn(big, generator=g) * 10 ** (2 * r), "bf16": (torch.randn(
        big, generator=g) * 10 ** r).to(torch.bfloat16), "rows": torch.randn(4, 896, generator=g) * (r + 1)}
              for r in range(3)]

    def body(comm):
        out = {}
        for native in (True, False):  # the C call, then the torch copies and adds it replaced
            comm.host.native_all_reduce = native
            for key, accumulate in (("f32", None), ("bf16", torch.float32), ("bf16", torch.bfloat16),
                                    ("rows", None)):
                mine = inputs[comm.rank][key].clone()
                out[native, key, accumulate] = comm.all_reduce(mine, accumulate_dtype=accumulate)
            out[native, "gathered"] = comm.all_gather(torch.tensor([comm.rank]), dim=0)  # counts still agree
        return out

    for got in _ranks_on_threads(3, body):
        for key in [k for k in got if k[0] is True]:
            assert torch.equal(got[key], got[(False, *key[1:])]), key
        assert torch.equal(got[True, "bf16", torch.bfloat16], got[False, "bf16", torch.bfloat16])
        exact = sum(x["bf16"].double() for x in inputs).to(torch.bfloat16)
        assert torch.equal(got[True, "bf16", torch.float32], exact)  # widened: rounded once
        assert not torch.equal(got[True, "bf16", torch.bfloat16], exact)  # rounded after each add: bits lost
        assert got[True, "gathered"].tolist() == [0, 1, 2]


@needs_native
@pytest.mark.parametrize("native", [True, False])
def test_ranks_that_call_their_collectives_in_different_orders_fail_naming_both(native):
    def body(comm):
        comm.host.native_all_reduce = native
        comm.barrier()
        if comm.rank == 0:  # an all-reduce where rank 1 broadcasts: neither reads the other's slot as its own
            with pytest.raises(RuntimeError, match=r"rank 1 is at a broadcast from rank 1 of 16 bytes where rank 0 "
                                                   r"is at an all-reduce of 16 bytes .*different orders"):
                comm.all_reduce(torch.ones(4))
        else:
            with pytest.raises(RuntimeError, match=r"rank 0 is at an all-reduce of 16 bytes where rank 1 is at a "
                                                   r"broadcast from rank 1 of 16 bytes"):
                comm.broadcast(torch.ones(4), src=1)
        return True

    assert _ranks_on_threads(2, body) == [True, True]
