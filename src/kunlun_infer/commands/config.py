"""``kunlun-infer config [overrides…]``: print the composed config as YAML (or ``--json``)."""

from __future__ import annotations

import json

from omegaconf import OmegaConf

from kunlun_infer.commands.base import Command, Flag, Invocation


def run(inv: Invocation) -> int:
    cfg = inv.config()
    if inv.flags["json"]:
        inv.print(json.dumps(OmegaConf.to_container(cfg, resolve=True), indent=2))
    else:
        inv.print(OmegaConf.to_yaml(cfg, resolve=True), end="")
    return 0


COMMAND = Command(
    name="config",
    summary="Print the config composed from conf/, the plugins' options and the overrides given.",
    run=run,
    flags=(Flag("json", "print JSON instead of YAML"),),
)
