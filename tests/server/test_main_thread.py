"""``kunlun-infer serve`` steps its engine on the process's main thread, with uvicorn in a thread of its own, and
stops on SIGINT/SIGTERM as before (``server.runner.run_app`` with the app's engine loop)."""

import signal
import socket
import threading
import time

import httpx
import pytest

from kunlun_infer import SamplingParams
from kunlun_infer.errors import KunlunInferError

from kunlun_infer.server import build_app
from kunlun_infer.server.runner import run_app
from tests.server.harness import engine_for


def _app_on_a_socket(engine, on_step):
    """An app over ``engine`` whose loop steps in the thread that runs it (``on_step()`` before each step), and a
    bound loopback socket for it."""
    step = engine.step

    def watched_step():
        on_step()
        return step()

    engine.step = watched_step
    app = build_app(engine, model_name="tiny-chat", close_engine=True, engine_thread=False)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(16)
    return app, sock


def test_serve_steps_on_the_main_thread_and_stops_on_sigterm(chat_folder):
    assert threading.current_thread() is threading.main_thread()  # as `kunlun-infer serve` runs it
    engine = engine_for(chat_folder)
    stepped_in: set[str] = set()
    app, sock = _app_on_a_socket(engine, lambda: stepped_in.add(threading.current_thread().name))
    ready, answers = threading.Event(), []
    before = signal.getsignal(signal.SIGTERM)

    def client():
        ready.wait(60)
        try:
            answers.append(httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=60,
                                      json={"model": "tiny-chat", "prompt": "hi", "max_tokens": 3}))
        finally:
            signal.pthread_kill(threading.main_thread().ident, signal.SIGTERM)

    port = sock.getsockname()[1]
    helper = threading.Thread(target=client)
    helper.start()
    run_app(app, sock, "tiny-chat", on_ready=lambda *_: ready.set(), engine_loop=app.state.server.loop)
    helper.join(60)
    assert answers and answers[0].status_code == 200, answers
    assert len(answers[0].json()["choices"][0]["text"]) > 0
    assert stepped_in == {threading.main_thread().name}
    assert signal.getsignal(signal.SIGTERM) is before  # the server's handlers are gone with it
    assert sock.fileno() == -1  # the socket closed, and the engine with the app's lifespan:
    with pytest.raises(KunlunInferError, match="closed"):
        engine.add_request("hi", SamplingParams(max_tokens=1))


def test_a_second_signal_stops_at_once_with_a_request_running(chat_folder):
    # uvicorn's forced exit skips the app's lifespan shutdown: the engine loop on the main thread must stop anyway
    engine = engine_for(chat_folder)
    steps = threading.Semaphore(0)

    def counting_step():
        steps.release()
        time.sleep(0.02)  # a request of 400 tokens takes 8 s: longer than the test waits for it

    app, sock = _app_on_a_socket(engine, counting_step)
    port, ready, outcome = sock.getsockname()[1], threading.Event(), []

    def long_request():
        ready.wait(60)
        try:
            outcome.append(httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=120, json={
                "model": "tiny-chat", "prompt": "hi", "max_tokens": 400, "ignore_eos": True}).status_code)
        except httpx.HTTPError as exc:
            outcome.append(type(exc).__name__)

    def stopper():
        for _ in range(5):  # the request is being generated
            steps.acquire(timeout=60)
        signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)  # a graceful stop would wait for it
        time.sleep(0.5)
        signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)  # the second: at once

    helpers = [threading.Thread(target=long_request), threading.Thread(target=stopper)]
    for helper in helpers:
        helper.start()
    run_app(app, sock, "tiny-chat", on_ready=lambda *_: ready.set(), engine_loop=app.state.server.loop)
    for helper in helpers:
        helper.join(60)
    assert outcome and outcome[0] != 200, outcome  # cut off, not served to the end
    assert steps._value < 400 and not app.state.server.loop.alive
