"""The OpenAI-compatible HTTP server: FastAPI routes over one engine loop, run by uvicorn.

:func:`build_app` serves an existing engine (embed it in your own ASGI
stack); :func:`serve` composes everything from a config and runs until
interrupted. Needs the ``serve`` extra (``fastapi``, ``uvicorn``).
"""

from __future__ import annotations

from kunlun_infer.server.app import build_app
from kunlun_infer.server.runner import model_name_for, serve

__all__ = ["build_app", "model_name_for", "serve"]
