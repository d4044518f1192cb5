"""``kernel_set``: run a test once per native CPU kernel set this machine runs, and once on torch's kernels.

Each parameter makes the process choose that set the way a CPU that has
just its instruction sets would (``KUNLUN_INFER_CPU_ISA`` caps what the
kernels may use), and the fixture checks that it was chosen: on a CPU that
has a set's instructions, a set that does not load is a failure, not a
skip. Sets this CPU lacks the instructions for are skipped, naming them, and
so are those above the cap a whole run is under (CI runs the kernel-dependent
tests again with ``KUNLUN_INFER_CPU_ISA=avx2`` as an AVX2-only CPU runs them:
the sets such a CPU lacks ran in the uncapped run). Import the fixture into
a test module (``from tests.kernel_sets import kernel_set``).
"""

from __future__ import annotations

import os

import pytest

from kunlun_infer.plugins import cpu_native
from kunlun_infer.plugins.cpu_device import ISA_ENV

#: kernel set -> the ``KUNLUN_INFER_CPU_ISA`` cap under which a CPU that has it chooses it
ISA_CAPS = {"amx": "native", "avx512-bf16": "avx512", "avx512-vnni": "avx512-vnni", "avx512-core": "avx512-core",
            "avx2-vnni": "avx2-vnni", "avx2": "avx2"}
KERNEL_SET_NAMES = (*ISA_CAPS, "torch")
#: the cap the whole run is under (None: the CPU as it is), and the instructions it leaves, read before any test
#: sets a cap of its own
RUN_CAP = os.environ.get(ISA_ENV, "").strip().lower() or None
RUN_FLAGS = cpu_native.cpu_flags()


def _torch_only() -> cpu_native.Selection:
    return cpu_native.Selection("torch", None, None, "torch", "native kernels switched off by the test")


def _choose(name: str, monkeypatch: pytest.MonkeyPatch):
    forget = cpu_native.selection.cache_clear  # the choice is made once per process: made again per test
    forget()
    if name == "torch":
        monkeypatch.setattr(cpu_native, "selection", _torch_only)
    else:
        wanted = next(s.requires for s in cpu_native.KERNEL_SETS if s.name == name)
        if RUN_CAP not in (None, "native") and not wanted <= RUN_FLAGS:
            pytest.skip(f"this run is capped to {RUN_CAP} ({ISA_ENV}), whose CPU has no "
                        f"{', '.join(sorted(wanted - RUN_FLAGS))} for the {name} kernels")
        monkeypatch.setenv(ISA_ENV, ISA_CAPS[name])
        planned, _ = cpu_native.planned()
        would_choose = "torch" if planned is None else planned.name
        if would_choose != name:
            why = f"it has no {', '.join(sorted(wanted - cpu_native.cpu_flags()))}, so it runs {would_choose}"
            pytest.skip(f"this CPU does not run the {name} kernels ({why})")
        if cpu_native.compiler()[1] is None:
            pytest.skip("no C compiler to build the native kernels")
        assert cpu_native.selection().name == name, cpu_native.selection().describe()
    yield name
    forget()


@pytest.fixture(params=KERNEL_SET_NAMES)
def kernel_set(request, monkeypatch) -> str:
    """The name of the kernel set the test runs on (``cpu_native.selection().name``)."""
    yield from _choose(request.param, monkeypatch)


@pytest.fixture(params=[name for name in KERNEL_SET_NAMES if name != "torch"])
def native_kernel_set(request, monkeypatch) -> str:
    """Like :func:`kernel_set`, over the native kernel sets only."""
    yield from _choose(request.param, monkeypatch)
