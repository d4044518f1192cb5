"""comm=bkcl: the group comes from torch.distributed.new_group(backend="nccl") after the tuning variables are
exported, a warm-up all-reduce proves every rank answered, and destroy releases what init made."""

import datetime

import pytest
import torch
import torch.distributed as dist

from kunlun_infer.errors import PluginError

from kunlun_infer_kunlun.comm import BkclComm
from kunlun_infer_kunlun.config import BkclCommConfig
from kunlun_infer_kunlun.tuning import tuning_env


class HostDevice:
    torch_device = torch.device("cpu")

    def __init__(self):
        self.synchronized = 0

    def synchronize(self):
        self.synchronized += 1


class FakeGroup:
    """A process group whose all-reduce multiplies by ``answered`` (the ranks that took part)."""

    def __init__(self, answered):
        self.answered, self.calls = answered, []

    def allreduce(self, tensors, *args):
        self.calls.append("allreduce")
        for t in tensors:
            t.mul_(self.answered)
        return type("Work", (), {"wait": lambda self: True})()


class RecordingDist:
    """torch.distributed as far as BkclComm may use it; it has no ProcessGroupNCCL to construct by hand."""

    def __init__(self, environ, answered=None, world=None):
        self.environ, self.answered, self.world = environ, answered, world
        self.calls, self.groups = [], []

    def is_initialized(self):
        return self.world is not None

    def get_rank(self):
        return self.world[0]

    def get_world_size(self):
        return self.world[1]

    def init_process_group(self, *, backend, store, rank, world_size, timeout):
        self.calls.append(("init_process_group", backend, rank, world_size))
        self.world = (rank, world_size)

    def new_group(self, *, ranks, backend, timeout, **options):
        self.calls.append(("new_group", backend, tuple(ranks), dict(self.environ), *options.items()))
        group = FakeGroup(len(ranks) if self.answered is None else self.answered)
        self.groups.append(group)
        return group

    def destroy_process_group(self, group=None):
        self.calls.append(("destroy", "default" if group is None else "group"))
        if group is None:
            self.world = None


def make_comm(tmp_path, *, environ=None, fake=None, **kwargs):
    environ = {} if environ is None else environ
    tuning = tuning_env(BkclCommConfig(tree_threshold=0, force_l3_rdma=False))
    comm = BkclComm(device=HostDevice(), tuning=tuning, environ=environ,
                    dist_api=fake if fake is not None else RecordingDist(environ, **kwargs))
    return comm, f"file://{tmp_path / 'rdzv'}"


def test_the_group_comes_from_new_group_by_backend_name_after_the_variables_are_exported(tmp_path):
    comm, url = make_comm(tmp_path)
    comm.init(rank=0, world_size=2, init_method=url, timeout_s=5)
    calls = comm.dist.calls
    assert calls[0] == ("init_process_group", "gloo", 0, 2)  # a host-side parent for new_group
    kind, backend, ranks, env_at_creation, *options = calls[1]
    assert options == []
    assert (kind, backend, ranks) == ("new_group", "nccl", (0, 1))
    assert env_at_creation == {"TORCH_NCCL_AVOID_RECORD_STREAMS": "1", "BKCL_TREE_THRESHOLD": "0",
                               "BKCL_FORCE_L3_RDMA": "0"}
    assert comm.dist.groups[0].calls == ["allreduce"] and comm.device.synchronized == 1  # the warm-up
    comm.destroy()
    assert comm.dist.calls[-2:] == [("destroy", "group"), ("destroy", "default")]
    assert not comm.dist.is_initialized()


def test_a_pipeline_stages_group_comes_from_new_group_by_backend_name_over_its_ranks_alone(tmp_path):
    comm, url = make_comm(tmp_path)
    comm.init(rank=2, world_size=4, init_method=url, timeout_s=5)
    stage = comm.subgroup([2, 3])
    assert comm.dist.calls[-1][:3] == ("new_group", "nccl", (2, 3))
    assert comm.dist.calls[-1][4:] == (("use_local_synchronization", True),)  # ranks 0 and 1 never call it
    assert (stage.rank, stage.world_size) == (0, 2)
    assert float(stage.all_reduce(torch.ones(1)).item()) == 2.0  # on the stage's own group
    with pytest.raises(ValueError, match=r"must be ascending, distinct, within 0..3 and include this rank \(2\)"):
        comm.subgroup([0, 1])
    comm.destroy()  # the stage's group first, then the whole group and the default group, once
    assert comm.dist.calls[-3:] == [("destroy", "group"), ("destroy", "group"), ("destroy", "default")]


def test_an_applications_world_over_the_same_ranks_is_reused_and_left_alone(tmp_path):
    comm, url = make_comm(tmp_path, world=(1, 2))
    comm.init(rank=1, world_size=2, init_method=url, timeout_s=5)
    assert [c[0] for c in comm.dist.calls] == ["new_group"]
    comm.destroy()
    assert comm.dist.calls[-1] == ("destroy", "group") and comm.dist.is_initialized()


def test_an_applications_world_of_another_shape_is_refused_by_name(tmp_path):
    comm, url = make_comm(tmp_path, world=(0, 8))
    with pytest.raises(PluginError, match=r"torch.distributed world of 8 rank\(s\) \(rank 0\), but the engine asked "
                                          r"for rank 0 of 2"):
        comm.init(rank=0, world_size=2, init_method=url, timeout_s=5)
    assert [c[0] for c in comm.dist.calls] == []


def test_a_warm_up_that_misses_a_rank_fails_init_and_releases_the_groups(tmp_path):
    comm, url = make_comm(tmp_path, answered=1)
    with pytest.raises(PluginError, match="warm-up all-reduce of ones over 2 rank.* gave 1") as info:
        comm.init(rank=0, world_size=2, init_method=url, timeout_s=5)
    assert info.value.layer == "hardware"
    assert comm.dist.calls[-2:] == [("destroy", "group"), ("destroy", "default")]
    with pytest.raises(RuntimeError, match="used before init"):
        comm.group  # noqa: B018


def test_tuning_keys_become_their_variables():
    env = tuning_env(BkclCommConfig(timeout=400000, tree_threshold=1, force_l3_rdma=True, avoid_record_streams=False))
    assert env == {"BKCL_TIMEOUT": "400000", "BKCL_TREE_THRESHOLD": "1", "BKCL_FORCE_L3_RDMA": "1",
                   "TORCH_NCCL_AVOID_RECORD_STREAMS": "0"}
    assert tuning_env(BkclCommConfig()) == {"TORCH_NCCL_AVOID_RECORD_STREAMS": "1"}


class GlooBkcl(BkclComm):
    """The same class on gloo, so the real torch.distributed path runs on a CPU."""

    group_backend = "gloo"


def test_on_real_torch_distributed_the_group_reduces_in_fp32_and_destroy_leaves_no_world(tmp_path):
    assert not dist.is_initialized()
    comm = GlooBkcl(device=HostDevice(), tuning={}, environ={})
    comm.init(rank=0, world_size=1, init_method=f"file://{tmp_path / 'rdzv'}", timeout_s=10)
    try:
        assert dist.is_initialized() and comm.device.synchronized == 1
        x = torch.tensor([1.0, 2.0 ** -9], dtype=torch.bfloat16)
        assert comm.accumulate_dtype_for(x, None) == torch.float32
        assert torch.equal(comm.all_reduce(x.clone()), x)
    finally:
        comm.destroy()
    assert not dist.is_initialized()


def test_timeout_reaches_the_group(tmp_path):
    comm, url = make_comm(tmp_path)
    seen = {}
    original = comm.dist.new_group

    def new_group(*, ranks, backend, timeout):
        seen["timeout"] = timeout
        return original(ranks=ranks, backend=backend, timeout=timeout)

    comm.dist.new_group = new_group
    comm.init(rank=0, world_size=1, init_method=url, timeout_s=7)
    assert seen["timeout"] == datetime.timedelta(seconds=7)
    comm.destroy()
