"""The comm plugin's collective logic, exercised on gloo in two threads (NCCL itself needs GPUs)."""

import threading

import pytest
import torch
import torch.distributed as dist

from kunlun_infer_cuda.comm import DistComm, parse_dtype


class HostDevice:
    torch_device = torch.device("cpu")

    def synchronize(self):
        pass


class GlooDistComm(DistComm):
    """The same class with its one backend-specific method pointed at gloo."""

    name = backend = "gloo"

    def new_group(self, store, rank, world_size, timeout):
        return dist.ProcessGroupGloo(store, rank, world_size, timeout)


def run_ranks(world_size, body, tmp_path, **comm_kwargs):
    init = f"file://{tmp_path / 'rendezvous'}"
    results, errors = [None] * world_size, []

    def rank_main(rank):
        comm = GlooDistComm(device=HostDevice(), **comm_kwargs)
        try:
            comm.init(rank=rank, world_size=world_size, init_method=init, timeout_s=30)
            results[rank] = body(comm)
            comm.barrier()
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)
        finally:
            comm.destroy()

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(world_size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    return results


def test_collectives_are_exact_across_two_ranks(tmp_path):
    def body(comm):
        r = comm.rank
        summed = comm.all_reduce(torch.full((3,), float(r + 1)))
        gathered = comm.all_gather(torch.full((2, 1), float(r)), dim=-1)
        sent = comm.broadcast(torch.full((2,), 7.0) if r == 0 else torch.zeros(2), src=0)
        obj = comm.broadcast_object({"plan": [1, 2, 3]} if r == 0 else None, src=0)
        return summed, gathered, sent, obj

    for summed, gathered, sent, obj in run_ranks(2, body, tmp_path):
        assert summed.tolist() == [3.0, 3.0, 3.0]
        assert gathered.tolist() == [[0.0, 1.0], [0.0, 1.0]]
        assert sent.tolist() == [7.0, 7.0] and obj == {"plan": [1, 2, 3]}


class RecordingGroup:
    """Forwards to a real process group, noting the dtype each all-reduce puts on the wire."""

    def __init__(self, group, wire_dtypes):
        self.group, self.wire_dtypes = group, wire_dtypes

    def allreduce(self, tensors, *args):
        self.wire_dtypes.append(tensors[0].dtype)
        return self.group.allreduce(tensors, *args)

    def __getattr__(self, attr):
        return getattr(self.group, attr)


def test_point_to_point_and_a_subgroup_of_some_ranks(tmp_path):
    def body(comm):
        r = comm.rank
        if r == 0:
            comm.send(torch.arange(4.0), 2)
            comm.send(torch.full((2,), 9.0), 2)
            return None
        stage = comm.subgroup([1, 2])  # ranks 1 and 2 only, as a pipeline stage's tensor-parallel group
        summed = stage.all_reduce(torch.full((1,), float(r))).item()
        got = [comm.recv(torch.zeros(4), 0).tolist(), comm.recv(torch.zeros(2), 0).tolist()] if r == 2 else None
        return stage.rank, stage.world_size, summed, got

    results = run_ranks(3, body, tmp_path)
    assert results[1] == (0, 2, 3.0, None)
    assert results[2] == (1, 2, 3.0, [[0.0, 1.0, 2.0, 3.0], [9.0, 9.0]])  # in the order sent


def test_low_precision_all_reduce_is_carried_out_in_the_accumulate_dtype(tmp_path):
    wire_dtypes = []

    def body(comm):
        comm._group = RecordingGroup(comm._group, wire_dtypes)
        return (comm.all_reduce(torch.tensor([1.5, 2.5], dtype=torch.bfloat16)),
                comm.all_reduce(torch.tensor([1.0], dtype=torch.float32)))

    for low, exact in run_ranks(2, body, tmp_path):
        assert low.dtype == torch.bfloat16 and low.tolist() == [3.0, 5.0]
        assert exact.dtype == torch.float32 and exact.tolist() == [2.0]
    # two ranks x two calls (+ the barrier's float32 all-reduce): the bf16 one travelled as float32
    assert torch.bfloat16 not in wire_dtypes and wire_dtypes.count(torch.float32) >= 4


def test_accumulate_dtype_only_ever_widens():
    comm = DistComm(device=HostDevice(), accumulate_dtype=torch.float32)
    assert comm.accumulate_dtype_for(torch.zeros(1, dtype=torch.bfloat16), None) == torch.float32
    assert comm.accumulate_dtype_for(torch.zeros(1, dtype=torch.float32), None) is None
    assert comm.accumulate_dtype_for(torch.zeros(1, dtype=torch.float32), torch.float16) is None
    assert comm.accumulate_dtype_for(torch.zeros(1, dtype=torch.int64), torch.float32) is None
    off = DistComm(device=HostDevice(), accumulate_dtype=None)
    assert off.accumulate_dtype_for(torch.zeros(1, dtype=torch.float16), None) is None


def test_accumulate_dtype_names():
    assert parse_dtype("float32") is torch.float32 and parse_dtype("none") is None
    with pytest.raises(ValueError, match="comm.accumulate_dtype"):
        parse_dtype("int8")


def test_use_before_init_says_so():
    with pytest.raises(RuntimeError, match="before init"):
        DistComm(device=HostDevice()).all_reduce(torch.zeros(1))
