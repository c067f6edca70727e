"""A hostile client against a real server on 127.0.0.1 (issue #14): slow request templates, huge and chunked bodies,
foreign Content-Types, Hosts and Origins, bodies that used to give 500s (lone surrogates, deep nesting, huge
integers, Infinity), log injection, and shutdown with streams open. Each case asserts the status and the named
parameter, that a stream in flight meanwhile finishes correctly, and that the engine serves the next request."""

from __future__ import annotations

import gc
import json
import logging
import socket
import threading
import time

import pytest

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from tests.entrypoints.conftest import Served, wait_idle  # noqa: E402

STREAM_TOKENS = 48


@pytest.fixture(scope="module")
def server(tiny_qwen2):
    """No API key, request chat templates trusted (1 s limit), loopback Host names only."""
    s = Served(tiny_qwen2, "tiny-qwen", max_model_len=256, app_kwargs={"trust_request_chat_template": True})
    s.app.state.serving.request_chat_template_time_limit = 1.0
    yield s
    s.close()


# ------------------------------------------------------------------------------------------------ helpers
class RawConnection:
    """One keep-alive HTTP/1.1 connection, byte for byte (what httpx will not send, and proof that the server keeps
    the connection open after an error)."""

    def __init__(self, url: str, timeout: float = 30.0) -> None:
        host, port = url.removeprefix("http://").split(":")
        self.host = f"{host}:{port}"
        self.sock = socket.create_connection((host, int(port)), timeout=timeout)
        self.rfile = self.sock.makefile("rb")

    def send(self, method: str, path: str, body: bytes = b"", headers: dict[str, str] | None = None) -> None:
        h = {"Host": self.host, "Content-Type": "application/json", "Content-Length": str(len(body)),
             **(headers or {})}
        head = f"{method} {path} HTTP/1.1\r\n" + "".join(f"{k}: {v}\r\n" for k, v in h.items() if v is not None)
        self.sock.sendall(head.encode("latin-1") + b"\r\n" + body)

    def response(self) -> tuple[int, dict[str, str], bytes]:
        status = int(self.rfile.readline().split()[1])
        headers = {}
        while (line := self.rfile.readline().rstrip(b"\r\n")):
            k, v = line.decode("latin-1").split(":", 1)
            headers[k.strip().lower()] = v.strip()
        body = self.rfile.read(int(headers.get("content-length", 0)))
        return status, headers, body

    def request(self, method: str, path: str, body: bytes = b"", headers: dict[str, str] | None = None):
        self.send(method, path, body, headers)
        return self.response()

    def close(self) -> None:
        self.rfile.close()
        self.sock.close()


def ok_completion_body(name: str) -> bytes:
    return json.dumps({"model": name, "prompt": "Once upon a time", "max_tokens": 3, "temperature": 0}).encode()


class StreamInFlight:
    """A greedy streamed completion running in a thread while the test attacks the server; ``check()`` asserts it
    got all of its tokens, in order, with [DONE]."""

    def __init__(self, s: Served, max_tokens: int = STREAM_TOKENS) -> None:
        self.s, self.max_tokens = s, max_tokens
        self.events: list[str] = []
        self.error: BaseException | None = None
        self.started = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()
        assert self.started.wait(30)

    def _run(self) -> None:
        body = {"model": self.s.name, "prompt": "Once upon a time", "max_tokens": self.max_tokens,
                "temperature": 0, "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
        try:
            with httpx.stream("POST", self.s.url + "/v1/completions", json=body, headers=self.s.headers(),
                              timeout=60) as r:
                for line in r.iter_lines():
                    if line:
                        self.events.append(line)
                        self.started.set()
        except BaseException as e:  # noqa: BLE001 -- reported by check()
            self.error = e
        finally:
            self.started.set()

    def check(self) -> None:
        self.thread.join(60)
        assert self.error is None and not self.thread.is_alive(), self.error
        assert self.events[-1] == "data: [DONE]"
        chunks = [json.loads(e[6:]) for e in self.events[:-1]]
        assert all("error" not in c for c in chunks)
        usage = [c["usage"] for c in chunks if c.get("usage")]
        assert usage and usage[-1]["completion_tokens"] == self.max_tokens
        assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == "length"


class HealthProbe:
    """Polls /health from a thread; ``worst`` is the slowest answer (seconds)."""

    def __init__(self, url: str) -> None:
        self.url, self.worst, self.count, self.failures = url, 0.0, 0, 0
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        with httpx.Client(timeout=10) as c:
            deadline = time.monotonic() + 120
            while not self.stop.is_set() and time.monotonic() < deadline:
                t0 = time.monotonic()
                try:
                    ok = c.get(self.url + "/health").status_code == 200
                except httpx.HTTPError:
                    ok = False
                self.worst = max(self.worst, time.monotonic() - t0)
                self.count += 1
                self.failures += not ok
                time.sleep(0.02)

    def finish(self) -> "HealthProbe":
        self.stop.set()
        self.thread.join(20)
        return self


def serves_next_request(s: Served) -> None:
    r = httpx.post(s.url + "/v1/completions", content=ok_completion_body(s.name), headers={
        **s.headers(), "Content-Type": "application/json"}, timeout=60)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3, r.text
    wait_idle(s.engine)


# ------------------------------------------------------------------------------------------------ 2: templates
SLOW_TEMPLATE = ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
                 "{{ messages[0]['content'] }}")


def test_slow_request_template_is_cut_off_without_stalling_others(server):
    stream = StreamInFlight(server, max_tokens=STREAM_TOKENS)
    probe = HealthProbe(server.url)
    t0 = time.monotonic()
    r = httpx.post(server.url + "/v1/chat/completions", timeout=60, json={
        "model": server.name, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
        "chat_template": SLOW_TEMPLATE})
    elapsed = time.monotonic() - t0
    probe.finish()
    assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template", r.text
    assert "took longer than 1 s" in r.json()["error"]["message"] and elapsed < 10
    assert probe.count >= 3 and probe.worst < 1.0 and probe.failures == 0
    stream.check()
    deadline = time.monotonic() + 10                       # the rendering thread was stopped, not left spinning
    while any(t.name == "hayabusa-template" for t in threading.enumerate()) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(t.name == "hayabusa-template" for t in threading.enumerate())
    serves_next_request(server)


# ------------------------------------------------------------------------------------------------ 3: sizes
def test_64_mb_body_is_413_before_it_is_read(server):
    conn = RawConnection(server.url)
    try:
        t0 = time.monotonic()
        conn.send("POST", "/v1/completions", headers={"Content-Length": str(64 * 1024 * 1024)})
        status, _, body = conn.response()                   # not one byte of the body was sent
        assert status == 413 and json.loads(body)["error"]["code"] == "request_too_large"
        assert time.monotonic() - t0 < 5
    finally:
        conn.close()
    serves_next_request(server)


def test_chunked_body_over_the_limit_is_413_while_reading(server):
    limit = 32 * 1024 * 1024
    conn = RawConnection(server.url)
    try:
        conn.send("POST", "/v1/completions", headers={"Content-Length": None, "Transfer-Encoding": "chunked"})
        piece = b"x" * (1024 * 1024)
        sent = 0
        while sent <= limit:                                # exactly one byte over, then no terminating chunk
            data = piece if sent + len(piece) <= limit else b"x" * (limit + 1 - sent)
            conn.sock.sendall(f"{len(data):x}\r\n".encode() + data + b"\r\n")
            sent += len(data)
        status, _, body = conn.response()
        assert status == 413 and json.loads(body)["error"]["code"] == "request_too_large"
    finally:
        conn.close()
    serves_next_request(server)


def test_17_mb_prompt_is_400_while_health_and_streams_go_on(server):
    stream = StreamInFlight(server)
    probe = HealthProbe(server.url)
    for key, body in (("prompt", {"prompt": "a " * (17 * 1024 * 1024 // 2)}),
                      ("messages", {"messages": [{"role": "user", "content": "a " * (9 * 1024 * 1024 // 2)}]})):
        path = "/v1/completions" if key == "prompt" else "/v1/chat/completions"
        r = httpx.post(server.url + path, json={"model": server.name, "max_tokens": 2, **body}, timeout=60)
        assert r.status_code == 400, r.text[:300]
        assert r.json()["error"]["param"] == key and r.json()["error"]["code"] == "context_length_exceeded"
    probe.finish()
    assert probe.count >= 3 and probe.worst < 1.0 and probe.failures == 0
    stream.check()
    serves_next_request(server)


def test_rendered_chat_over_the_bound_is_400_before_tokenizing(server):
    """Short messages, but tools that the template writes into the prompt: the rendered text is bounded too."""
    tools = [{"type": "function", "function": {"name": "f", "description": "a " * 40_000, "parameters": {}}}]
    r = httpx.post(server.url + "/v1/chat/completions", timeout=60, json={
        "model": server.name, "messages": [{"role": "user", "content": "hi"}], "tools": tools, "max_tokens": 2})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages", r.text[:300]
    assert r.json()["error"]["code"] == "context_length_exceeded"
    serves_next_request(server)


def test_long_prompt_is_tokenized_off_the_event_loop(server):
    """truncate_prompt_tokens lifts the character bound: 1M characters are tokenized (seconds of CPU) on the
    preprocessing threads while /health answers."""
    probe = HealthProbe(server.url)
    r = httpx.post(server.url + "/v1/completions", timeout=120, json={
        "model": server.name, "prompt": "a " * 500_000, "max_tokens": 2, "truncate_prompt_tokens": 8})
    probe.finish()
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == 8, r.text
    assert probe.count >= 3 and probe.worst < 1.0 and probe.failures == 0
    serves_next_request(server)


# ------------------------------------------------------------------------------------------------ 4: browsers
@pytest.mark.parametrize("ctype,status", [("text/plain", 415), ("application/x-www-form-urlencoded", 415),
                                          ("multipart/form-data; boundary=x", 415), (None, 415),
                                          ("application/json; charset=utf-8", 200),
                                          ("application/json; charset=UTF-8", 200),
                                          ("application/json; charset=utf-16", 415),
                                          ("application/json; charset=latin-1", 415),
                                          ("application/vnd.api+json", 200)])
def test_only_json_bodies_are_accepted(server, ctype, status):
    conn = RawConnection(server.url)
    try:
        got, _, body = conn.request("POST", "/v1/completions", ok_completion_body(server.name),
                                    headers={"Content-Type": ctype})
        assert got == status, body
        if status == 415:
            assert json.loads(body)["error"]["code"] == "unsupported_media_type"
        got, _, _ = conn.request("GET", "/health")              # same connection, still open
        assert got == 200
    finally:
        conn.close()


@pytest.mark.parametrize("host,status", [("evil.example", 400), ("evil.example:8000", 400), ("127.0.0.2.nip.io", 400),
                                         ("localhost:1234", 200), ("127.0.0.1", 200), ("[::1]:8000", 200)])
def test_host_header_is_checked_on_loopback(server, host, status):
    conn = RawConnection(server.url)
    try:
        got, _, body = conn.request("POST", "/v1/completions", ok_completion_body(server.name), headers={"Host": host})
        assert got == status, body
        if status == 400:
            assert json.loads(body)["error"]["code"] == "invalid_host"
    finally:
        conn.close()


def test_foreign_origin_is_403_and_cors_is_off(server):
    body = ok_completion_body(server.name)
    conn = RawConnection(server.url)
    try:
        status, headers, raw = conn.request("POST", "/v1/completions", body, headers={"Origin": "http://evil.example"})
        assert status == 403 and json.loads(raw)["error"]["code"] == "invalid_origin"
        status, headers, _ = conn.request("POST", "/v1/completions", body, headers={"Origin": server.url})
        assert status == 200 and "access-control-allow-origin" not in headers      # same origin: fine, no CORS
        status, headers, _ = conn.request("OPTIONS", "/v1/completions", headers={
            "Origin": "http://evil.example", "Access-Control-Request-Method": "POST"})
        assert status == 403 and "access-control-allow-origin" not in headers
    finally:
        conn.close()


def test_allowed_origins_and_hosts_and_public_metrics(server):
    """A second app over the same engine: --allowed-origins turns CORS on for them, --allowed-hosts adds names,
    --public-docs-and-metrics opens /metrics and the docs despite --api-key."""
    from hayabusa.entrypoints.openai.server import ServerThread, build_app

    app = build_app(server.engine, ["tiny-qwen"], api_key="k", allowed_origins=["https://app.example"],
                    allowed_hosts=["localhost", "127.0.0.1", "::1", "api.example"], public_docs_and_metrics=True)
    with ServerThread(app) as t:
        conn = RawConnection(t.url)
        try:
            status, headers, _ = conn.request("OPTIONS", "/v1/completions", headers={
                "Origin": "https://app.example", "Access-Control-Request-Method": "POST",
                "Access-Control-Request-Headers": "authorization, content-type"})
            assert status == 200 and headers["access-control-allow-origin"] == "https://app.example"
            status, _, _ = conn.request("GET", "/metrics", headers={"Host": "api.example"})
            assert status == 200
            status, _, _ = conn.request("GET", "/openapi.json")
            assert status == 200
            status, _, _ = conn.request("GET", "/v1/models")
            assert status == 401                                       # the API itself still needs the key
        finally:
            conn.close()


# ------------------------------------------------------------------------------------------------ 5: 400s, not 500s
def _body(**fields) -> bytes:
    return json.dumps(fields).encode()     # ensure_ascii: a lone surrogate goes out as the escape "\ud800"


NESTED = b'{"prompt": "hi", "model": "tiny-qwen", "max_tokens": 2, "stop": ' + b"[" * 3000 + b"]" * 3000 + b"}"
BAD_BODIES = [
    ("/v1/completions", _body(model="tiny-qwen", prompt="ab\ud800cd", max_tokens=2), "prompt"),
    ("/v1/completions", _body(model="tiny-qwen", prompt=["ok", "\udfff"], max_tokens=2), "prompt"),
    ("/v1/chat/completions", _body(model="tiny-qwen", messages=[{"role": "user", "content": "x\ud800"}]),
     "messages"),
    ("/v1/chat/completions", _body(model="tiny-qwen", messages=[{"role": "user", "content": [
        {"type": "text", "text": "\ud83d"}]}]), "messages"),
    ("/v1/completions", _body(model="tiny-qwen\ud800", prompt="hi", max_tokens=2), "model"),
    ("/v1/completions", _body(model="tiny-qwen", prompt="hi", request_id="id-\ud800", max_tokens=2), "request_id"),
    ("/v1/completions", _body(model="tiny-qwen", prompt="hi", request_id="id-\ud800", max_tokens=2, stream=True),
     "request_id"),
    ("/v1/completions", _body(model="tiny-qwen", prompt="hi", max_tokens=2, stream=True, stop=["\ud800"]), "stop"),
    ("/v1/completions", NESTED, None),
    ("/v1/completions", b'{"model": "tiny-qwen", "prompt": "hi", "seed": ' + b"9" * 5000 + b"}", None),
    ("/v1/completions", _body(model="tiny-qwen", prompt="hi", seed=10 ** 30), "seed"),
    ("/v1/completions", b'{"model": "tiny-qwen", "prompt": "hi", "temperature": Infinity}', "temperature"),
    ("/v1/completions", b'{"model": "tiny-qwen", "prompt": "hi", "repetition_penalty": 1e999}', "repetition_penalty"),
    ("/v1/completions", b'{"model": "tiny-qwen", "prompt": "hi", "top_p": NaN}', "top_p"),
    ("/v1/chat/completions", b'{"model": "tiny-qwen", "messages": [], "temperature": -Infinity}', "temperature"),
    ("/v1/completions", b'{"model": "tiny-qwen", "prompt": "hi", "logit_bias": {"\\ud800": 1}}', "logit_bias"),
    ("/v1/completions", b'{"model": "tiny-qwen", "prompt": "x", "max_tokens": 1, "\\ud800": 1}', "\\ud800"),
    ("/v1/chat/completions", b'{"model": "tiny-qwen", "messages": [{"role": "user", "content": "x", "\\udfff": 1}]}',
     "messages"),
]


@pytest.mark.parametrize("path,raw,param", BAD_BODIES, ids=[f"{i}" for i in range(len(BAD_BODIES))])
def test_hostile_body_is_400_on_a_connection_that_stays_open(server, path, raw, param):
    conn = RawConnection(server.url)
    try:
        status, headers, body = conn.request("POST", path, raw)
        assert status == 400, body[:300]
        err = json.loads(body)["error"]
        assert err["type"] == "invalid_request_error" and err["message"] and err["param"] == param
        assert headers.get("connection", "").lower() != "close"
        status, _, body = conn.request("POST", "/v1/completions", ok_completion_body(server.name))
        assert status == 200 and json.loads(body)["usage"]["completion_tokens"] == 3
    finally:
        conn.close()
    wait_idle(server.engine)


def test_internal_error_is_one_500_on_a_connection_that_stays_open(server, caplog):
    from hayabusa.entrypoints.openai.server import ServerThread, build_app

    app = build_app(server.engine, ["tiny-qwen"])

    from hayabusa.entrypoints.openai.serving import SSEStream

    async def broken(req):
        raise ZeroDivisionError("a bug")

    async def chunks_then_a_bug():
        yield b'data: {"choices": []}\n\n'
        raise KeyError("a bug mid-stream")

    async def broken_stream(req):
        return SSEStream(chunks_then_a_bug(), [])

    app.state.serving.completions = broken
    app.state.serving.chat = broken_stream
    with ServerThread(app) as t, caplog.at_level(logging.ERROR):
        conn = RawConnection(t.url)
        try:
            status, headers, body = conn.request("POST", "/v1/completions", ok_completion_body("tiny-qwen"))
            assert status == 500 and json.loads(body)["error"]["type"] == "internal_server_error"
            assert headers.get("connection", "").lower() != "close"
            assert conn.request("GET", "/health")[0] == 200               # the same connection
        finally:
            conn.close()
        r = httpx.post(t.url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]})
        events = [e for e in r.text.split("\n\n") if e]
        assert r.status_code == 200 and events[-1] == "data: [DONE]"
        assert json.loads(events[-2][6:])["error"]["type"] == "internal_server_error"
    tracebacks = [r for r in caplog.records if r.exc_info]
    assert len(tracebacks) == 2 and "ZeroDivisionError" in caplog.text and "a bug mid-stream" in caplog.text


# ------------------------------------------------------------------------------------------------ 6
def test_request_ids_and_field_names_cannot_forge_log_lines(server, caplog):
    engine = server.engine
    engine.log_requests = True
    try:
        with caplog.at_level(logging.INFO):
            r = httpx.post(server.url + "/v1/completions", timeout=60, json={
                "model": server.name, "prompt": "hi", "max_tokens": 2,
                "request_id": "x\nINFO forged line", "field\nforged": 1})
            assert r.status_code == 200
    finally:
        engine.log_requests = False
    messages = [rec.getMessage() for rec in caplog.records]
    assert any("x\\nINFO forged line" in m for m in messages)
    assert any("field\\nforged" in m for m in messages)
    assert not any("\n" in m for m in messages)


def test_model_path_is_not_shown_but_accepted(server):
    text = httpx.get(server.url + "/v1/models").text
    assert server.model_dir not in text and json.loads(text)["data"][0]["id"] == "tiny-qwen"
    r = httpx.post(server.url + "/v1/completions", timeout=60,
                   json={"model": server.model_dir, "prompt": "hi", "max_tokens": 2})
    assert r.status_code == 200 and r.json()["model"] == "tiny-qwen"


@pytest.mark.parametrize("flag", [["--max-request-body-bytes", "0"], ["--shutdown-timeout", "-1"]])
def test_bad_server_flags_are_refused(stories_dir, flag, capsys):
    from hayabusa.entrypoints.cli import main

    assert main(["serve", stories_dir, *flag]) == 2
    assert flag[0] in capsys.readouterr().err


def test_default_served_name_is_the_folder_name(tmp_path):
    from hayabusa.entrypoints.openai.cli import allowed_hosts, default_served_name

    (tmp_path / "my-model").mkdir()
    assert default_served_name(str(tmp_path / "my-model")) == "my-model"
    assert default_served_name(str(tmp_path / "my-model") + "/") == "my-model"
    assert default_served_name("Qwen/Qwen2.5-0.5B-Instruct") == "Qwen/Qwen2.5-0.5B-Instruct"
    assert allowed_hosts("127.0.0.1", []) == ["localhost", "127.0.0.1", "::1"]
    assert allowed_hosts("0.0.0.0", []) is None
    assert allowed_hosts("0.0.0.0", ["api.example"]) == ["localhost", "127.0.0.1", "::1", "api.example"]


def test_shutdown_drains_then_ends_open_streams_with_an_error_and_done(stories_dir):
    s = Served(stories_dir, "stories", max_model_len=512, shutdown_timeout=1.0)
    step = s.engine.engine.step

    def slow_step():                                  # 500 tokens take far longer than the 1 s drain
        time.sleep(0.02)
        return step()

    s.engine.engine.step = slow_step
    try:
        quick = StreamInFlight(s, max_tokens=5)       # finishes during the drain
        results: list[list[str]] = []

        def long_stream() -> None:
            body = {"model": "stories", "prompt": "Once", "max_tokens": 500, "ignore_eos": True, "stream": True}
            with httpx.stream("POST", s.url + "/v1/completions", json=body, timeout=60) as r:
                results.append([line for line in r.iter_lines() if line])

        def long_non_streamed() -> None:
            body = {"model": "stories", "prompt": "Once", "max_tokens": 500, "ignore_eos": True}
            r = httpx.post(s.url + "/v1/completions", json=body, timeout=60)
            results.append([str(r.status_code), r.json()["error"]["type"]])

        threads = [threading.Thread(target=long_stream, daemon=True) for _ in range(2)]
        threads.append(threading.Thread(target=long_non_streamed, daemon=True))
        for t in threads:
            t.start()
        deadline = time.monotonic() + 30      # all three long requests in the engine (a loaded machine is slow)
        while s.engine.engine.get_num_unfinished_requests() < 3 and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.2)
        t0 = time.monotonic()
        s.server.stop()
        stopped_after = time.monotonic() - t0
        for t in threads:
            t.join(30)
        quick.check()
        assert 1.0 <= stopped_after < 5.0
        assert len(results) == 3 and ["503", "service_unavailable"] in results
        for events in (r for r in results if r[0] != "503"):
            assert events[-1] == "data: [DONE]"
            last = json.loads(events[-2][6:])
            assert last["error"]["type"] == "service_unavailable" and "shutting down" in last["error"]["message"]
            assert len(events) > 3                      # it streamed tokens before the end
        wait_idle(s.engine)                            # their requests were aborted: every KV block is free
    finally:
        s.engine.engine.step = step
        s.engine.shutdown()


# ------------------------------------------------------------------------------------------------ 7: cheap bounds
def _list_body(head: str, item: bytes, count: int, tail: str = "") -> bytes:
    """``{head "field": [item, item, ...] tail}`` built as bytes (json.dumps of millions of items is slow)."""
    return head.encode() + b"[" + b", ".join([item] * count) + b"]" + tail.encode() + b"}"


_M = '{"model": "tiny-qwen", "max_tokens": 2, '
PATHOLOGICAL = [   # (path, body, status, param): each 10-30 MB, each used to stall the event loop for seconds
    ("/v1/completions", _list_body(_M + '"prompt": ', b"[5]", 5_000_000), 400, None),
    ("/v1/completions", _list_body(_M + '"prompt": ', b"[5]", 200_000), 400, "prompt"),
    ("/v1/completions", _list_body(_M + '"prompt": ', b'"a"', 1_000_000), 400, "prompt"),
    ("/v1/completions", _list_body(_M + '"prompt": ', b"5", 10_000_000), 400, None),
    ("/v1/completions", _list_body(_M + '"prompt": ', b"5", 3_000_000), 400, "prompt"),
    ("/v1/completions", _list_body(_M + '"truncate_prompt_tokens": 8, "prompt": ', b"5", 3_000_000), 200, None),
    ("/v1/completions", _list_body(_M + '"prompt": "x", "stop_token_ids": ', b"3", 5_000_000), 400, None),
    ("/v1/completions", _list_body(_M + '"prompt": "x", "stop_token_ids": ', b"3", 3_000_000), 400,
     "stop_token_ids"),
    ("/v1/completions", _list_body(_M + '"prompt": "x", "stop": ', b'"a"', 3_000_000), 400, "stop"),
    ("/v1/chat/completions", _list_body(_M + '"messages": ', b'{"role": "user", "content": ""}', 800_000), 400,
     None),
    ("/v1/chat/completions", _list_body(_M + '"messages": ', b'{"role": "user", "content": ""}', 70_000), 400,
     "messages"),
]


def test_pathological_bodies_are_refused_while_health_and_streams_go_on(server):
    # As run_server does at startup (gc.freeze): otherwise a full collection set off while a body is parsed walks
    # every object the test session has built so far (other engines, tokenizers), not a server's startup heap.
    gc.collect()
    gc.freeze()
    try:
        _pathological_bodies(server)
    finally:
        gc.unfreeze()


def _pathological_bodies(server):
    stream = StreamInFlight(server, max_tokens=STREAM_TOKENS)
    probe = HealthProbe(server.url)
    worst: list[tuple[int, str | None, float]] = []
    try:
        for path, body, status, param in PATHOLOGICAL:
            t0 = time.monotonic()
            r = httpx.post(server.url + path, content=body, timeout=60, headers={"Content-Type": "application/json"})
            assert r.status_code == status, (len(body), r.text[:300])
            if status == 400:
                assert r.json()["error"]["param"] == param, r.text[:300]
            else:
                assert r.json()["usage"]["prompt_tokens"] == 8
            assert time.monotonic() - t0 < 15, path
            worst.append((len(body), param, round(probe.worst, 3)))     # the slowest /health answer per body
            probe.worst = 0.0
    finally:
        probe.finish()
    print(f"worst /health answer per body: {worst}")
    # Before the structure bounds these bodies stalled /health for 5.7-50 s. What remains is C code on a worker
    # thread holding the GIL over a body of up to 32 MiB: json.loads (0.1-0.3 s for 9 MB) and, for 800,000
    # messages (26 MB), the regex that recounts brackets outside strings (1.7 s alone on the 2-core machine;
    # 1.05 s for some body in a loaded clean-clone .ci/run at cf21b06). 4 s keeps the test about the stalls.
    assert probe.count >= 10 and max(w for *_, w in worst) < 4.0 and probe.failures == 0, worst
    stream.check()
    serves_next_request(server)


@pytest.mark.parametrize("field,value", [("stop", ["a"] * 1025), ("stop_token_ids", [3] * 1025),
                                         ("request_id", "r" * 513), ("prompt", ["a"] * 1025),
                                         ("prompt", [[5]] * 1025)])
def test_counts_over_the_caps_are_400_naming_the_field(server, field, value):
    body = {"model": server.name, "prompt": "x", "max_tokens": 2, field: value}
    r = httpx.post(server.url + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text[:300]
    body[field] = value[:-1]
    r = httpx.post(server.url + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 200 or r.json()["error"]["param"] != field, r.text[:300]


def test_choice_count_is_checked_before_tokenizing(server):
    t0 = time.monotonic()
    r = httpx.post(server.url + "/v1/completions", timeout=60, json={
        "model": server.name, "prompt": ["a long prompt " * 50] * 600, "n": 2, "max_tokens": 2})
    assert r.status_code == 400 and r.json()["error"]["param"] == "n" and time.monotonic() - t0 < 2, r.text[:300]
    serves_next_request(server)


# ------------------------------------------------------------------------------------------------ 8: strict types
@pytest.mark.parametrize("path,field,value", [
    ("/v1/completions", "max_tokens", "5"), ("/v1/completions", "n", True), ("/v1/completions", "n", 2.0),
    ("/v1/chat/completions", "n", "2"), ("/v1/completions", "prompt", [1, True]), ("/v1/completions", "prompt", [1, 2.0]),
    ("/v1/completions", "stream", "yes"), ("/v1/chat/completions", "add_generation_prompt", "no"),
    ("/v1/completions", "seed", "1"), ("/v1/completions", "temperature", "0.5"),
    ("/v1/chat/completions", "stream_options", {"include_usage": "yes"})])
def test_lax_types_are_400_naming_the_field(server, path, field, value):
    body = {"model": server.name, "max_tokens": 2}
    body.update({"prompt": "hi"} if path == "/v1/completions" else {"messages": [{"role": "user", "content": "hi"}]})
    if field == "stream_options":
        body["stream"] = True
    body[field] = value
    r = httpx.post(server.url + path, json=body, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text[:300]


def test_integer_temperature_is_still_a_float(server):
    r = httpx.post(server.url + "/v1/completions", timeout=60, json={
        "model": server.name, "prompt": "hi", "max_tokens": 2, "temperature": 1, "top_p": 1, "presence_penalty": 0})
    assert r.status_code == 200, r.text[:300]


# ------------------------------------------------------------------------------------------------ 9: slow bodies
def test_incomplete_bodies_get_408_and_are_closed(server):
    """Connections that announce 100,000 bytes and send 9: each gets 408 when the body timeout (1 s here) runs out,
    then the server closes it; /health answered meanwhile."""
    from hayabusa.entrypoints.openai.server import ServerThread, build_app

    app = build_app(server.engine, ["tiny-qwen"], request_body_timeout=1.0)
    with ServerThread(app) as t:
        conns = [RawConnection(t.url, timeout=10) for _ in range(30)]
        try:
            t0 = time.monotonic()
            for c in conns:
                c.send("POST", "/v1/completions", b'{"model":', headers={"Content-Length": "100000"})
            assert httpx.get(t.url + "/health", timeout=5).status_code == 200
            for c in conns:
                status, headers, body = c.response()
                assert status == 408 and json.loads(body)["error"]["code"] == "request_timeout"
                assert headers.get("connection", "").lower() == "close"
                assert c.sock.recv(1) == b""                      # closed by the server
            assert time.monotonic() - t0 < 8
        finally:
            for c in conns:
                c.close()
        r = httpx.post(t.url + "/v1/completions", content=ok_completion_body("tiny-qwen"),
                       headers={"Content-Type": "application/json"}, timeout=60)
        assert r.status_code == 200
    wait_idle(server.engine)


@pytest.mark.parametrize("flag", ["--request-body-timeout", "--request-header-timeout"])
def test_bad_request_timeout_flags_are_refused(stories_dir, capsys, flag):
    from hayabusa.entrypoints.cli import main

    assert main(["serve", stories_dir, flag, "0"]) == 2
    assert flag in capsys.readouterr().err


def test_long_request_ids_and_field_names_are_shortened_in_logs(server, caplog):
    engine = server.engine
    engine.log_requests = True
    try:
        with caplog.at_level(logging.INFO):
            extra = {f"field{i}-" + "f" * 5000: 1 for i in range(50)}
            r = httpx.post(server.url + "/v1/completions", timeout=60, json={
                "model": server.name, "prompt": "hi", "max_tokens": 2, "request_id": "r" * 512,
                "stop": ["s" * 1000] * 100, **extra})
            assert r.status_code == 200, r.text[:300]
            r = httpx.post(server.url + "/v1/completions", timeout=60, json={
                "model": server.name, "prompt": "hi", "max_tokens": 2, "request_id": "r" * 513})
            assert r.status_code == 400 and r.json()["error"]["param"] == "request_id"
    finally:
        engine.log_requests = False
    messages = [rec.getMessage() for rec in caplog.records]
    assert any("rrrr" in m for m in messages) and any("field0-" in m for m in messages)
    assert max(len(m) for m in messages) < 1200


# ------------------------------------------------------------------------------------------------ 10: chat kwargs
@pytest.mark.parametrize("key", ["messages", "conversations", "conversation", "tools", "add_generation_prompt",
                                 "continue_final_message", "chat_template", "tokenize", "return_dict"])
def test_reserved_chat_template_kwargs_are_400_by_name(server, key):
    r = httpx.post(server.url + "/v1/chat/completions", timeout=60, json={
        "model": server.name, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
        "chat_template_kwargs": {key: [], "enable_thinking": False}})
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == "chat_template_kwargs" and key in err["message"], r.text[:300]
    assert "multiple values" not in err["message"]


def test_other_chat_template_kwargs_reach_the_template(server):
    r = httpx.post(server.url + "/v1/chat/completions", timeout=60, json={
        "model": server.name, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
        "chat_template": "{{ greeting }} {{ messages[0]['content'] }}", "chat_template_kwargs": {"greeting": "hello"},
        "echo": True})
    assert r.status_code == 200, r.text[:300]


def test_reserved_chat_template_kwargs_are_refused_by_the_python_api(tiny_qwen2):
    from transformers import AutoTokenizer

    from hayabusa.entrypoints.chat_utils import render_chat
    from hayabusa.errors import HayabusaValidationError

    tok = AutoTokenizer.from_pretrained(tiny_qwen2)
    for key in ("messages", "conversations"):
        with pytest.raises(HayabusaValidationError) as e:
            render_chat(tok, [{"role": "user", "content": "hi"}], chat_template_kwargs={key: []})
        assert e.value.parameter == "chat_template_kwargs" and key in str(e.value)


def test_two_content_type_headers_are_415(server):
    conn = RawConnection(server.url)
    try:
        head = (f"POST /v1/completions HTTP/1.1\r\nHost: {conn.host}\r\nContent-Type: application/json\r\n"
                "Content-Type: text/plain\r\n")
        body = ok_completion_body(server.name)
        conn.sock.sendall(head.encode() + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
        status, _, raw = conn.response()
        assert status == 415 and json.loads(raw)["error"]["code"] == "unsupported_media_type", raw
        assert conn.request("POST", "/v1/completions", body)[0] == 200           # the same connection
    finally:
        conn.close()


# ------------------------------------------------------------------------------------------------ 11: legacy functions
FUNCTIONS = [{"name": "f", "parameters": {"type": "object", "properties": {}}}]


@pytest.mark.parametrize("field,value,status", [("functions", FUNCTIONS, 400), ("function_call", "auto", 400),
                                                ("function_call", {"name": "f"}, 400), ("functions", [], 200),
                                                ("function_call", "none", 200), ("parallel_tool_calls", False, 200),
                                                ("functions", None, 200)])
def test_legacy_function_calling_is_refused_not_ignored(server, field, value, status):
    r = httpx.post(server.url + "/v1/chat/completions", timeout=60, json={
        "model": server.name, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, field: value})
    assert r.status_code == status, r.text[:300]
    if status == 400:
        assert r.json()["error"]["param"] == field and "not supported" in r.json()["error"]["message"]


# ------------------------------------------------------------------------------------------------ 12: breakserver
TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}]


@pytest.mark.parametrize("tools", [None, TOOLS])
@pytest.mark.parametrize("tool_choice,status", [("required", 400), ({"type": "function", "function": {"name": "f"}},
                                                                    400), ("auto", 200), ("none", 200)])
def test_tool_choice_that_needs_a_tool_call_is_400_with_or_without_tools(server, tools, tool_choice, status):
    """"required" or a named function without tools used to be ignored (200, plain text): hayabusa makes no tool
    calls, so it is a 400 naming tool_choice either way."""
    r = httpx.post(server.url + "/v1/chat/completions", timeout=60, json={
        "model": server.name, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "tools": tools,
        "tool_choice": tool_choice})
    assert r.status_code == status, r.text[:300]
    if status == 400:
        err = r.json()["error"]
        assert err["param"] == "tool_choice" and "not supported" in err["message"], err
        assert ascii(tool_choice)[:20] in err["message"], err


@pytest.mark.parametrize("part", [{"type": "text"}, {"type": "text", "text": None}])
def test_text_part_without_text_is_400_saying_so(server, part):
    r = httpx.post(server.url + "/v1/chat/completions", timeout=60, json={
        "model": server.name, "messages": [{"role": "user", "content": [part]}], "max_tokens": 2})
    assert r.status_code == 400, r.text[:300]
    err = r.json()["error"]
    assert err["param"] == "messages" and "needs a 'text' string" in err["message"], err


@pytest.mark.parametrize("length_penalty", [1e308, -1e308])
def test_extreme_length_penalty_is_not_a_500(server, length_penalty):
    r = httpx.post(server.url + "/v1/completions", timeout=60, json={
        "model": server.name, "prompt": "Once", "max_tokens": 3, "n": 2, "use_beam_search": True,
        "length_penalty": length_penalty})
    assert r.status_code == 200, r.text[:300]
    assert len(r.json()["choices"]) == 2 and r.json()["usage"]["completion_tokens"] == 6
    serves_next_request(server)


# A request head (request line + headers) must arrive within header_timeout of the connection opening or of its last
# response; uvicorn alone held a connection that trickles header bytes (or sends none) forever (slowloris).
def _closed_within(sock: socket.socket, seconds: float) -> float | None:
    """Seconds until the server closed `sock` (recv gives b"" or a reset), or None if still open after `seconds`."""
    t0 = time.monotonic()
    sock.settimeout(seconds)
    try:
        while sock.recv(65536):
            pass
    except socket.timeout:
        return None
    except ConnectionResetError:
        pass
    return time.monotonic() - t0


@pytest.fixture(scope="module")
def deadline_server():
    """A bare app behind hayabusa's uvicorn protocol, header_timeout 0.5 s: /slow answers after 1.5 s."""
    import asyncio

    from fastapi import FastAPI
    from fastapi.responses import JSONResponse

    from hayabusa.entrypoints.openai.server import ServerThread

    async def slow(request):
        body = await request.body()
        await asyncio.sleep(1.5)
        return JSONResponse({"n": len(body)})

    app = FastAPI()
    app.router.add_route("/slow", slow, methods=["POST"])

    with ServerThread(app, header_timeout=0.5) as s:
        yield s


def test_connections_without_a_request_head_are_closed(deadline_server):
    host, port = deadline_server.host, deadline_server.port
    silent = socket.create_connection((host, port))
    trickle = socket.create_connection((host, port))
    try:
        t0 = time.monotonic()
        try:
            for ch in b"POST /slow HTTP/1.1\r\nHost: x\r\n" * 10:  # a byte every 0.05 s (3 s in all): each one
                trickle.sendall(bytes([ch]))                        # used to reset uvicorn's keep-alive timer
                time.sleep(0.05)
        except (BrokenPipeError, ConnectionResetError):
            pass                                                    # closed by the server while we sent
        else:
            assert _closed_within(trickle, 0.5) is not None
        assert time.monotonic() - t0 < 1.5
        assert _closed_within(silent, 2.0) is not None
    finally:
        silent.close()
        trickle.close()


def test_slow_answers_and_keep_alive_survive_the_head_deadline(deadline_server):
    """A request whose answer (1.5 s) and whose body (sent 0.8 s after its head) take longer than the 0.5 s head
    deadline is answered, twice on one connection; then the idle connection is closed by the deadline."""
    sock = socket.create_connection((deadline_server.host, deadline_server.port), timeout=10)
    rfile = sock.makefile("rb")
    try:
        for _ in range(2):
            sock.sendall(b"POST /slow HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Content-Length: 2\r\n\r\n")
            time.sleep(0.8)
            sock.sendall(b"{}")
            assert rfile.readline().split()[1] == b"200"
            while (line := rfile.readline()) not in (b"\r\n", b""):
                if line.lower().startswith(b"content-length"):
                    n = int(line.split(b":")[1])
            assert json.loads(rfile.read(n)) == {"n": 2}
        sock.sendall(b"POST /sl")                                  # a partial head after a response
        assert _closed_within(sock, 2.0) is not None
    finally:
        rfile.close()
        sock.close()


@pytest.mark.parametrize("value", [0, -1.0, float("nan"), "5", True])
def test_bad_header_timeout_is_refused_by_name(value):
    from hayabusa.entrypoints.openai.server import http_protocol
    from hayabusa.errors import HayabusaValidationError

    with pytest.raises(HayabusaValidationError) as e:
        http_protocol(value)
    assert e.value.parameter == "header_timeout"


def test_image_on_a_text_model_is_400_saying_so(server):
    """Was a 400 about the chat template's image placeholders (suggesting a multimodal template)."""
    from tests.entrypoints.test_media import data_url, gradient

    r = httpx.post(server.url + "/v1/chat/completions", timeout=60, json={
        "model": server.name, "max_tokens": 2, "messages": [{"role": "user", "content": [
            {"type": "text", "text": "hi"}, {"type": "image_url", "image_url": {"url": data_url(gradient(4, 4))}}]}]})
    assert r.status_code == 400, r.text[:300]
    err = r.json()["error"]
    assert err["param"] == "messages" and "1 image(s), but this model takes text only" in err["message"], err
    serves_next_request(server)
