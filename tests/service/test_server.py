"""`python -m mlx_flash.serve` as a real subprocess on a loopback port: the openai package and curl
against it, one-line OpenAI-style errors for bad requests (the server stays up), explicit contexts,
API keys scoping contexts, 8 concurrent streaming clients (5 s; the full tier or
MLX_FLASH_SOAK=1: 60 s) under the memory limit, and a client that disconnects mid-stream."""

from __future__ import annotations

import http.client
import json
import os
import shutil
import socket
import subprocess
import threading
import time

import pytest

from live_server import CHAT, HOST, chat_body, start, stop, vm_hwm


FRANCE = [{"role": "user", "content": "What is the capital of France?"}]
SOAK_S = (
    60.0 if "1" in (os.environ.get("MLX_FLASH_FULL"), os.environ.get("MLX_FLASH_SOAK")) else 5.0
)  # clients stream together from the first second
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def server(store_dir, tmp_path_factory):
    srv = start(store_dir, str(tmp_path_factory.mktemp("server")))
    yield srv
    rc = stop(srv)
    assert rc == 0, f"the server exited with {rc}:\n{srv.log_text()[-4000:]}"


@pytest.fixture(scope="module")
def keyed(store_dir, tmp_path_factory):
    srv = start(store_dir, str(tmp_path_factory.mktemp("keyed")), "--api-key", "k1", "--api-key", "k2", key="k1")
    yield srv
    stop(srv)


@pytest.fixture(scope="module")
def client(server):
    openai = pytest.importorskip("openai")
    return openai.OpenAI(base_url=server.base + "/v1", api_key="unused", max_retries=0, timeout=120)


def sse_events(text: str) -> list:
    """The `data:` payloads of a server-sent event stream, [DONE] last."""
    return [ln[len("data: ") :] for ln in text.splitlines() if ln.startswith("data: ")]


# ---- 1. the openai package ---------------------------------------------------------------------------
def test_openai_chat_paris(server, client):
    r = client.chat.completions.create(model=server.model, messages=FRANCE, temperature=0, max_tokens=20)
    assert "Paris" in r.choices[0].message.content, r
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].finish_reason == "stop"
    assert r.id.startswith("chatcmpl-") and r.model == server.model
    u = r.usage
    assert u.prompt_tokens > 0 and u.completion_tokens > 0
    assert u.total_tokens == u.prompt_tokens + u.completion_tokens
    assert 0 <= u.prompt_tokens_details.cached_tokens < u.prompt_tokens


def test_openai_stream_equals_non_stream(server, client):
    whole = client.chat.completions.create(model=server.model, messages=FRANCE, temperature=0, max_tokens=20)
    stream = client.chat.completions.create(
        model=server.model,
        messages=FRANCE,
        temperature=0,
        max_tokens=20,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    deltas = [c.choices[0].delta.content or "" for c in chunks if c.choices]
    assert "".join(deltas) == whole.choices[0].message.content
    assert chunks[0].choices[0].delta.role == "assistant"
    assert len({c.id for c in chunks}) == 1 and chunks[0].id != whole.id
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    last = chunks[-1]
    assert last.choices == [] and last.usage is not None, last
    assert last.usage.prompt_tokens == whole.usage.prompt_tokens
    assert last.usage.completion_tokens == whole.usage.completion_tokens == len(deltas)


def test_openai_raw_completion(server, client):
    r = client.completions.create(model=server.model, prompt="The capital of France is", temperature=0, max_tokens=8)
    assert r.choices[0].text.startswith(" Paris"), r
    assert r.object == "text_completion" and r.id.startswith("cmpl-")
    assert r.usage.completion_tokens == 8


def test_openai_cached_tokens_on_second_turn(server, client):
    """A stateless client re-sending the conversation plus a new turn continues the context in place:
    cached_tokens equals every token the context held."""
    system = {"role": "system", "content": "You are a geography teacher. (cached-tokens test)"}
    msgs = [system, *FRANCE]
    raw = client.chat.completions.with_raw_response.create(
        model=server.model, messages=msgs, temperature=0, max_tokens=20
    )
    first, ctx = raw.parse(), raw.headers.get("X-Context-Id")
    assert ctx and first.usage.prompt_tokens_details.cached_tokens == 0
    status, _, listed = server.request("GET", "/v1/contexts")
    held = {d["id"]: d["tokens"] for d in listed["data"]}
    assert held[ctx] == first.usage.prompt_tokens + first.usage.completion_tokens - 1  # all but the last token
    msgs += [
        {"role": "assistant", "content": first.choices[0].message.content},
        {"role": "user", "content": "And of Germany?"},
    ]
    raw = client.chat.completions.with_raw_response.create(
        model=server.model, messages=msgs, temperature=0, max_tokens=20
    )
    second = raw.parse()
    assert raw.headers.get("X-Context-Id") == ctx  # continued in place, not forked
    assert second.usage.prompt_tokens_details.cached_tokens == held[ctx] > 0
    assert second.usage.prompt_tokens > held[ctx]
    status, _, d = server.request("GET", f"/v1/contexts/{ctx}")
    assert status == 200 and d["tokens"] == second.usage.prompt_tokens + second.usage.completion_tokens - 1
    assert d["messages"] == 5  # system, user, assistant, user, assistant


# ---- 2. curl ---------------------------------------------------------------------------------------
def curl(server, body, *extra):
    if shutil.which("curl") is None:
        pytest.skip("no curl binary on PATH")
    r = subprocess.run(
        [
            "curl",
            "-sS",
            "--max-time",
            "120",
            *extra,
            "-H",
            "Content-Type: application/json",
            "-d",
            json.dumps(body),
            server.base + "/v1/chat/completions",
        ],
        capture_output=True,
        text=True,
        timeout=150,
    )
    assert r.returncode == 0, r.stderr
    return r.stdout


def test_curl_chat(server):
    out = json.loads(curl(server, chat_body(FRANCE)))
    assert out["object"] == "chat.completion"
    assert "Paris" in out["choices"][0]["message"]["content"]
    assert out["usage"]["prompt_tokens_details"]["cached_tokens"] >= 0


def test_curl_stream(server):
    events = sse_events(curl(server, chat_body(FRANCE, stream=True), "-N"))
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    assert "Paris" in text, text
    assert len({c["id"] for c in chunks}) == 1
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == len(chunks) - 1


# ---- 3. bad requests -------------------------------------------------------------------------------
BAD = {
    "malformed_json": ("POST", CHAT, b'{"messages": [', {}, 400, "not valid JSON"),
    "json_array": ("POST", CHAT, b"[1, 2]", {}, 400, "JSON object"),
    "messages_not_a_list": ("POST", CHAT, {"messages": "hi"}, {}, 400, "messages"),
    "message_not_an_object": ("POST", CHAT, {"messages": ["hi"]}, {}, 400, "role"),
    "content_int": ("POST", CHAT, {"messages": [{"role": "user", "content": 5}]}, {}, 400, "content"),
    "bad_role": ("POST", CHAT, {"messages": [{"role": "robot", "content": "x"}]}, {}, 400, "role"),
    "negative_max_tokens": ("POST", CHAT, chat_body(FRANCE, max_tokens=-1), {}, 400, "max_tokens"),
    "max_tokens_string": ("POST", CHAT, chat_body(FRANCE, max_tokens="10"), {}, 400, "max_tokens"),
    "max_tokens_beyond_context": (
        "POST",
        CHAT,
        chat_body(FRANCE, max_tokens=10**12),
        {},
        400,
        "max_tokens 1000000000000 is more than the model's context (",
    ),
    "temperature_hot": ("POST", CHAT, chat_body(FRANCE, temperature="hot"), {}, 400, "temperature"),
    "temperature_out_of_range": ("POST", CHAT, chat_body(FRANCE, temperature=5.0), {}, 400, "temperature"),
    "temperature_nan": (
        "POST",
        CHAT,
        b'{"messages": [{"role": "user", "content": "x"}], "temperature": NaN}',
        {},
        400,
        "temperature",
    ),
    "top_p_zero": ("POST", CHAT, chat_body(FRANCE, top_p=0), {}, 400, "top_p"),
    "unknown_model": ("POST", CHAT, chat_body(FRANCE, model="gpt-9"), {}, 404, "gpt-9"),
    "unknown_field": ("POST", CHAT, chat_body(FRANCE, tempertaure=0.5), {}, 400, "tempertaure"),
    "n_two": ("POST", CHAT, chat_body(FRANCE, n=2), {}, 400, "n"),
    "empty_prompt": ("POST", "/v1/completions", {"prompt": ""}, {}, 400, "prompt"),
    "unknown_context_field": (
        "POST",
        CHAT,
        chat_body(FRANCE, context_id="no-such-context"),
        {},
        404,
        "no-such-context",
    ),
    "unknown_context_header": (
        "POST",
        CHAT,
        chat_body(FRANCE),
        {"X-Context-Id": "no-such-context"},
        404,
        "no-such-context",
    ),
    "context_bad_field": ("POST", "/v1/contexts", {"system": "x", "extra": 1}, {}, 400, "system"),
    "get_on_post_route": ("GET", CHAT, None, {}, 405, "Method Not Allowed"),
    "unknown_route": ("GET", "/v1/nope", None, {}, 404, "Not Found"),
    "unknown_context_get": ("GET", "/v1/contexts/no-such-context", None, {}, 404, "no-such-context"),
}


def assert_api_error(status, data, want_status, needle):
    assert status == want_status, (status, data)
    assert isinstance(data, dict) and isinstance(data.get("error"), dict), data
    msg = data["error"]["message"]
    assert isinstance(msg, str) and msg and "\n" not in msg, msg
    assert needle in msg, msg
    assert "type" in data["error"] and "code" in data["error"]
    return data["error"]


@pytest.mark.parametrize("case", list(BAD), ids=list(BAD))
def test_bad_request(server, case):
    method, path, body, headers, want, needle = BAD[case]
    status, _, data = server.request(method, path, body=body, headers=headers)
    assert_api_error(status, data, want, needle)
    assert server.healthy()


def test_prompt_longer_than_the_context(server):
    st = server.stats()
    limit = st["kv"]["slots"] * st["kv"]["chunk_tokens"]  # 30 MB: fewer tokens than the model's context
    before = {d["id"] for d in server.request("GET", "/v1/contexts")[2]["data"]}
    text = "hello " * 9000
    assert len(text.split()) > limit
    for path, body in (
        (CHAT, chat_body([{"role": "user", "content": text}])),
        ("/v1/completions", {"prompt": text, "max_tokens": 4}),
    ):
        status, _, data = server.request("POST", path, body=body)
        err = assert_api_error(status, data, 400, "tokens")
        assert f"fewer than {limit}" in err["message"] and err["code"] == "context_length_exceeded", err
    after = {d["id"] for d in server.request("GET", "/v1/contexts")[2]["data"]}
    assert after == before  # a refused request leaves no context behind
    assert server.healthy()
    r = server.request("POST", CHAT, chat_body(FRANCE))
    assert r[0] == 200 and "Paris" in r[2]["choices"][0]["message"]["content"]


# ---- 4. explicit contexts ----------------------------------------------------------------------------
def test_explicit_context_lifecycle(server, client):
    status, headers, data = server.request("POST", "/v1/contexts", {"system": "You are a helpful assistant."})
    assert status == 200 and data["object"] == "context", data
    ctx = data["id"]
    assert headers["X-Context-Id"] == ctx
    r1 = client.chat.completions.create(
        model=server.model, messages=FRANCE, temperature=0, max_tokens=20, extra_body={"context_id": ctx}
    )
    assert "Paris" in r1.choices[0].message.content
    assert r1.usage.prompt_tokens_details.cached_tokens == 0
    # Only the new turn is sent; the header names the context this time.
    raw = client.chat.completions.with_raw_response.create(
        model=server.model,
        messages=[{"role": "user", "content": "And of Germany?"}],
        temperature=0,
        max_tokens=20,
        extra_headers={"X-Context-Id": ctx},
    )
    r2 = raw.parse()
    assert raw.headers.get("X-Context-Id") == ctx
    assert r2.usage.prompt_tokens_details.cached_tokens == r1.usage.prompt_tokens + r1.usage.completion_tokens - 1
    assert r2.usage.prompt_tokens > r1.usage.prompt_tokens + r1.usage.completion_tokens
    listed = {d["id"]: d for d in server.request("GET", "/v1/contexts")[2]["data"]}
    assert listed[ctx]["messages"] == 5  # system, two turns of user and assistant
    assert listed[ctx]["tokens"] == r2.usage.prompt_tokens + r2.usage.completion_tokens - 1
    status, _, d = server.request("GET", f"/v1/contexts/{ctx}")
    assert status == 200 and d == listed[ctx]
    status, _, d = server.request("DELETE", f"/v1/contexts/{ctx}")
    assert status == 200 and d == {"id": ctx, "object": "context", "deleted": True}
    assert ctx not in {d["id"] for d in server.request("GET", "/v1/contexts")[2]["data"]}
    for method, path, body in (
        ("POST", CHAT, chat_body(FRANCE, context_id=ctx)),
        ("GET", f"/v1/contexts/{ctx}", None),
        ("DELETE", f"/v1/contexts/{ctx}", None),
    ):
        status, _, data = server.request(method, path, body)
        assert_api_error(status, data, 404, ctx)


def test_explicit_context_raw_completion_appends(server):
    ctx = server.request("POST", "/v1/contexts", {})[2]["id"]
    s1, _, a = server.request(
        "POST",
        "/v1/completions",
        {"prompt": "The capital of France is", "max_tokens": 4, "temperature": 0, "context_id": ctx},
    )
    assert s1 == 200 and a["choices"][0]["text"].startswith(" Paris"), a
    s2, _, b = server.request(
        "POST",
        "/v1/completions",
        {"prompt": " The capital of Italy is", "max_tokens": 4, "temperature": 0, "context_id": ctx},
    )
    assert s2 == 200 and b["usage"]["prompt_tokens_details"]["cached_tokens"] > 0, b
    assert server.request("DELETE", f"/v1/contexts/{ctx}")[0] == 200


# ---- 5. API keys -----------------------------------------------------------------------------------
def test_api_keys_required(keyed):
    assert keyed.healthy()  # /health answers without a key
    for key in (None, "wrong", ""):
        for method, path, body in (
            ("POST", CHAT, chat_body(FRANCE)),
            ("GET", "/v1/models", None),
            ("GET", "/v1/contexts", None),
            ("POST", "/v1/contexts", {}),
            ("GET", "/v1/stats", None),
        ):
            status, _, data = keyed.request(method, path, body, key=key)
            err = assert_api_error(status, data, 401, "API key")
            assert err["type"] == "authentication_error"
    openai = pytest.importorskip("openai")
    bad = openai.OpenAI(base_url=keyed.base + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.chat.completions.create(model=keyed.model, messages=FRANCE, max_tokens=4)
    good = openai.OpenAI(base_url=keyed.base + "/v1", api_key="k2", max_retries=0, timeout=120)
    assert [m.id for m in good.models.list().data] == [keyed.model]


def test_api_keys_scope_explicit_contexts(keyed):
    status, _, data = keyed.request("POST", "/v1/contexts", {"system": "You are a helpful assistant."}, key="k1")
    assert status == 200
    ctx = data["id"]
    assert ctx in {d["id"] for d in keyed.request("GET", "/v1/contexts", key="k1")[2]["data"]}
    assert ctx not in {d["id"] for d in keyed.request("GET", "/v1/contexts", key="k2")[2]["data"]}
    for method, path, body, headers in (
        ("GET", f"/v1/contexts/{ctx}", None, {}),
        ("DELETE", f"/v1/contexts/{ctx}", None, {}),
        ("POST", CHAT, chat_body(FRANCE, context_id=ctx), {}),
        ("POST", CHAT, chat_body(FRANCE), {"X-Context-Id": ctx}),
    ):
        status, _, data = keyed.request(method, path, body, headers, key="k2")
        assert_api_error(status, data, 404, "no context")
    status, _, data = keyed.request("POST", CHAT, chat_body(FRANCE, context_id=ctx), key="k1")
    assert status == 200 and "Paris" in data["choices"][0]["message"]["content"]
    assert keyed.request("GET", f"/v1/contexts/{ctx}", key="k1")[2]["messages"] == 3  # k2 changed nothing
    assert keyed.request("DELETE", f"/v1/contexts/{ctx}", key="k1")[0] == 200


def test_api_keys_scope_prefix_matching(keyed):
    body = chat_body([{"role": "user", "content": "What is the capital of Spain?"}], max_tokens=8)
    s1, h1, a = keyed.request("POST", CHAT, body, key="k1")
    s2, h2, b = keyed.request("POST", CHAT, body, key="k1")
    assert s1 == s2 == 200
    assert b["usage"]["prompt_tokens_details"]["cached_tokens"] > 0  # k1's own context is matched
    s3, h3, c = keyed.request("POST", CHAT, body, key="k2")
    assert s3 == 200 and c["usage"]["prompt_tokens_details"]["cached_tokens"] == 0, c
    assert h3["X-Context-Id"] not in (h1["X-Context-Id"], h2["X-Context-Id"])
    assert c["choices"][0]["message"]["content"] == a["choices"][0]["message"]["content"]
    k1 = {d["id"] for d in keyed.request("GET", "/v1/contexts", key="k1")[2]["data"]}
    k2 = {d["id"] for d in keyed.request("GET", "/v1/contexts", key="k2")[2]["data"]}
    assert h3["X-Context-Id"] in k2 and not k1 & k2


def test_one_keys_flood_neither_fills_the_queue_nor_delays_the_other_key(store_dir, tmp_path):
    """Two keys, one request running at a time, 8 waiting in all (4 per key): k1 sends 7 at once, its
    6th and 7th are refused with 429 (its quota) while the queue has room; k2's request, sent after,
    starts as soon as the running one ends, ahead of k1's waiting ones."""
    srv = start(
        store_dir,
        str(tmp_path),
        "--api-key",
        "k1",
        "--api-key",
        "k2",
        "--max-batch",
        "1",
        "--queue-limit",
        "8",
        key="k1",
    )
    try:
        done, lock = [], threading.Lock()

        def send(key, tag):
            status, _, data = srv.request("POST", CHAT, chat_body(FRANCE, max_tokens=24), key=key)
            with lock:
                done.append((tag, status, data))

        flood = [threading.Thread(target=send, args=("k1", f"k1-{i}")) for i in range(7)]
        for t in flood:
            t.start()
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and len([d for d in done if d[1] == 429]) < 2:
            time.sleep(0.05)
        other = threading.Thread(target=send, args=("k2", "k2"))
        other.start()
        for t in flood + [other]:
            t.join(300)
        refused = [d for d in done if d[1] == 429]
        # 2 refused, or 3 if the first had not started when the others were counted
        assert len(refused) in (2, 3) and all(d[2]["error"]["code"] == "key_queue_full" for d in refused), done
        served = [tag for tag, status, _ in done if status == 200]
        assert len(served) == 8 - len(refused) and served.index("k2") <= 1, served  # after the running one at most
    finally:
        stop(srv)


# ---- 6. concurrency --------------------------------------------------------------------------------
WORDS = ["banana", "river", "orange", "tiger", "pencil", "cloud", "silver", "garden"]


def test_concurrent_streaming_clients(server):
    openai = pytest.importorskip("openai")
    deadline = time.monotonic() + SOAK_S
    results = {w: [] for w in WORDS}  # per word: (id, text, completion_tokens, chunks)
    errors = []
    start = threading.Barrier(len(WORDS))

    def client_loop(word):
        cl = openai.OpenAI(base_url=server.base + "/v1", api_key="unused", max_retries=0, timeout=300)
        start.wait()
        try:
            while time.monotonic() < deadline:
                stream = cl.chat.completions.create(
                    model=server.model,
                    messages=[{"role": "user", "content": f"Repeat the word {word}."}],
                    temperature=0,
                    max_tokens=6,
                    stream=True,
                    stream_options={"include_usage": True},
                )
                chunks = list(stream)
                ids = {c.id for c in chunks}
                if len(ids) != 1:
                    errors.append(f"{word}: ids {ids} within one stream")
                text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
                n = sum(1 for c in chunks if c.choices)
                use = chunks[-1].usage
                results[word].append((chunks[0].id, text, use.completion_tokens if use else None, n))
        except Exception as e:  # noqa: BLE001 - every failure is reported
            errors.append(f"{word}: {type(e).__name__}: {e}")

    t0 = time.monotonic()
    threads = [threading.Thread(target=client_loop, args=(w,), daemon=True) for w in WORDS]
    for t in threads:
        t.start()
    for t in threads:
        t.join(SOAK_S + 300)
    elapsed = time.monotonic() - t0
    assert not any(t.is_alive() for t in threads), "a client hung"
    assert not errors, errors
    done = sum(len(r) for r in results.values())
    all_ids = [rid for r in results.values() for rid, *_ in r]
    assert len(set(all_ids)) == len(all_ids), "a response id was reused across streams"
    for word, runs in results.items():
        assert runs, f"the {word} client completed no request"
        for rid, text, used, n in runs:
            assert word in text.lower(), (word, text)
            assert used == n, (word, text, used, n)  # every token of this stream came to this stream
        print(f"  {word}: {len(runs)} requests, {len({t for _, t, _, _ in runs})} distinct text(s): {runs[0][1]!r}")
    st = server.stats()
    peak = vm_hwm(server.proc.pid)
    limit = st["memory"]["limit"]
    print(
        f"\nconcurrency: {done} streaming requests from {len(WORDS)} clients in {elapsed:.1f} s; "
        f"server peak RSS {peak / 2**20:.1f} MiB (limit {limit / 2**20:.1f} MiB); "
        f"{st['contexts']['total']} contexts ({st['contexts']['swapped']} swapped), "
        f"chunks written {st['kv']['chunks_written']}, read {st['kv']['chunks_read']}, "
        f"recomputed {st['kv']['chunks_recomputed']}"
    )
    assert limit and peak < limit
    assert st["queue"]["waiting"] == 0 and st["kv"]["bad_swap_files"] == 0
    assert server.healthy()


@pytest.mark.full  # ~25 s; forks and eviction in one process: tests/service/test_service.py
def test_answers_survive_forks_and_eviction(store_dir, tmp_path):
    """Stateless clients asking the same questions in turn: each request forks the last context of
    its question, the 10-chunk pool (8 MB) fills, chunks of other contexts are evicted, read back and
    their slots reused, so a context's chunks sit in scattered slots; every greedy answer stays the
    first answer to its own question (no other context's KV is read or overwritten)."""
    srv = start(store_dir, str(tmp_path), kv_budget="8MB")
    try:
        for _ in range(4):
            status, _, data = srv.request("POST", CHAT, chat_body(FRANCE))
            assert status == 200 and "Paris" in data["choices"][0]["message"]["content"]
        first = {}
        for turn in range(2):
            for word in WORDS:
                status, _, data = srv.request(
                    "POST", CHAT, chat_body([{"role": "user", "content": f"Repeat the word {word}."}], max_tokens=6)
                )
                assert status == 200, data
                text = data["choices"][0]["message"]["content"]
                assert text == first.setdefault(word, text), (turn, word, text, first[word])
        st = srv.stats()
        assert st["kv"]["slots_free"] == 0 and st["kv"]["chunks_written"] > 0, st["kv"]  # eviction happened
    finally:
        stop(srv)


# ---- 7. a client that disconnects mid-stream ---------------------------------------------------------
def test_client_disconnect_mid_stream(server):
    body = chat_body(
        [{"role": "user", "content": "Write a very long story about a dragon and a knight."}],
        max_tokens=400,
        stream=True,
    )
    conn = http.client.HTTPConnection(HOST, server.port, timeout=120)
    conn.request("POST", CHAT, body=json.dumps(body), headers={"Content-Type": "application/json"})
    r = conn.getresponse()
    assert r.status == 200
    ctx = r.headers["X-Context-Id"]
    line = r.readline()  # the first event (chunked transfer decoded)
    assert line.startswith(b"data: "), line
    conn.sock.shutdown(socket.SHUT_RDWR)
    conn.close()
    t0 = time.monotonic()
    while True:  # /v1/stats waits for the engine: it answers once the generation has stopped
        st = server.stats()
        if not st["queue"]["busy"] or time.monotonic() - t0 > 30:
            break
        time.sleep(0.1)
    waited = time.monotonic() - t0
    assert not st["queue"]["busy"], st["queue"]
    assert st["sparsity"]["level"] == 0.0 and st["sparsity"]["rows"] == 0  # off: nothing thresholded
    status, _, d = server.request("GET", f"/v1/contexts/{ctx}")
    assert status == 200
    print(f"\ndisconnect: the engine was free {waited:.2f} s later; the context kept {d['tokens']} tokens")
    assert d["tokens"] < 150, d  # stopped long before max_tokens=400
    status, _, data = server.request("POST", CHAT, chat_body(FRANCE))
    assert status == 200 and "Paris" in data["choices"][0]["message"]["content"]
    assert server.healthy()
    # An ordinary end: one line on the server's stderr naming the context and the tokens sent, no traceback.
    log = server.log_text()
    assert "Traceback" not in log, log[-4000:]
    lines = [ln for ln in log.splitlines() if "client disconnected" in ln and ctx in ln]
    assert len(lines) == 1 and "tokens sent" in lines[0], log[-4000:]
    sent = int(lines[0].split(" after ")[1].split()[0])
    # the prompt's length (a call that generates one token says it): the context holds it and what was generated
    status, _, one = server.request("POST", CHAT, {**body, "stream": False, "max_tokens": 1})
    generated = d["tokens"] - one["usage"]["prompt_tokens"]
    print(f"disconnect: {sent} tokens sent, {generated} generated into the context")
    assert 1 <= sent <= generated, (lines[0], d, one["usage"])


# ---- exactness through the server --------------------------------------------------------------------
@pytest.mark.parametrize("stateless", [False, pytest.param(True, marks=pytest.mark.full)])  # True: ~20 s more
def test_three_turns_through_the_server_equal_one_run(server, client, engines, store_dir, stateless):
    """Three turns (an explicit context given only the new turn, or a stateless client re-sending the
    growing history) give the answers one engine run over the whole conversation gives (MLX, as the
    server runs it), and the later turns reuse the held prefix."""
    engine = engines(store_dir, "mlx")
    turns = ["What is the capital of France?", "And of Germany?", "Name a river that flows through it."]
    history, ctx = [], None
    if not stateless:
        status, _, made = server.request("POST", "/v1/contexts", {})
        assert status == 200, made
        ctx = made["id"]
    for k, t in enumerate(turns):
        history.append({"role": "user", "content": t})
        body = chat_body(history if stateless else [history[-1]], max_tokens=16)
        out = client.chat.completions.create(
            model=server.model, extra_body={"context_id": ctx} if ctx else None, **body
        )
        text = out.choices[0].message.content
        assert text == engine.generate(history, max_tokens=16), (k, text)
        cached = out.usage.prompt_tokens_details.cached_tokens
        # later turns reuse what the context holds (a stateless first turn may already share the
        # default system prompt's whole chunks with another conversation: a fork)
        assert cached > 0 if k else (stateless or cached == 0), (k, cached)
        history.append({"role": "assistant", "content": text})


@pytest.mark.full  # ~15 s: two server processes; contexts read back from disk: tests/service/test_faults.py
def test_contexts_survive_a_server_restart(store_dir, tmp_path, engines):
    """A conversation held by an explicit context, the server stopped (SIGTERM: it writes its
    chunks) and started again on the same directory: the context is listed, its next turn reuses
    every token it held (cached_tokens) and answers as one engine run over the conversation."""
    engine = engines(store_dir, "mlx")
    srv = start(store_dir, str(tmp_path))
    status, _, made = srv.request("POST", "/v1/contexts", {})
    ctx = made["id"]
    history = [{"role": "user", "content": "What is the capital of France?"}]
    status, _, out = srv.request("POST", "/v1/chat/completions", {**chat_body(history[-1:]), "context_id": ctx})
    assert status == 200, out
    history.append({"role": "assistant", "content": out["choices"][0]["message"]["content"]})
    held = next(c["tokens"] for c in srv.request("GET", "/v1/contexts")[2]["data"] if c["id"] == ctx)
    assert stop(srv) == 0
    srv = start(store_dir, str(tmp_path))
    try:
        listed = {c["id"]: c for c in srv.request("GET", "/v1/contexts")[2]["data"]}
        assert ctx in listed and listed[ctx]["tokens"] == held and listed[ctx]["chunks_in_memory"] == 0
        history.append({"role": "user", "content": "And of Germany?"})
        status, _, out = srv.request("POST", "/v1/chat/completions", {**chat_body(history[-1:]), "context_id": ctx})
        assert status == 200, out
        assert out["choices"][0]["message"]["content"] == engine.generate(history, max_tokens=20)
        assert out["usage"]["prompt_tokens_details"]["cached_tokens"] == held
    finally:
        stop(srv)
