"""The Hydra config tree: one small YAML per option, shipped inside the wheel.

``config.yaml`` picks the default option of every group; each group folder
holds one file per option. Plugins add options of their own at run time
(see ``kunlun_infer_config_options`` in :mod:`kunlun_infer.hookspecs`).
"""
