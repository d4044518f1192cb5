"""A test ops plugin ``wrongops``: the torch kernels, except an rms_norm that forgets its weight."""

from kunlun_infer.capabilities import DictOpsProvider
from kunlun_infer.hookspecs import PluginInfo, hookimpl
from kunlun_infer.ops import reference
from kunlun_infer.plugins.torch_ops import kernels


def rms_norm(x, weight, eps):
    return reference.rms_norm(x, weight.new_ones(weight.shape), eps)


@hookimpl
def kunlun_infer_plugin_info():
    return PluginInfo(name="wrong-ops", version="0.0.1", api=">=1.0,<2", capabilities=("ops",))


@hookimpl
def kunlun_infer_ops_factories():
    return {"wrongops": lambda *, config, device: DictOpsProvider({**kernels(), "rms_norm": rms_norm},
                                                                  name="wrongops")}
