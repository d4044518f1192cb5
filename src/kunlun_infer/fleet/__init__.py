"""Fleets: engine replicas as Ray actors, on mixed hardware, behind one OpenAI-compatible endpoint.

``kunlun-infer serve fleet=<name>`` or ``kunlun_infer.Fleet`` (needs the
``cluster`` extra: Ray, and the server's FastAPI and uvicorn). A fleet is a
``conf/fleet/`` option listing replicas, each with its own config overrides
and the Ray resources it reserves. Rooms: ``fleet`` (the public class),
``cluster`` (joining or starting Ray), ``replica`` (the actor), ``router``
(where a request goes), ``dispatch`` (requests out, outputs back, faults),
``front`` (request checks for every replica at once).
"""

from kunlun_infer.fleet.fleet import Fleet, replica_plan, serve_fleet

__all__ = ["Fleet", "replica_plan", "serve_fleet"]
