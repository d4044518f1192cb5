"""Shared fixtures: a clean plugin environment and temporary plugin distributions.

``make_distribution`` writes an installed-looking distribution (a
``*.dist-info`` folder with ``entry_points.txt``, plus its modules) into a
temporary folder on ``sys.path``, so entry-point discovery finds it exactly as
it finds a pip-installed plugin.
"""

from __future__ import annotations

import itertools
import textwrap
from pathlib import Path

import pytest

pytest_plugins = ["pytester"]

_PLUGIN_ENV = ("KUNLUN_INFER_PLUGINS", "KUNLUN_INFER_DISABLE_PLUGINS", "KUNLUN_INFER_STRICT_PLUGINS",
               "KUNLUN_INFER_CONFORMANCE", "KUNLUN_INFER_CONFORMANCE_REGISTER")
_counter = itertools.count()

#: at most this many test worker processes (pytest-xdist, ``-n auto`` in pyproject.toml): each runs torch on up to
#: two threads, and some tests start ranks or replicas of their own
MAX_WORKERS = 4
#: tests that start engine ranks, stages or replicas as processes of their own: the longest files, so they
#: are handed out first and the workers (each takes whole files, ``--dist loadfile``) finish at about the same time
ENGINE_PROCESSES = ("tests/parallel/", "tests/fleet/", "tests/hardening/", "tests/tools/test_doctor.py",
                    "hooks/kunlun-infer-kunlun/tests/test_kunlun_engine.py")


def pytest_xdist_auto_num_workers(config) -> int:
    from kunlun_infer.plugins.cpu_native import _cores  # the cores the engine's kernels count as theirs

    cpus = _cores()
    return 0 if cpus < 2 else min(cpus, MAX_WORKERS)


def pytest_collection_modifyitems(config, items) -> None:
    items.sort(key=lambda item: not item.nodeid.startswith(ENGINE_PROCESSES))  # stable: files stay in order


@pytest.fixture(scope="session")
def _session_record(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("doctor-record") / "doctor-runs.jsonl"


@pytest.fixture(autouse=True)
def _clean_plugin_env(monkeypatch, _session_record):
    """Tests start without the plugin env controls a developer may have set, and never touch their doctor record."""
    for key in _PLUGIN_ENV:
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("KUNLUN_INFER_MATRIX_RECORD", str(_session_record))


class DistributionFactory:
    """Writes temporary plugin distributions under one folder put on ``sys.path``."""

    def __init__(self, root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        self.root = root
        self._monkeypatch = monkeypatch
        root.mkdir(parents=True, exist_ok=True)
        monkeypatch.syspath_prepend(str(root))

    def __call__(self, dist_name: str, source: str, *, version: str = "1.2.3",
                 entry_point: str | None = None) -> str:
        """Install module ``source`` as distribution ``dist_name``; returns the module's unique name."""
        module = f"{dist_name.replace('-', '_')}_{next(_counter)}"
        (self.root / f"{module}.py").write_text(textwrap.dedent(source))
        info = self.root / f"{dist_name.replace('-', '_')}-{version}.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist_name}\nVersion: {version}\n")
        (info / "entry_points.txt").write_text(f"[kunlun_infer]\n{entry_point or dist_name} = {module}\n")
        return module


@pytest.fixture
def make_distribution(tmp_path, monkeypatch) -> DistributionFactory:
    """Install temporary plugin distributions for this test only (see :class:`DistributionFactory`)."""
    return DistributionFactory(tmp_path / "site", monkeypatch)


@pytest.fixture
def only_plugins(monkeypatch):
    """Restrict entry-point loading to the given names (other installed plugins stay out)."""

    def restrict(*names: str) -> None:
        monkeypatch.setenv("KUNLUN_INFER_PLUGINS", ",".join(names))

    return restrict
