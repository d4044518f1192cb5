"""A server for tests: uvicorn in a background thread on a free loopback port, over a tiny chat model."""

from __future__ import annotations

import socket
import threading
import time
from pathlib import Path

import httpx


class ServedApp:
    """An ASGI ``app`` served by uvicorn in a thread on a free loopback port; ``stop()`` shuts it down gracefully."""

    def __init__(self, app) -> None:
        import uvicorn

        self.app = app
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(256)
        self.port = self.sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", log_config=None,
                                                    timeout_graceful_shutdown=5))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("the test server did not start")
            time.sleep(0.02)

    def metrics(self) -> dict[str, float]:
        """``/metrics`` parsed into ``{sample name with labels: value}``."""
        text = httpx.get(f"{self.url}/metrics", timeout=30).text
        samples = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                name, value = line.rsplit(" ", 1)
                samples[name] = float(value)
        return samples

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)
        self.sock.close()


class RunningServer(ServedApp):
    """``build_app`` for ``engine``, served (see :class:`ServedApp`)."""

    def __init__(self, engine, *, model_name: str = "tiny-chat", max_queue: int = 256) -> None:
        from kunlun_infer.server import build_app

        self.engine = engine
        self.model_name = model_name
        super().__init__(build_app(engine, model_name=model_name, max_queue=max_queue))

    @property
    def loop(self):
        return self.app.state.server.loop


def engine_for(folder: Path, **keys):
    from kunlun_infer import LLMEngine, compose_config
    from tests.engine.tiny_models import engine_overrides

    return LLMEngine.from_config(compose_config(engine_overrides(model__path=str(folder), **keys)))


def fail_next_step(engine, monkeypatch, error: Exception) -> None:
    """The engine's next forward raises ``error``; the ones after it run as usual."""
    runner = engine.runner
    real_compute = runner.compute
    calls = []

    def compute_failing_once(inputs):
        calls.append(1)
        if len(calls) == 1:
            raise error
        return real_compute(inputs)

    monkeypatch.setattr(runner, "compute", compute_failing_once)
