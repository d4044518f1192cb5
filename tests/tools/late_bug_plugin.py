"""A test ops plugin ``latebug``: rms_norm is right for up to 8 rows and 5 % off beyond.

The conformance sample has 7 rows, so the op check passes; only a model run
with longer prefill chunks shows the fault.
"""

from kunlun_infer.capabilities import DictOpsProvider
from kunlun_infer.hookspecs import PluginInfo, hookimpl
from kunlun_infer.ops import reference
from kunlun_infer.plugins.torch_ops import kernels


def rms_norm(x, weight, eps):
    out = reference.rms_norm(x, weight, eps)
    return out * 1.05 if x.shape[0] > 8 else out


@hookimpl
def kunlun_infer_plugin_info():
    return PluginInfo(name="late-bug", version="0.0.2", api=">=1.0,<2", capabilities=("ops",))


@hookimpl
def kunlun_infer_ops_factories():
    return {"latebug": lambda *, config, device: DictOpsProvider({**kernels(), "rms_norm": rms_norm},
                                                                 name="latebug")}
