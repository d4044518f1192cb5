"""pytest plugin (entry point ``pytest11``): options and fixtures for the conformance suite.

``--kunlun-plugin "device=simchip ops=simchip"`` (repeatable; or env
``KUNLUN_INFER_CONFORMANCE``) chooses the plugins under test by Hydra
overrides. ``--kunlun-register my_pkg.plugin`` (or env
``KUNLUN_INFER_CONFORMANCE_REGISTER``, comma-separated) registers plugin
modules by import path, for a plugin not installed as a distribution yet.
Fixtures: ``kunlun_overrides``, ``kunlun_plugin_modules``, ``kunlun_runtime``.
"""

from __future__ import annotations

import os
import shlex
from collections.abc import Iterator
from typing import Any

import pytest

OVERRIDES_ENV = "KUNLUN_INFER_CONFORMANCE"
REGISTER_ENV = "KUNLUN_INFER_CONFORMANCE_REGISTER"


def pytest_addoption(parser: Any) -> None:
    group = parser.getgroup("kunlun_infer", "kunlun_infer plugin conformance")
    group.addoption("--kunlun-plugin", action="append", default=[], metavar="OVERRIDES",
                    help="Hydra overrides choosing the plugins under test, e.g. 'device=simchip ops=simchip' "
                         f"(env {OVERRIDES_ENV})")
    group.addoption("--kunlun-register", action="append", default=[], metavar="MODULE",
                    help=f"import path of a plugin module to register by code (env {REGISTER_ENV})")


def _overrides(config: Any) -> list[str]:
    given = config.getoption("--kunlun-plugin") or [os.environ.get(OVERRIDES_ENV, "")]
    return [token for chunk in given for token in shlex.split(chunk)]


def _modules(config: Any) -> list[str]:
    given = config.getoption("--kunlun-register") or [os.environ.get(REGISTER_ENV, "")]
    return [m.strip() for chunk in given for m in chunk.split(",") if m.strip()]


def pytest_report_header(config: Any) -> str | None:
    overrides, modules = _overrides(config), _modules(config)
    if not overrides and not modules:
        return None
    return f"kunlun_infer conformance: overrides {overrides}, registered modules {modules}"


@pytest.fixture(scope="session")
def kunlun_overrides(request: Any) -> list[str]:
    """Hydra overrides choosing the plugins under test (empty: the built-in CPU plugins)."""
    return _overrides(request.config)


@pytest.fixture(scope="session")
def kunlun_plugin_modules(request: Any) -> list[str]:
    """Import paths of plugin modules to register by code."""
    return _modules(request.config)


@pytest.fixture
def kunlun_runtime(kunlun_overrides: list[str], kunlun_plugin_modules: list[str]) -> Iterator[Any]:
    """A runtime composed from the overrides under test; closed afterwards."""
    from kunlun_infer.testing.harness import build_runtime

    runtime = build_runtime(kunlun_overrides, kunlun_plugin_modules)
    try:
        yield runtime
    finally:
        runtime.close()
