"""``hayabusa serve`` with no model serves the bundled demo model (saying so), whose small chat template makes
/v1/chat/completions work offline."""

from __future__ import annotations

from contextlib import contextmanager

import httpx
import pytest

from hayabusa.assets import demo_model_dir
from tests.helpers import start_server


@contextmanager
def serve_demo(*flags: str):
    """``hayabusa serve`` with no model (plus flags) in a subprocess; yields (base url, the log so far)."""
    pytest.importorskip("uvicorn")
    url, proc = start_server(["--max-model-len", "256", "--max-num-seqs", "8", "--disable-log-requests",
                              "--disable-uvicorn-access-log", *flags], env={"HF_HUB_OFFLINE": "1"},  # no network
                             timeout=90)
    try:
        yield url, proc
    finally:
        proc.terminate()
        log = proc.communicate(timeout=20)[0].decode()
        serve_demo.last_log = log


def test_serve_without_model_serves_the_demo_with_a_chat_template():
    with serve_demo() as (url, _):
        models = httpx.get(url + "/v1/models").json()["data"]
        assert [m["id"] for m in models] == ["stories260K"]
        r = httpx.post(url + "/v1/chat/completions", timeout=60, json={
            "model": "stories260K", "max_tokens": 12, "temperature": 0,
            "messages": [{"role": "system", "content": "Tell a story."},
                         {"role": "user", "content": "A story about a cat."}]})
        assert r.status_code == 200, r.text
        body = r.json()
        # the prompt is the template's rendering: <s> + system line + "User: ..." line + "Assistant:"
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(demo_model_dir())
        rendered = "<s>Tell a story.\nUser: A story about a cat.\nAssistant:"
        assert body["usage"]["prompt_tokens"] == len(tok(rendered, add_special_tokens=False).input_ids)
        assert body["usage"]["completion_tokens"] >= 1 and body["choices"][0]["message"]["content"]
    assert "no model given; serving the bundled demo model stories260K" in serve_demo.last_log
