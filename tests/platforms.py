"""The platforms engine parity tests run on: the built-in CPU plugins, and the simulated chip.

The simulated chip (``platform=simchip``, from ``hooks/kunlun-infer-simchip``)
brings its own device, arena memory, worker-thread streams and ops — among
them an attention backend with Kunlun's cache layout ``(2, blocks, kv_heads,
block_size, head_dim)``, batches ordered decodes first and split
decode/prefill kernels. A test asking for the ``platform`` fixture runs on
both; on a checkout without the hooks packages installed the simchip case
skips with the install command.
"""

from __future__ import annotations

import importlib.util

import pytest

PLATFORMS = ("cpu", "simchip")


def require_simchip() -> None:
    """Skip the calling test unless the simulated chip's plugin is installed."""
    if importlib.util.find_spec("kunlun_infer_simchip") is None:
        pytest.skip("kunlun_infer_simchip is not installed: pip install -e hooks/kunlun-infer-simchip --no-deps")


@pytest.fixture(params=PLATFORMS)
def platform(request) -> dict[str, str]:
    """Config keys choosing the platform to run on (``make_llm(folder, **platform)``)."""
    if request.param == "simchip":
        require_simchip()
    return {"platform": request.param}
