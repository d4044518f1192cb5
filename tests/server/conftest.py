"""Fixtures: one tiny chat model, a server over it on a free loopback port, and the same model in-process."""

from __future__ import annotations

import pytest
import torch

import kunlun_infer as ki
from tests.chat_models import build_chat_model
from tests.engine.tiny_models import engine_overrides
from tests.server.harness import RunningServer, engine_for


@pytest.fixture(scope="package", autouse=True)
def one_thread():
    """Tiny matrices gain nothing from threads, and lose a lot when the cores are busy elsewhere."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="package")
def chat_folder(tmp_path_factory):
    return build_chat_model(tmp_path_factory.mktemp("server-model"))


@pytest.fixture(scope="package")
def server(chat_folder):
    """The shared server (default limits: 16 running sequences, queue of 256)."""
    engine = engine_for(chat_folder, scheduler__max_num_seqs=32)
    running = RunningServer(engine)
    yield running
    running.stop()
    engine.close()


@pytest.fixture(scope="package")
def llm(chat_folder):
    """The same model in-process, for comparing texts."""
    with ki.LLM(model=str(chat_folder), overrides=engine_overrides()) as llm:
        yield llm


@pytest.fixture
def client(server):
    import openai

    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60)
