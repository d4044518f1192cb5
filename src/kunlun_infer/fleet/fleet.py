"""``Fleet``: engine replicas as Ray actors behind one router, for embedding or behind the HTTP server.

``Fleet("cpu_simchip", overrides=[...])`` composes the config with
``fleet=cpu_simchip`` (``conf/fleet/``), joins or starts the Ray cluster,
starts one actor per replica — each composing its engine from the
overrides given here plus its own, on a node offering its resources — and
waits until every replica has generated a token. :meth:`Fleet.generate`
runs prompts through the router; :meth:`Fleet.app` is the OpenAI-compatible
server over the fleet (what ``kunlun-infer serve fleet=<name>`` runs).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kunlun_infer.engine.outputs import RequestOutput
from kunlun_infer.engine.params import SamplingParams
from kunlun_infer.errors import ConfigError
from kunlun_infer.fleet.cluster import RayCluster, actor_options
from kunlun_infer.fleet.dispatch import FleetLoop, ReplicaSpec
from kunlun_infer.fleet.front import FleetFront
from kunlun_infer.fleet.replica import ReplicaServer
from kunlun_infer.fleet.router import Policy
from kunlun_infer.llm import Prompts, _as_params_list, _as_prompt_list
from kunlun_infer.runtime import compose_config
from kunlun_infer.server.app import build_app
from kunlun_infer.server.engine_loop import ServerBusyError
from kunlun_infer.server.generation import Generation
from kunlun_infer.server.runner import bind, model_name_for, run_app

#: keys that belong to the fleet as a whole: a replica's overrides may not change them
SHARED_KEYS = ("model.path", "model.tokenizer")


def _is_fleet_override(override: str) -> bool:
    key = override.lstrip("+~").split("=", 1)[0]
    return key == "fleet" or key.startswith("fleet.")


def replica_plan(fleet: Any) -> dict[str, tuple[list[str], dict[str, float]]]:
    """``{replica name: (its overrides, its Ray resources)}``, a ``count`` expanded into ``name``, ``name-1`` …"""
    plan = {}
    for name, replica in fleet.replicas.items():
        count = int(replica.count)
        if count < 1:
            raise ConfigError(f"fleet.replicas.{name}.count={count} must be >= 1")
        overrides = [str(o) for o in replica.overrides]
        for override in overrides:
            if override.lstrip("+~").split("=", 1)[0] in SHARED_KEYS:
                raise ConfigError(f"fleet.replicas.{name}.overrides: {override!r} — every replica serves the "
                                  f"fleet's model; set {', '.join(SHARED_KEYS)} for the whole fleet instead")
            if _is_fleet_override(override):
                raise ConfigError(f"fleet.replicas.{name}.overrides: {override!r} — a replica is one engine; "
                                  f"fleet keys belong to the fleet")
        resources = {str(k): float(v) for k, v in replica.resources.items()}
        for key, amount in resources.items():
            if amount < 0:
                raise ConfigError(f"fleet.replicas.{name}.resources.{key}={amount:g} must be >= 0")
        for i in range(count):
            plan[name if i == 0 else f"{name}-{i}"] = (overrides, resources)
    return plan


class Fleet:
    """A fleet of engine replicas behind one router. ``with Fleet(...) as fleet:`` closes it on exit.

    :param fleet: the ``conf/fleet/`` option (``None``: the overrides choose, or set ``fleet.replicas``).
    :param overrides: Hydra overrides for the fleet and for every replica's engine (``model.path=…``,
        ``scheduler.max_num_seqs=…``); a replica's own overrides are applied after them.
    :param model: shorthand for ``model.path``.
    """

    def __init__(self, fleet: str | None = None, overrides: Sequence[str] = (), *, model: str | None = None) -> None:
        overrides = [str(o) for o in overrides]
        if fleet is not None:
            overrides.append(f"fleet={fleet}")
        if model is not None:
            overrides.append(f"model.path={model}")
        self.config = config = compose_config(overrides)
        if not config.fleet.replicas:
            raise ConfigError("no fleet to run: choose one with fleet=<name> (conf/fleet/: cpu_simchip, "
                              "gpu_kunlun, or a file of your own) or list fleet.replicas")
        plan = replica_plan(config.fleet)
        engine_overrides = [o for o in overrides if not _is_fleet_override(o)]
        path = config.model.path
        if path is not None and Path(str(path)).expanduser().exists():  # actors do not share this working directory
            engine_overrides.append(f"model.path={Path(str(path)).expanduser().resolve()}")
        self.cluster: RayCluster | None = None
        self.loop: FleetLoop | None = None
        self._handles: list[Any] = []
        try:
            self.cluster = cluster = RayCluster(config.fleet)
            cluster.check_resources({name: resources for name, (_, resources) in plan.items()})
            actor = cluster.ray.remote(ReplicaServer)
            max_restarts = int(config.fleet.max_restarts)
            specs = []
            for name, (own, resources) in plan.items():
                handle = actor.options(max_restarts=max_restarts, max_task_retries=0,
                                       **actor_options(resources)).remote(name, [*engine_overrides, *own])
                self._handles.append(handle)
                specs.append(ReplicaSpec(name, handle, max_restarts))
            self.loop = FleetLoop(specs, Policy.from_config(config.fleet),
                                  health_timeout_s=float(config.fleet.health_timeout_s),
                                  step_timeout_s=float(config.fleet.step_timeout_s),
                                  start_timeout_s=float(config.fleet.start_timeout_s),
                                  max_queue=int(config.server.max_queue))
            self.loop.start()
            self.loop.wait_joined(float(config.fleet.start_timeout_s))
            self.front = FleetFront(config, self.loop)
        except BaseException:
            self.close()
            raise

    @property
    def model_name(self) -> str:
        return model_name_for(self.config)

    def replicas(self) -> list[dict[str, Any]]:
        """Each replica: name, state (up, down, dead), pid, node, plugins, load, restarts, engine stats."""
        assert self.loop is not None
        return self.loop.replica_states()

    def generate(self, prompts: Prompts, params: SamplingParams | Sequence[SamplingParams] | None = None
                 ) -> list[RequestOutput]:
        """Generate for every prompt through the router; final outputs in prompt order (``n`` samples in a row).

        Every request is checked before any is sent. While the fleet is full
        the rest wait their turn.
        """
        prompt_list = _as_prompt_list(prompts)
        params_list = _as_params_list(params, len(prompt_list))
        requests = [self.front.prepare_request(p, sp) for p, sp in zip(prompt_list, params_list)]

        async def run() -> list[RequestOutput]:
            generations = [Generation(self.loop, [request], streamed=False) for request in requests]
            drains = []
            try:
                for generation in generations:
                    while True:
                        try:
                            generation.start()
                            break
                        except ServerBusyError:
                            await asyncio.sleep(0.05)
                    drains.append(asyncio.ensure_future(_drain(generation)))
                await asyncio.gather(*drains)
            finally:
                for generation in generations:
                    generation.abort_unfinished()
            return [o for g in generations for _, o in sorted(g.finals.items())]

        return asyncio.run(run())

    def app(self) -> Any:
        """The OpenAI-compatible FastAPI app over this fleet (the fleet stays open when the app stops)."""
        return build_app(self.front, model_name=self.model_name, max_queue=int(self.config.server.max_queue),
                         loop=self.loop)

    def close(self) -> None:
        """Stop routing, close every replica's engine and actor, and a Ray cluster the fleet started. Idempotent."""
        if self.loop is not None:
            self.loop.shutdown()
            self.loop = None
        cluster, handles, self._handles = self.cluster, self._handles, []
        if cluster is not None:
            ray = cluster.ray
            closing = [h.close.remote() for h in handles]
            try:
                ray.wait(closing, num_returns=len(closing), timeout=30)
            except Exception:  # noqa: BLE001 - the actors are killed next anyway
                pass
            for handle in handles:
                try:
                    ray.kill(handle, no_restart=True)
                except Exception:  # noqa: BLE001 - already gone
                    pass
            cluster.close()
            self.cluster = None

    def __enter__(self) -> Fleet:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


async def _drain(generation: Generation) -> None:
    async for _ in generation.outputs():
        pass


def serve_fleet(overrides: Sequence[str], *, on_ready: Any = None) -> None:
    """``kunlun-infer serve fleet=<name>``: start the fleet, serve it on ``server.host:server.port`` until
    interrupted, then close it."""
    config = compose_config(list(overrides))
    sock = bind(str(config.server.host), int(config.server.port))
    try:
        fleet = Fleet(overrides=overrides)
    except BaseException:
        sock.close()
        raise
    with fleet:
        run_app(fleet.app(), sock, fleet.model_name, on_ready=on_ready)
