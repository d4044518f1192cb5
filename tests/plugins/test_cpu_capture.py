"""``cpu_capture``: native kernel calls recorded once, replayed on new input contents, refused when torch computes.

A replay must read what the caller wrote into its input buffers since, write
the captured result in place, and keep its scratch buffers in one arena that
every captured step of the thread shares; work a replay would skip (a torch
op that computes, an in-place write, a tensor of host values) refuses the
capture, and a kernel failing in a replay stops it with ``ReplayError``.
"""

import pytest
import torch

from kunlun_infer.ops import reference
from kunlun_infer.plugins import cpu_capture, cpu_kernels, cpu_memory, cpu_native

pytestmark = pytest.mark.skipif(cpu_native.library() is None, reason="the native CPU kernels do not build here")


def block(x: torch.Tensor, residual: torch.Tensor, w: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """Add and norm, SwiGLU, norm: three kernels over three scratch buffers (the normed rows, the sum, the SwiGLU
    output), of which the sum (written by the first kernel only) and the SwiGLU output never live together."""
    normed, _ = cpu_kernels.add_rms_norm(x, residual, w, 1e-6)
    return cpu_kernels.rms_norm(cpu_kernels.silu_and_mul(normed), w2, 1e-6)


def eager(x, residual, w, w2):
    normed, summed = reference.add_rms_norm(x, residual, w, 1e-6)
    return reference.rms_norm(reference.silu_and_mul(normed), w2, 1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_replay_reads_the_inputs_new_contents(dtype):
    g = torch.Generator().manual_seed(0)
    x, residual = torch.randn(3, 64, generator=g, dtype=dtype), torch.randn(3, 64, generator=g, dtype=dtype)
    w, w2 = torch.randn(64, generator=g, dtype=dtype), torch.randn(32, generator=g, dtype=dtype)
    captured = cpu_capture.capture(lambda: block(x, residual, w, w2))
    assert captured is not None and captured.num_calls == 3
    torch.testing.assert_close(captured.result, eager(x, residual, w, w2))
    for _ in range(3):
        x.copy_(torch.randn(3, 64, generator=g, dtype=dtype))
        residual.copy_(torch.randn(3, 64, generator=g, dtype=dtype))
        out = captured.replay()
        assert out is captured.result
        torch.testing.assert_close(out, eager(x, residual, w, w2))


def test_scratch_buffers_share_one_arena_across_steps():
    g = torch.Generator().manual_seed(1)
    steps = []
    for rows in (2, 64):  # the second needs a larger arena: the first's calls must follow it there
        x, residual = torch.randn(rows, 256, generator=g), torch.randn(rows, 256, generator=g)
        w, w2 = torch.randn(256, generator=g), torch.randn(128, generator=g)
        captured = cpu_capture.capture(lambda x=x, residual=residual, w=w, w2=w2: block(x, residual, w, w2))
        # each in a buffer of its own: (256 + 256 + 128) floats a row; sharing: the normed rows and the larger
        # of the other two
        assert captured.arena_bytes == (256 + 256) * rows * 4
        steps.append((captured, (x, residual, w, w2)))
    for _ in range(2):
        for captured, (x, residual, w, w2) in steps:
            x.copy_(torch.randn(x.shape, generator=g))
            torch.testing.assert_close(captured.replay(), eager(x, residual, w, w2))


def test_a_torch_op_that_computes_refuses_the_capture():
    x, w = torch.randn(2, 64), torch.randn(64)
    captured, reason = cpu_capture.capture_or_reason(lambda: cpu_kernels.rms_norm(x + 1, w, 1e-6))
    assert captured is None and "aten::add" in reason and "computes" in reason


@pytest.mark.skipif(not cpu_kernels.onednn_linear_available(), reason="this torch has no oneDNN prepacked linear")
def test_a_weight_reordered_for_onednn_refuses_the_capture():
    # a bf16 weight the native GEMM does not take (odd in-features) is reordered for oneDNN: an opaque tensor,
    # multiplied in torch; the capture is refused, naming that op, and does not fail on the opaque weight
    weight = cpu_kernels.pack_linear_weight(torch.randn(16, 7).to(torch.bfloat16))
    x, w = torch.randn(2, 16).to(torch.bfloat16), torch.ones(16, dtype=torch.bfloat16)
    assert weight.layout is not torch.strided
    captured, reason = cpu_capture.capture_or_reason(
        lambda: cpu_kernels.rms_norm(cpu_kernels.linear(x[:, :7], weight), w, 1e-6))
    assert captured is None and "mkldnn::_linear_pointwise" in reason and "computes" in reason


def test_an_in_place_write_refuses_the_capture():
    x, w = torch.randn(2, 64), torch.randn(64)

    def region():
        out = cpu_kernels.rms_norm(x, w, 1e-6)
        return out.mul_(2)

    captured, reason = cpu_capture.capture_or_reason(region)
    assert captured is None and "aten::mul_" in reason and "in place" in reason


def test_a_tensor_of_host_values_refuses_the_capture():
    w = torch.randn(64)
    captured, reason = cpu_capture.capture_or_reason(
        lambda: cpu_kernels.rms_norm(torch.tensor([[0.5] * 64]), w, 1e-6))
    assert captured is None and "host values" in reason


def test_a_region_without_native_kernels_is_not_captured():
    x = torch.randn(4)
    captured, reason = cpu_capture.capture_or_reason(lambda: x.view(2, 2))
    assert captured is None and "no native kernel" in reason


def test_a_kernel_failing_in_a_replay_stops_it():
    key, value = torch.randn(2, 1, 16), torch.randn(2, 1, 16)
    k_cache, v_cache = torch.zeros(4, 4, 1, 16), torch.zeros(4, 4, 1, 16)
    slots = torch.tensor([0, 5])
    captured = cpu_capture.capture(lambda: cpu_kernels.store_kv(key, value, k_cache, v_cache, slots))
    assert captured is not None
    torch.testing.assert_close(k_cache.view(16, 1, 16)[5], key[1])
    slots[1] = 16  # past the 16 slots of the caches
    key.fill_(7.0)
    with pytest.raises(cpu_capture.ReplayError, match="kunlun_store_kv"):
        captured.replay()
    assert not (k_cache == 7.0).any()  # the kernel checks every slot before it writes
    slots[1] = 6
    captured.replay()
    assert (k_cache.view(16, 1, 16)[6] == 7.0).all()


def test_a_replay_makes_its_calls_from_c_with_the_results_of_calls_from_python(monkeypatch):
    """replay.c makes the recorded calls from one ctypes call; its table passes each call's integers and floats in
    their order (rms_norm: five pointers, two integers, a float, then an int) and the results are those of the
    calls made one by one from Python."""
    g = torch.Generator().manual_seed(3)
    x, residual = torch.randn(5, 96, generator=g), torch.randn(5, 96, generator=g)
    w, w2 = torch.randn(96, generator=g), torch.randn(48, generator=g)
    from_c = cpu_capture.capture(lambda: block(x, residual, w, w2))
    assert from_c.from_c
    monkeypatch.setattr(cpu_capture, "_native_table", lambda ready, library: None)
    from_python = cpu_capture.capture(lambda: block(x, residual, w, w2))
    assert not from_python.from_c
    for _ in range(2):
        x.copy_(torch.randn(x.shape, generator=g))
        expected = eager(x, residual, w, w2)
        torch.testing.assert_close(from_c.replay(), expected)
        assert torch.equal(from_c.result, from_python.replay())


def test_calls_the_c_table_cannot_pass_are_made_from_python():
    import ctypes
    import ctypes.util

    libm = ctypes.CDLL(ctypes.util.find_library("m"))
    libm.cos.argtypes, libm.cos.restype = [ctypes.c_double], ctypes.c_double
    assert cpu_capture._native_table([(libm.cos, (1.0,), False)], cpu_native.selection().library) is None
    probe = cpu_native.selection().library.kunlun_read_probe
    ints = cpu_native.selection().library.kunlun_replay_layout(0)
    assert cpu_capture._native_table([(probe, (0, 0), False)], cpu_native.selection().library) is not None
    too_many = type("kernel", (), {"argtypes": [ctypes.c_int64] * (ints + 1)})()
    assert cpu_capture._native_table([(too_many, (0,) * (ints + 1), False)], cpu_native.selection().library) is None



def test_a_large_output_is_a_buffer_of_the_arena_not_a_kept_host_block():
    # SwiGLU's output here is 32 MiB, as large as the host tensors the CPU ops take from the caching plugin's kept
    # mappings: in a capture it is the region's own buffer, in the arena the thread's captured steps share
    cpu_memory.keep_large_host_blocks()
    g = torch.Generator().manual_seed(2)
    rows, hidden = 1024, 16384
    x, w, w2 = torch.randn(rows, hidden, generator=g), torch.randn(hidden, generator=g), torch.randn(hidden // 2)

    def norm_swiglu_norm():
        return cpu_kernels.rms_norm(cpu_kernels.silu_and_mul(cpu_kernels.rms_norm(x, w, 1e-6)), w2, 1e-6)

    captured = cpu_capture.capture(norm_swiglu_norm)
    assert captured is not None
    assert captured.arena_bytes == rows * (hidden + hidden // 2) * 4  # the normed rows and SwiGLU's output
    x.copy_(torch.randn(rows, hidden, generator=g))
    torch.testing.assert_close(captured.replay(), reference.rms_norm(
        reference.silu_and_mul(reference.rms_norm(x, w, 1e-6)), w2, 1e-6))
