"""Fakes for a Kunlun host: xpu-smi output, a torch_xmlir module, and torch's CUDA API as the stack serves it."""

import types

SMI_OUTPUT = """\
Runtime Version: 5.0.21
Driver Version: 5.0.21
  DEVICES
---------------------------------------------------------------------------------------------------------
| DevID |   PCI Addr   | Model |        SN        |    INODE   | UseRate |     L3     |     Memory      |
---------------------------------------------------------------------------------------------------------
|     0 | 0000:06:00.0 | P800  | 02K00Q0000000001 | /dev/xpu0  |     0 % | 0 / 96 MB  |  512 / 98304 MB |
|     1 | 0000:07:00.0 | P800  | 02K00Q0000000002 | /dev/xpu1  |     3 % | 0 / 96 MB  | 1024 / 98304 MB |
|     2 | 0000:46:00.0 | P800  | 02K00Q0000000003 | /dev/xpu2  |     0 % | 0 / 96 MB  |  512 / 98304 MB |
---------------------------------------------------------------------------------------------------------
"""


def fake_run(outputs):
    """A ``run(argv)`` answering from ``{tool: stdout}``; tools not listed are absent."""
    calls = []

    def run(argv):
        calls.append(argv)
        return outputs.get(argv[0])

    run.calls = calls
    return run


def fake_importer(modules):
    """An ``import_module(name)`` answering from ``{name: module}``; others raise ImportError."""

    def import_module(name):
        if name not in modules:
            raise ImportError(f"No module named '{name}'")
        return modules[name]

    return import_module


def torch_xmlir_module(version="2.1.0", bkcl="2.3.1", file=None):
    return types.SimpleNamespace(__version__=version, __bkcl_version__=bkcl, __file__=file)


class FakeCudaApi:
    """torch.cuda as the vendor stack would answer it on a host with ``count`` XPUs."""

    def __init__(self, count=3):
        self.count, self.current = count, None

    def is_available(self):
        return self.count > 0

    def device_count(self):
        return self.count

    def set_device(self, index):
        self.current = index

    def synchronize(self, index=None):
        pass

    def get_device_properties(self, index):
        return types.SimpleNamespace(name="P800", total_memory=96 * 2**30, major=3, minor=0)

    def mem_get_info(self, index):
        return 90 * 2**30, 96 * 2**30
