"""``kunlun-infer serve [overrides…]``: the OpenAI-compatible HTTP server.

Binds ``server.host`` (127.0.0.1 unless told otherwise) and ``server.port``;
under ``torchrun`` rank 0 runs the engine and the server, the other ranks
serve its forwards until it closes;
``server.max_queue`` bounds the requests that may wait for a batch slot and
``server.model_name`` names the model in the API. Stops gracefully on
Ctrl-C or SIGTERM.
"""

from __future__ import annotations

from kunlun_infer.commands.base import Command, Invocation
from kunlun_infer.engine.parallel.worker import serve_torchrun_worker
from kunlun_infer.errors import KunlunInferError


def run(inv: Invocation) -> int:
    try:
        import fastapi  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as exc:
        raise KunlunInferError(f"serve needs fastapi and uvicorn ({exc.name} is missing): "
                               f"pip install 'kunlun-infer[serve]'") from None
    from kunlun_infer.server import model_name_for, serve

    cfg = inv.config()
    if cfg.fleet.replicas:  # replicas on Ray behind this endpoint
        from kunlun_infer.fleet import serve_fleet

        def fleet_ready(host: str, port: int) -> None:
            shown = f"[{host}]" if ":" in host else host
            inv.print(f"serving '{model_name_for(cfg)}' from {len(cfg.fleet.replicas)} replica group(s) of fleet "
                      f"'{cfg.fleet.name}' on http://{shown}:{port}  (OpenAI API under /v1; /health, /metrics "
                      f"per replica; Ctrl-C to stop)", flush=True)

        serve_fleet(inv.overrides, on_ready=fleet_ready)
        return 0
    if serve_torchrun_worker(cfg):  # under torchrun, ranks above 0 serve rank 0's engine until it closes
        return 0

    def ready(host: str, port: int) -> None:
        shown = f"[{host}]" if ":" in host else host
        inv.print(f"serving '{model_name_for(cfg)}' on http://{shown}:{port}  (OpenAI API under /v1; "
                  f"/health, /metrics; Ctrl-C to stop)", flush=True)

    serve(cfg, on_ready=ready)
    return 0


COMMAND = Command(
    name="serve",
    summary="Serve the model over an OpenAI-compatible HTTP API (completions, chat, streaming, metrics).",
    run=run,
    description="""
Endpoints: POST /v1/completions, POST /v1/chat/completions (stream=true for
server-sent events), GET /v1/models, GET /health, GET /metrics (Prometheus).
Examples:
  kunlun-infer serve
  kunlun-infer serve model.path=/models/qwen2 server.port=9000 server.max_queue=64
  kunlun-infer serve fleet=cpu_simchip          # replicas on Ray behind one endpoint (conf/fleet/)
  torchrun --nproc-per-node 2 -m kunlun_infer serve model.path=/models/qwen2 comm=gloo
""",
)
