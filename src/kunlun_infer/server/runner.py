"""Run the server: build the engine from a config, bind ``server.host:server.port``, stop gracefully.

On SIGINT/SIGTERM uvicorn stops accepting connections and gives running
requests up to :data:`GRACEFUL_SHUTDOWN_S` to finish; then the engine loop
aborts what is left and the engine is closed (KV cache, device, workers).

The engine steps on the process's main thread, and uvicorn's event loop
runs in a thread of its own. The main thread is where the host's runtime
libraries do best: libgomp counts the process's first thread among the
threads it manages, so a second thread that runs parallel regions (each
native kernel is one) makes it think there are more threads than CPUs, and
its workers then sleep between regions instead of spinning for the next;
and glibc's main arena keeps the large blocks a step frees, where another
thread's arena maps each block over 64 MiB afresh (``plugins/cpu_memory.py``).
The 0.5B model in bf16, a decode step stepped in a thread against the main
thread: 1.2x the time at one sequence, 1.3x at 32.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import socket
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from kunlun_infer.config import check_ranges
from kunlun_infer.engine import heap
from kunlun_infer.engine.engine import LLMEngine
from kunlun_infer.errors import ConfigError
from kunlun_infer.server.app import build_app

log = logging.getLogger("kunlun_infer.framework")

GRACEFUL_SHUTDOWN_S = 30


def model_name_for(config: DictConfig) -> str:
    """``server.model_name``, else the model folder's name (``default`` for the embedded model)."""
    if config.server.model_name:
        return str(config.server.model_name)
    return Path(str(config.model.path)).name if config.model.path else "default"


def bind(host: str, port: int) -> socket.socket:
    """A listening socket on ``host:port``; :class:`ConfigError` naming the keys when that fails."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise ConfigError(f"cannot listen on server.host={host} server.port={port}: {exc.strerror}; "
                          f"pick another port (server.port=…)") from None
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def serve(config: DictConfig, *, on_ready: Any = None) -> None:
    """Build the engine for ``config`` and serve it until interrupted. ``on_ready(host, port)`` once bound."""
    check_ranges(config)
    sock = bind(str(config.server.host), int(config.server.port))
    try:
        engine = LLMEngine.from_config(config)
    except BaseException:
        sock.close()
        raise
    app = build_app(engine, model_name=model_name_for(config), max_queue=int(config.server.max_queue),
                    close_engine=True, engine_thread=False)
    try:
        with heap.held():  # start-up's objects are left out of the collections while it serves
            run_app(app, sock, model_name_for(config), on_ready=on_ready, engine_loop=app.state.server.loop)
    finally:
        engine.close()  # idempotent; the app's lifespan closed it unless start-up was interrupted


def run_app(app: Any, sock: socket.socket, model_name: str, *, on_ready: Any = None, engine_loop: Any = None) -> None:
    """Serve ``app`` with uvicorn on the bound ``sock`` until SIGINT/SIGTERM; the socket is closed after.

    ``engine_loop``: the app's :class:`EngineLoop` made with ``thread=False``, stepped in the calling thread
    (see the top) while uvicorn runs in a thread of its own; without it uvicorn runs in the calling thread.
    """
    import uvicorn

    host, port = sock.getsockname()[:2]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S,
                                           log_config=None))
    log.info("serving %s on http://%s:%d", model_name, host, port)
    try:
        if engine_loop is None:
            if on_ready is not None:
                on_ready(host, port)
            # uvicorn re-raises SIGINT/SIGTERM after its graceful shutdown: a stop asked for is a clean exit
            with _on_stop_signals(lambda *_: None):
                server.run(sockets=[sock])
            return
        failed: list[BaseException] = []

        def run_http() -> None:
            try:
                server.run(sockets=[sock])
            except BaseException as exc:  # noqa: BLE001 - raised again in the calling thread
                failed.append(exc)
            finally:  # a forced exit skips the lifespan's shutdown: the engine loop stops here then
                engine_loop.shutdown(timeout_s=0)

        http = threading.Thread(target=run_http, name="kunlun-infer-http", daemon=True)
        with _on_stop_signals(_stopper(server)):
            http.start()
            if on_ready is not None:
                on_ready(host, port)
            engine_loop.run_here(http.is_alive)  # until the loop is shut down
            while http.is_alive():  # uvicorn finishing its shutdown (or serving on after the engine failed)
                http.join(0.2)
        if failed:
            raise failed[0]
    finally:
        sock.close()


def _stopper(server: Any) -> Any:
    """A handler with which SIGINT/SIGTERM stop ``server`` (uvicorn in another thread, which cannot take signals)
    as it would stop itself: the first gracefully, another at once."""

    def stop(*_: Any) -> None:
        if server.should_exit:
            server.force_exit = True
        server.should_exit = True

    return stop


@contextlib.contextmanager
def _on_stop_signals(handler: Any) -> Iterator[None]:
    """SIGINT/SIGTERM go to ``handler`` while the block runs, where the calling thread is the main one (only it
    takes signals); the handlers before are put back after."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    stops = (signal.SIGINT, signal.SIGTERM)
    previous = {sig: signal.signal(sig, handler) for sig in stops}
    try:
        yield
    finally:
        for sig, before in previous.items():
            signal.signal(sig, before)
