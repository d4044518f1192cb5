"""``kunlun-infer plugins`` lists the installed hooks packages and where each op comes from."""

import importlib.util
import io
import json
import sys

import pytest

from tests.hooks.conftest import require_package

require_package("kunlun_infer_simchip", "kunlun-infer-simchip")

from kunlun_infer.cli import main  # noqa: E402
from kunlun_infer.layers.moe import MOE_OPS  # noqa: E402
from kunlun_infer.engine.sampler import SAMPLER_OPS  # noqa: E402
from kunlun_infer.layers.quantization import INT8_OPS  # noqa: E402
from kunlun_infer.plugins.torch_ops import LEFT_TO_THE_ENGINE  # noqa: E402


def run(*argv):
    out, err = io.StringIO(), io.StringIO()
    code = main(list(argv), stdout=out, stderr=err)
    assert code == 0, err.getvalue()
    return out.getvalue()


def test_table_lists_simchip_and_its_op_coverage_gaps():
    text = run("plugins")
    row = next(line for line in text.splitlines() if line.startswith("simchip "))
    assert "kunlun-infer-simchip 0.1.0" in row and "device=simchip" in row and row.rstrip().endswith("ok")
    coverage = text.split("op coverage")[1].splitlines()
    header = coverage[1].split()
    column = header.index("ops=simchip")
    table = coverage[2:coverage.index("")]  # the table ends at the first blank line
    sources = {line.split()[0]: line.split()[column] for line in table}
    assert sources["paged_attention"] == "reference" and sources["rotary_embedding"] == "reference"
    assert sources["rms_norm"] == "simchip" and sources["linear"] == "simchip"
    attention = text.split("attention backend for 32 query / 8 kv heads of 128, bfloat16")[1].splitlines()
    assert "  ops=torch: reference" in attention  # the op table's store_kv and paged_attention serve it
    assert "  ops=simchip: simchip-kunlun-layout" in attention  # its own backend, no paged_attention needed


def test_json_matrix_carries_coverage_per_ops_option():
    data = json.loads(run("plugins", "--json"))
    simchip = data["ops_coverage"]["simchip"]
    assert simchip["plugin"] == "simchip" and simchip["error"] is None
    # plus the int8 ops of hook API 1.3, the mixture-of-experts ops of 1.4 and the sampler's of 1.8 and 1.10,
    # which this plugin predates
    assert simchip["fallbacks"] == sorted(["paged_attention", "rotary_embedding", *INT8_OPS, *MOE_OPS,
                                           *SAMPLER_OPS])
    assert simchip["attention"] == "simchip-kunlun-layout"  # its own backend: paged_attention is not needed
    # the built-in op tables answer without a device; cpu's is complete, torch's leaves sample_tokens to the
    # engine's sampler
    for builtin, left in (("torch", list(LEFT_TO_THE_ENGINE)), ("cpu", [])):
        assert data["ops_coverage"][builtin]["error"] is None
        assert data["ops_coverage"][builtin]["fallbacks"] == left
        assert data["ops_coverage"][builtin]["attention"] == "reference"
    row = next(p for p in data["plugins"] if p["name"] == "simchip")
    assert row["distribution"] == "kunlun-infer-simchip" and row["options"]["device"] == ["simchip"]


# without the vendor's kernel library, ops=kunlun runs its vendor-backed ops (the mixture-of-experts ones too) on
# the reference (and the int8 ops of hook API 1.3 and the sampler's of 1.8, torch's own on the device, everywhere)
KUNLUN_WITHOUT_KERNELS = sorted(["add_rms_norm", "rms_norm", "rotary_embedding", "silu_and_mul", *INT8_OPS,
                                 *MOE_OPS, *SAMPLER_OPS])


@pytest.mark.parametrize("name,module,comm,fallbacks", [("cuda", "kunlun_infer_cuda", "nccl",
                                                         sorted([*INT8_OPS, *SAMPLER_OPS])),
                                                        ("kunlun", "kunlun_infer_kunlun", "bkcl",
                                                         KUNLUN_WITHOUT_KERNELS)])
def test_hardware_plugins_list_on_a_host_without_their_hardware(name, module, comm, fallbacks, monkeypatch):
    if importlib.util.find_spec(module) is None:
        pytest.skip(f"{module} is not installed (pip install ./hooks/* installs it)")
    monkeypatch.setitem(sys.modules, "kunlun_ops", None)  # as on a host without the Kunlun stack
    data = json.loads(run("plugins", "--json"))
    row = next(p for p in data["plugins"] if p["name"] == name)
    assert row["error"] is None and row["options"]["comm"] == [comm]
    assert data["ops_coverage"][name]["error"] is None
    assert data["ops_coverage"][name]["fallbacks"] == fallbacks
