"""`edge-sd serve` through real clients: the official `openai` package and raw HTTP, against servers the
tests start on free loopback ports and stop with SIGTERM."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest

from edge_sd import GenerationConfig, Model

from conftest import PROVIDER

PAIR = "gemma_qwen"
MESSAGES = [{"role": "system", "content": "You answer briefly."}, {"role": "user", "content": "the cat sat on"}]
PROMPTS = ["the cat sat on the", "once upon a time", "the dog ran to", "a bird in the"]


class Server:
    """An `edge-sd serve` process on a free loopback port."""

    def __init__(self, folder: Path, *args: str):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "edge_sd.tools.cli", "serve", str(folder), "--port", str(self.port), "-t", "2",
               "--provider", PROVIDER, "--quiet", *args]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"the server exited: {self.proc.communicate()[1]}")
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    return
            except httpx.TransportError:
                time.sleep(0.1)
        raise AssertionError("the server did not start")

    def client(self, key: str = "none") -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key=key, max_retries=0)

    def post(self, path: str, body: object, headers: dict | None = None) -> httpx.Response:
        data = body if isinstance(body, (bytes, str)) else json.dumps(body)
        headers = {"Content-Type": "application/json", **(headers or {})}
        return httpx.post(self.url + path, content=data, headers=headers, timeout=60)

    def stop(self) -> tuple[int, str]:
        """SIGTERM; the exit code and everything the server wrote to stderr."""
        self.proc.send_signal(signal.SIGTERM)
        _, stderr = self.proc.communicate(timeout=60)
        return self.proc.returncode, stderr


@pytest.fixture(scope="module")
def server(tiny_root: Path):
    srv = Server(tiny_root / "pairs" / PAIR)
    yield srv
    code, stderr = srv.stop()
    assert code == 0, stderr
    assert "Traceback" not in stderr, stderr


@pytest.fixture(scope="module")
def model(tiny_root: Path) -> Model:
    return Model.load(tiny_root / "pairs" / PAIR, provider=PROVIDER, threads=2)


def _alone(model: Model, cfg: GenerationConfig, messages: list | None = None, prompt: str | None = None):
    gen = model.generator(cfg)
    gen.append_messages(messages) if messages is not None else gen.append_text(prompt or "")
    while not gen.is_done:
        gen.generate_next_tokens()
    return gen.result()


def test_models_and_health(server: Server) -> None:
    models = server.client().models.list()
    assert [m.id for m in models.data] == [PAIR]
    health = httpx.get(server.url + "/health").json()
    assert health["status"] == "ok" and health["active"] == health["queued"] == 0


def test_chat_greedy_equals_the_generator(server: Server, model: Model) -> None:
    reply = server.client().chat.completions.create(model=PAIR, messages=MESSAGES, max_tokens=24, temperature=0)
    alone = _alone(model, GenerationConfig(max_new_tokens=24), MESSAGES)
    assert reply.choices[0].message.content == alone.text and alone.text
    assert reply.choices[0].message.role == "assistant"
    assert reply.usage.completion_tokens == len(alone.token_ids)
    assert reply.usage.prompt_tokens == len(alone.prompt_ids)
    assert reply.choices[0].finish_reason == ("length" if alone.stats.stop_reason == "max_new_tokens" else "stop")
    stats = reply.model_extra["edge_sd"]
    assert stats["new_tokens"] == len(alone.token_ids) and stats["target_forwards"] >= 1


def test_streamed_deltas_add_up_to_the_whole_reply(server: Server) -> None:
    client = server.client()
    whole = client.chat.completions.create(model=PAIR, messages=MESSAGES, max_tokens=32, temperature=0)
    chunks = list(client.chat.completions.create(model=PAIR, messages=MESSAGES, max_tokens=32, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert chunks[0].choices[0].delta.role == "assistant"
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [whole.choices[0].finish_reason]
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert len({c.id for c in chunks}) == 1


def test_completions_equal_the_generator(server: Server, model: Model) -> None:
    client = server.client()
    alone = _alone(model, GenerationConfig(max_new_tokens=20, stop=(".",)), prompt=PROMPTS[0])
    whole = client.completions.create(model=PAIR, prompt=PROMPTS[0], max_tokens=20, temperature=0, stop=".")
    assert whole.choices[0].text == alone.text
    streamed = client.completions.create(model=PAIR, prompt=PROMPTS[0], max_tokens=20, temperature=0, stop=".",
                                         stream=True)
    assert "".join(c.choices[0].text for c in streamed) == alone.text


def test_seeded_sampling_is_reproducible(server: Server, model: Model) -> None:
    client = server.client()
    chain = {"top_k": 20, "min_p": 0.02, "repeat_penalty": 1.1}
    texts = [client.chat.completions.create(model=PAIR, messages=MESSAGES, max_tokens=24, temperature=0.9, top_p=0.95,
                                            seed=7, extra_body=chain).choices[0].message.content for _ in range(2)]
    cfg = GenerationConfig(max_new_tokens=24, temperature=0.9, top_p=0.95, seed=7, top_k=20, min_p=0.02,
                           repetition_penalty=1.1)
    assert texts[0] == texts[1] == _alone(model, cfg, MESSAGES).text


BAD = [
    (b"{not json", 400, None),
    (b"[1, 2]", 400, None),
    ({"messages": MESSAGES, "temperature": "hot"}, 400, "temperature"),
    ({"messages": MESSAGES, "colour": "red"}, 400, "colour"),
    ({"messages": MESSAGES, "max_tokens": -1}, 400, "max_tokens"),
    ({"messages": MESSAGES, "max_tokens": 10**9}, 400, "max_tokens"),
    ({"messages": MESSAGES, "max_tokens": 250}, 400, "max_tokens"),  # the prompt and 250 exceed 256
    ({"messages": []}, 400, "messages"),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, 400, "messages[0].role"),
    ({"messages": [{"role": "user", "content": ""}]}, 400, "messages[0].content"),
    ({"messages": MESSAGES, "n": 2}, 400, "n"),
    ({"messages": MESSAGES, "top_p": 0}, 400, "top_p"),
    ({"messages": MESSAGES, "repeat_penalty": 0}, 400, "repeat_penalty"),
    ({"messages": MESSAGES, "algorithm": "magic"}, 400, "algorithm"),
    ({"messages": MESSAGES, "stream": "yes"}, 400, "stream"),
    ({"messages": [{"role": "user", "content": "the cat " * 300}]}, 400, "messages"),  # beyond the context
]


@pytest.mark.parametrize("body,status,param", BAD, ids=range(len(BAD)))
def test_bad_input_is_an_error_object_and_the_next_request_is_served(server: Server, body, status, param) -> None:
    for stream in (False, True):
        sent = {**body, "stream": body.get("stream", stream)} if isinstance(body, dict) else body
        response = server.post("/v1/chat/completions", sent)
        assert response.status_code == status, response.text
        error = response.json()["error"]
        assert error["param"] == param and error["message"]
        if param:
            named = param.split(".")[0].split("[")[0] in error["message"]
            assert named or error["code"] == "context_length_exceeded", error
    ok = server.post("/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 4})
    assert ok.status_code == 200 and ok.json()["choices"][0]["message"]["content"] is not None


def test_the_prompt_beyond_the_context_in_completions(server: Server) -> None:
    response = server.post("/v1/completions", {"prompt": "the cat " * 300})
    assert response.status_code == 400 and response.json()["error"]["code"] == "context_length_exceeded"
    response = server.post("/v1/completions", {"prompt": ["a", "b"]})
    assert response.status_code == 400 and response.json()["error"]["param"] == "prompt"


def test_a_body_beyond_the_limit_is_refused_and_the_next_request_is_served(server: Server) -> None:
    """413 with an error object, whether the length is declared or the body is sent in chunks."""
    from edge_sd.tools.serve.app import MAX_BODY

    big = json.dumps({"prompt": "x" * (MAX_BODY + 1)}).encode()
    declared = httpx.post(server.url + "/v1/completions", content=big, timeout=60)
    chunked = httpx.post(server.url + "/v1/completions", content=iter([big[:1000], big[1000:]]), timeout=60)
    for response in (declared, chunked):
        assert response.status_code == 413, response.text
        assert str(MAX_BODY) in response.json()["error"]["message"]
    ok = server.post("/v1/completions", {"prompt": "the cat", "max_tokens": 4})
    assert ok.status_code == 200


def test_unknown_routes_and_methods_are_error_objects(server: Server) -> None:
    assert httpx.get(server.url + "/v1/nothing").json()["error"]["message"]
    response = httpx.get(server.url + "/v1/chat/completions")
    assert response.status_code == 405 and response.json()["error"]["message"]


def _stream_text(server: Server, prompt: str) -> str:
    chunks = server.client().completions.create(model=PAIR, prompt=prompt, max_tokens=40, temperature=0, stream=True)
    return "".join(c.choices[0].text for c in chunks)


def test_concurrent_streams_are_each_what_they_are_alone(server: Server) -> None:
    alone = {p: _stream_text(server, p) for p in PROMPTS}
    got: dict[str, str] = {}
    threads = [threading.Thread(target=lambda p=p: got.__setitem__(p, _stream_text(server, p))) for p in PROMPTS]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert got == alone


def test_sixteen_clients_in_a_loop_get_no_error_and_no_mixed_tokens(server: Server) -> None:
    """16 streaming clients for 5 s (the server takes 4 at once and queues 16): every stream is its
    prompt's text alone."""
    alone = {p: _stream_text(server, p) for p in PROMPTS}
    errors: list[str] = []
    done = [0]
    end = time.monotonic() + 5

    def client(i: int) -> None:
        prompt = PROMPTS[i % len(PROMPTS)]
        while time.monotonic() < end:
            try:
                text = _stream_text(server, prompt)
            except Exception as e:  # noqa: BLE001 - every error is a failure, recorded
                errors.append(repr(e))
                return
            if text != alone[prompt]:
                errors.append(f"client {i}: {text!r} != {alone[prompt]!r}")
            done[0] += 1

    threads = [threading.Thread(target=client, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[:3]
    assert done[0] >= 16


def _health(srv: Server) -> dict:
    return httpx.get(srv.url + "/health").json()


def _busy_while_streaming(srv: Server) -> bool:
    """Open a long stream, and while it runs: a second request is refused with 503 and Retry-After.
    Then the stream is closed (the client goes away). False where the stream ended too soon to tell."""
    body = {"prompt": "a", "max_tokens": 250, "temperature": 1.0, "stream": True}
    with httpx.Client(timeout=60) as c, c.stream("POST", srv.url + "/v1/completions", json=body) as first:
        assert first.status_code == 200
        lines = first.iter_lines()  # held: a dropped iterator closes the response
        next(lines)
        busy = srv.post("/v1/completions", {"prompt": "a", "max_tokens": 2})
        if busy.status_code == 200:  # the stream had ended already (a tiny model is quick)
            return False
        assert busy.status_code == 503 and busy.headers["Retry-After"] == "1"
        assert busy.json()["error"]["code"] == "busy"
        return _health(srv)["active"] == 1


def _gone_while_waiting(srv: Server) -> bool:
    """A client that gives up on a whole (not streamed) reply has its request cancelled. False where
    the reply came before the client gave up."""
    before = _health(srv)["cancelled"]
    try:
        httpx.post(srv.url + "/v1/completions", json={"prompt": "a", "max_tokens": 250, "temperature": 1.0},
                   timeout=httpx.Timeout(60, read=0.05))
        return False
    except httpx.ReadTimeout:
        pass
    deadline = time.monotonic() + 5
    while _health(srv)["cancelled"] == before and time.monotonic() < deadline:
        time.sleep(0.02)
    return _health(srv)["cancelled"] == before + 1


def test_busy_server_says_retry_and_a_gone_client_frees_its_place(tiny_root: Path) -> None:
    srv = Server(tiny_root / "pairs" / PAIR, "--max-concurrent", "1", "--queue", "0", "--grace", "30")
    try:
        assert any(_busy_while_streaming(srv) for _ in range(10)), "no stream lasted long enough to test"
        deadline = time.monotonic() + 5  # the stream closed: its place is free at the next round
        while _health(srv)["active"] and time.monotonic() < deadline:
            time.sleep(0.05)
        health = _health(srv)
        assert health["active"] == health["queued"] == 0 and health["cancelled"] >= 1 and health["refused"] >= 1
        assert srv.post("/v1/completions", {"prompt": "a", "max_tokens": 2}).status_code == 200
        assert any(_gone_while_waiting(srv) for _ in range(10)), "no request lasted long enough to test"
        # SIGTERM with a stream in flight: the stream ends whole (within the grace), the server exits cleanly
        lines, reader = _stream_in_background(srv)
    finally:
        code, stderr = srv.stop()
    reader.join(timeout=30)
    assert not reader.is_alive() and [x for x in lines if x][-1] == "data: [DONE]"
    assert code == 0 and "Traceback" not in stderr, stderr


def _stream_in_background(srv: Server) -> tuple[list[str], threading.Thread]:
    """A long stream read by a thread; returns once its first line has come."""
    lines: list[str] = []
    started = threading.Event()

    def read() -> None:
        body = {"prompt": "a", "max_tokens": 250, "temperature": 1.0, "stream": True}
        with httpx.stream("POST", srv.url + "/v1/completions", json=body, timeout=60) as r:
            for line in r.iter_lines():
                lines.append(line)
                started.set()

    reader = threading.Thread(target=read)
    reader.start()
    assert started.wait(30)
    return lines, reader


def test_sigterm_past_the_grace_cancels_what_runs(tiny_root: Path) -> None:
    srv = Server(tiny_root / "pairs" / PAIR, "--grace", "0")
    try:
        lines, reader = _stream_in_background(srv)
    finally:
        code, stderr = srv.stop()
    reader.join(timeout=30)
    last = json.loads([x for x in lines if x][-1][len("data: "):])
    assert not reader.is_alive() and "shutting down" in last["error"]["message"]
    assert code == 0 and "Traceback" not in stderr and "ERROR" not in stderr, stderr


def test_api_key_and_timeout(tiny_root: Path) -> None:
    srv = Server(tiny_root / "pairs" / PAIR, "--api-key", "s3cret", "--timeout", "1e-6")
    try:
        with pytest.raises(openai.AuthenticationError):
            srv.client("wrong").models.list()
        assert srv.post("/v1/completions", {"prompt": "a"}).status_code == 401
        assert [m.id for m in srv.client("s3cret").models.list().data] == [PAIR]
        response = srv.post("/v1/completions", {"prompt": "a", "max_tokens": 2},
                            headers={"Authorization": "Bearer s3cret"})
        assert response.status_code == 504 and "longer than" in response.json()["error"]["message"]
    finally:
        code, stderr = srv.stop()
    assert code == 0 and "Traceback" not in stderr, stderr


def test_bad_options_are_one_line(tiny_root: Path) -> None:
    for args, word in ((["--port", "70000"], "--port"), (["--max-concurrent", "0"], "--max-concurrent"),
                       (["--queue", "-1"], "--queue")):
        r = subprocess.run([sys.executable, "-m", "edge_sd.tools.cli", "serve", str(tiny_root / "pairs" / PAIR),
                            *args], capture_output=True, text=True, timeout=60, env={**os.environ, "COLUMNS": "200"})
        assert r.returncode == 2 and r.stdout == "" and word in r.stderr and len(r.stderr.strip().splitlines()) == 1


def test_a_single_engine_without_a_chat_template(tiny_root: Path, tmp_path: Path) -> None:
    folder = tmp_path / "engine"
    shutil.copytree(tiny_root / "engines" / "bl_llama", folder)
    manifest = json.loads((folder / "engine.json").read_text())
    manifest["chat_template"] = None
    (folder / "engine.json").write_text(json.dumps(manifest))
    srv = Server(folder)
    try:
        response = srv.post("/v1/chat/completions", {"messages": MESSAGES})
        assert response.status_code == 400 and response.json()["error"]["param"] == "messages"
        assert "/v1/completions" in response.json()["error"]["message"]
        reply = srv.client().completions.create(model="engine", prompt=PROMPTS[1], max_tokens=8, temperature=0)
        assert reply.usage.completion_tokens >= 1 and reply.model == "engine"
    finally:
        code, stderr = srv.stop()
    assert code == 0 and "Traceback" not in stderr, stderr
