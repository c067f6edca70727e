"""Servers for the OpenAI-API tests: real uvicorn on 127.0.0.1 (a free port), one per checkpoint, shared by the
tests of a session. Traffic stays on the loopback interface."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from tests.conftest import TOKENIZERS

API_KEY = "test-key"


def pytest_configure(config):
    config.addinivalue_line("markers", "soak: a minute of load on a real server (runs in CI; "
                                       "HAYABUSA_SOAK_SECONDS shortens it locally)")
QWEN_TEMPLATE = TOKENIZERS / "qwen3" / "qwen2.5-instruct-chat-template.jinja"


def wait_idle(engine, timeout: float = 15.0) -> dict:
    """Wait until the engine runs nothing and every KV block is free; returns its stats."""
    deadline = time.monotonic() + timeout
    stats = engine.get_stats()
    while time.monotonic() < deadline:
        stats = engine.get_stats()
        if (stats["num_requests_running"] == 0 and stats["num_requests_waiting"] == 0
                and stats["num_free_kv_blocks"] == stats["num_kv_blocks"]):
            return stats
        time.sleep(0.02)
    raise AssertionError(f"the engine did not go idle with an empty KV cache: {stats}")


@pytest.fixture(scope="module")
def engine(stories_dir):
    """An AsyncLLMEngine on stories260K (CPU), one per test module."""
    from hayabusa import AsyncEngineArgs, AsyncLLMEngine

    eng = AsyncLLMEngine.from_engine_args(AsyncEngineArgs(model=stories_dir, disable_log_requests=True,
                                                          max_model_len=512, max_num_seqs=16))
    yield eng
    eng.shutdown()


class Served:
    def __init__(self, model_dir: str, name: str, api_key: str | None = None, chat_template: str | None = None,
                 app_kwargs: dict | None = None, shutdown_timeout: float = 2.0, **engine_kwargs) -> None:
        pytest.importorskip("fastapi")
        from hayabusa.engine.async_llm_engine import AsyncEngineArgs, AsyncLLMEngine
        from hayabusa.entrypoints.openai.server import ServerThread, build_app

        self.name, self.api_key, self.model_dir = name, api_key, model_dir
        self.engine = AsyncLLMEngine.from_engine_args(
            AsyncEngineArgs(model=model_dir, disable_log_requests=True, **engine_kwargs))
        self.tokenizer = self.engine.engine.tokenizer
        self.app = build_app(self.engine, [name], api_key=api_key, chat_template=chat_template, model_path=model_dir,
                             **(app_kwargs or {}))
        self.server = ServerThread(self.app, shutdown_timeout=shutdown_timeout).start()
        self.url = self.server.url

    def client(self, **kw):
        import openai

        return openai.OpenAI(base_url=self.url + "/v1", api_key=self.api_key or "none", max_retries=0, **kw)

    def async_client(self, **kw):
        import openai

        return openai.AsyncOpenAI(base_url=self.url + "/v1", api_key=self.api_key or "none", max_retries=0, **kw)

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def close(self) -> None:
        self.server.stop()
        self.engine.shutdown()


@pytest.fixture(scope="session")
def qwen_server(tiny_qwen2):
    """Tiny random Qwen2 with the Qwen2.5 BPE tokenizer and its own chat template; --api-key set."""
    s = Served(tiny_qwen2, "tiny-qwen", api_key=API_KEY, max_model_len=256)
    yield s
    s.close()


@pytest.fixture(scope="session")
def llama_server(tiny_llama):
    """Tiny random Llama with the Japanese llm-jp SentencePiece tokenizer (byte fallback; no chat template of its
    own), given the Qwen2.5 template as --chat-template; no API key; --trust-request-chat-template."""
    from hayabusa.entrypoints.chat_utils import load_chat_template

    s = Served(tiny_llama, "tiny-llama", chat_template=load_chat_template(str(QWEN_TEMPLATE)), max_model_len=256,
               app_kwargs={"trust_request_chat_template": True})
    yield s
    s.close()


def repo_root() -> Path:
    return Path(__file__).resolve().parents[2]
