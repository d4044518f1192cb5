"""Fakes for a Kunlun host: a file-system root with /dev/xpuctrl, xpu-smi's two outputs, installed
distributions, a torch_xmlir module, and torch's CUDA API as the stack serves it."""

import types

#: `xpu-smi -i 1 -q` on an eight-card P800 host (the layout of the tool's query report)
SMI_QUERY = """\
==============XPUSMI LOG==============

Timestamp                                 : Mon Mar  2 10:00:00 2026
Driver Version                            : 5.0.21.26
XPU-RT Version                            : 5.0.21

Attached XPUs                             : 8
XPU 00000000:07:00.0
    Product Name                          : P800 OAM
    Product Brand                         : KUNLUNXIN
    Product Architecture                  : KL3
    Serial Number                         : 02K00Q0000000002
    XPU UUID                              : GPU-00000000-0000-0000-0000-000000000002
    Minor Number                          : 1
    Firmware Version
        ALL Version                       : 1.0.2.14.1.54
    PCI
        Bus                               : 0x07
        Bus Id                            : 00000000:07:00.0
    Memory Usage
        Total                             : 98304 MiB
        Reserved                          : 0 MiB
        Used                              : 1024 MiB
        Free                              : 97280 MiB
    L3 Usage
        Total                             : 96 MiB
        Used                              : 0 MiB
    Utilization
        Xpu                               : 3 %
    Processes                             : None
"""

#: plain `xpu-smi` (the table), as older tools print it when `-q` is refused
SMI_TABLE = """\
Mon Mar  2 10:00:00 2026
+-----------------------------------------------------------------------------+
| XPU-SMI               Driver Version: 5.0.21.26    XPU-RT Version: 5.0.21   |
|-------------------------------+----------------------+----------------------+
| XPU  Name        Persistence-M| Bus-Id        Disp.A | Volatile Uncorr. ECC |
| Fan  Temp  Perf  Pwr:Usage/Cap|         Memory-Usage | XPU-Util  Compute M. |
|                               |             L3-Usage |            SR-IOV M. |
|===============================+======================+======================|
|   0  P800 OAM           N/A   | 00000000:06:00.0 N/A |                    0 |
| N/A   37C  N/A     85W / 400W |    512MiB / 98304MiB |      0%      Default |
|                               |      0MiB / 96MiB    |             Disabled |
+-------------------------------+----------------------+----------------------+
|   1  P800 OAM           N/A   | 00000000:07:00.0 N/A |                    0 |
| N/A   38C  N/A     86W / 400W |   1024MiB / 98304MiB |      3%      Default |
|                               |      0MiB / 96MiB    |             Disabled |
+-------------------------------+----------------------+----------------------+
"""

#: the distributions of the vLLM-Kunlun deployment (torch 2.5.1, kunlun_ops 0.1.58)
VLLM_KUNLUN_DISTS = {"torch": "2.5.1", "xpytorch": "2.5.1.4", "kunlun_ops": "0.1.58+ee39020a",
                     "xspeedgate_ops": "1.1.0+53992ca", "cocopod": "1.1.0"}
#: the distributions of the sglang-kunlun deployment (torch 2.9, xpytorch 3.6.x, torch29 kernel builds)
SGLANG_KUNLUN_DISTS = {"torch": "2.9.0", "xpytorch": "3.6.2", "kunlun_ops": "0.1.205+223cef9e",
                       "xspeedgate_ops": "1.2.0+680bed9.torch29", "cocopod": "1.3.0+224a318"}


def fake_run(outputs):
    """A ``run(argv)`` answering from ``{"xpu-smi -i 1 -q": stdout}``; other command lines are absent tools."""
    calls = []

    def run(argv):
        calls.append(list(argv))
        return outputs.get(" ".join(argv))

    run.calls = calls
    return run


def fake_importer(modules):
    """An ``import_module(name)`` answering from ``{name: module}``; others raise ImportError."""

    def import_module(name):
        if name not in modules:
            raise ImportError(f"No module named '{name}'")
        return modules[name]

    return import_module


def fake_versions(dists):
    """A ``version_of(distribution)`` answering from ``{name: version}``."""
    return lambda name: dists.get(name)


def kunlun_root(tmp_path):
    """A file-system root with the control node a Kunlun host has."""
    (tmp_path / "dev").mkdir(exist_ok=True)
    (tmp_path / "dev" / "xpuctrl").write_bytes(b"")
    return tmp_path


def torch_xmlir_module(name="P800", total_memory=96 * 2**30):
    """``torch_xmlir`` with the ``xpu.get_device_properties`` the stack documents, and nothing else."""
    props = types.SimpleNamespace(name=name, total_memory=total_memory)
    return types.SimpleNamespace(xpu=types.SimpleNamespace(get_device_properties=lambda index: props))


class FakeCudaApi:
    """torch.cuda as the stack answers it on a host with ``count`` XPUs: the compatibility layer's "GPU", 8.6."""

    def __init__(self, count=3, initialised=False):
        self.count, self.current, self.initialised = count, None, initialised

    def is_available(self):
        return self.count > 0

    def is_initialized(self):
        return self.initialised

    def device_count(self):
        return self.count

    def set_device(self, index):
        self.current, self.initialised = index, True

    def synchronize(self, index=None):
        pass

    def get_device_properties(self, index):
        return types.SimpleNamespace(name="GPU", total_memory=96 * 2**30, major=8, minor=6,
                                     multi_processor_count=64)

    def mem_get_info(self, index):
        return 90 * 2**30, 96 * 2**30
