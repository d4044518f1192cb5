"""The Hydra config tree: one small YAML per option.

This folder sits at the top level of the repository and is installed as the
package ``kunlun_infer.conf`` (``package-dir`` in ``pyproject.toml``), so a
checkout and a wheel compose the same tree. ``config.yaml`` picks the default
option of every group; each group folder holds one file per option;
``deploy/`` holds whole deployments (``deploy=cuda_tp``) to copy and edit.
Plugins add options of their own at run time (see
``kunlun_infer_config_options`` in :mod:`kunlun_infer.hookspecs`).
"""
