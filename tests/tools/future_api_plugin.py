"""A test plugin written for hook API 2: this framework (API 1.x) must refuse it, naming it."""

from kunlun_infer.capabilities import DictOpsProvider
from kunlun_infer.hookspecs import PluginInfo, hookimpl


@hookimpl
def kunlun_infer_plugin_info():
    return PluginInfo(name="future-ops", version="3.0.0", api=">=2.0,<3", capabilities=("ops",))


@hookimpl
def kunlun_infer_ops_factories():
    return {"futureops": lambda *, config, device: DictOpsProvider({}, name="futureops")}
