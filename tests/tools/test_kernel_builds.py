"""``benchmarks/kernel_builds.py`` builds the kernels it is told to from the sources it is told to, so a comparison
of two builds is of those two builds."""

import argparse
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from kunlun_infer.plugins import cpu_gemm, cpu_native
from tests.scripts import ROOT, load_script


@pytest.fixture(scope="module")
def kernel_builds():
    return load_script("benchmarks/kernel_builds.py")


def test_sources_come_from_a_revision_or_replace_named_files(kernel_builds, tmp_path):
    replacement = tmp_path / "variant.c"
    replacement.write_text("/* a variant */\n")
    replaced = kernel_builds.sources(f"gemm.c:{replacement}", tmp_path / "replaced")
    assert (replaced / "gemm.c").read_text() == "/* a variant */\n"
    for path in cpu_native.SOURCES + cpu_native.HEADERS:
        if path.name != "gemm.c":
            assert (replaced / path.name).read_bytes() == path.read_bytes(), path.name
    with pytest.raises(SystemExit, match="nosuch.c is not one of the native sources"):
        kernel_builds.sources(f"nosuch.c:{replacement}", tmp_path / "bad")
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        return  # an unpacked source tree: no revisions to take
    at_head = kernel_builds.sources("HEAD", tmp_path / "head")
    committed = subprocess.run(["git", "-C", str(ROOT), "show", f"HEAD:{kernel_builds.NATIVE}/gemm.c"],
                               capture_output=True, check=True).stdout
    assert (at_head / "gemm.c").read_bytes() == committed
    listed = subprocess.run(["git", "-C", str(ROOT), "ls-tree", "--name-only", "HEAD", f"{kernel_builds.NATIVE}/"],
                            capture_output=True, check=True, text=True).stdout.split()
    assert sorted(p.name for p in at_head.iterdir()) == sorted(Path(p).name for p in listed)
    with pytest.raises(SystemExit, match="nor a git revision"):
        kernel_builds.sources("no-such-revision", tmp_path / "none")


@pytest.fixture(scope="module")
def tree_build(kernel_builds, tmp_path_factory):
    """The working tree's sources built by the script, as a comparison builds them."""
    if cpu_native.library() is None:
        pytest.skip(f"no native kernels here: {cpu_native.selection().reason}")
    return kernel_builds.build("tree", ".", tmp_path_factory.mktemp("builds"))


def test_a_build_of_the_working_tree_multiplies_as_the_loaded_kernels_do(tree_build):
    lib = tree_build
    g = torch.Generator().manual_seed(0)
    weight, x = torch.randn(40, 24, generator=g), torch.randn(3, 24, generator=g)
    packed = cpu_gemm.pack(weight)
    y = torch.empty(3, 40)
    assert lib.kunlun_gemm_f32(packed.data_ptr(), x.data_ptr(), None, y.data_ptr(), 3, 40, 24) == 0
    assert torch.equal(y, cpu_gemm.linear(x, packed))
    torch.testing.assert_close(y, x @ weight.T, rtol=1e-5, atol=1e-5)


@pytest.fixture
def avx2_set(monkeypatch):
    """The avx2 kernel set chosen (every x86-64 CPU the suite runs on has it), the choice made again after."""
    from tests.kernel_sets import _choose

    choice = _choose("avx2", monkeypatch)
    next(choice)
    yield
    next(choice, None)


def test_builds_compare_on_the_chunk_rows_the_first_measured_unless_told(kernel_builds, avx2_set, monkeypatch,
                                                                         tmp_path):
    """Two builds of near-equal ways measured apart can choose differently on a noisy host, and then a comparison
    of their code is also one of their ways: by default the first build measures and the others are set to its
    choice; ``each`` measures every build; two row counts are set into all."""
    from kunlun_infer.plugins import cpu_tuning

    measured = []

    def fake_measure(lib, kind):  # builds measured one after the other answer 48, 16, 48, ...
        measured.append(kind)
        return {8: 1.2, 48: 0.9, 96: 0.9} if len(measured) % 4 in (1, 2) else {8: 1.2, 16: 0.9, 96: 0.9}

    monkeypatch.setattr(cpu_tuning, "measure", fake_measure)
    built = cpu_native._target(cpu_native.compiler()[1], cpu_native.selection().kernel_set)  # loaded: built
    # each build a copy of the engine's (a library of its own: its own settings), not compiled again
    monkeypatch.setattr(cpu_native, "compile_sources", lambda cc, kernel_set, srcs, target: shutil.copy(built, target))
    first = kernel_builds.build_all({"a": ".", "b": "."}, tmp_path / "first", "first")
    assert measured == ["float32", "bfloat16"]
    assert [cpu_tuning.chunk_rows_of(lib) for lib in first.values()] == [{"float32": 48, "bfloat16": 48}] * 2

    each = kernel_builds.build_all({"a": ".", "b": "."}, tmp_path / "each", "each")
    assert len(measured) == 6
    assert [cpu_tuning.chunk_rows_of(lib) for lib in each.values()] == [{"float32": 16, "bfloat16": 16},
                                                                        {"float32": 48, "bfloat16": 48}]

    told = kernel_builds.build_all({"a": "."}, tmp_path / "told", kernel_builds.chunk_rows_option("64,never"))
    assert len(measured) == 6
    assert cpu_tuning.chunk_rows_of(told["a"]) == {"float32": 64, "bfloat16": None}
    for bad in ("64", "a,b", "1,2,3"):
        with pytest.raises(argparse.ArgumentTypeError, match="two row counts"):
            kernel_builds.chunk_rows_option(bad)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int8])
def test_gemm_work_multiplies_each_weight_dtype_as_the_engine_defines_it(kernel_builds, tree_build, dtype):
    """The GEMMs a comparison times are the engine's: each weight kind packed and called as the engine does (int8
    on bf16 rows), the last output what the reference computes."""
    from dataclasses import replace

    from kunlun_infer.ops import reference

    lib = tree_build
    shape = replace(kernel_builds.perf_cpu.SHAPES["small"], layers=1)
    once, y = kernel_builds.gemm_work(lib, dtype, 3, shape)
    once()
    weights, xs = kernel_builds.gemm_inputs(shape, dtype, 3)
    last = weights[-1]
    x, n = xs[last.shape[1]], last.shape[0]
    out = y.flatten()[:3 * n].view(3, n).float()  # the last GEMM's rows, n apart
    if dtype is torch.int8:
        torch.testing.assert_close(out, reference.int8_linear(x, reference.quantize_int8(last)).float())
    else:
        tol = 2e-2 if dtype is torch.bfloat16 else 1e-4
        torch.testing.assert_close(out, x.float() @ last.float().T, rtol=tol, atol=tol)
