"""`nonstop serve` against a new user's mistakes, as real processes: a model path that is not
there, a hub id with no network (a hub that refuses, or one that accepts and never answers, on
127.0.0.1), Ctrl-C while it waits, an empty API key in the environment. Each is one clear line and
an exit status, never a traceback or a hang; the hub lookup is the one `nonstop train` makes
(config/preflight.py)."""

from __future__ import annotations

import contextlib
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import pytest

from support import child_env


def _serve(cwd, *args: str, **env: str) -> subprocess.Popen:
    base = child_env(PYTHONUNBUFFERED="1", COLUMNS="300", HF_HUB_OFFLINE="0", HF_HOME=str(cwd / "hf-home"))
    base.pop("NONSTOP_API_KEY", None)
    base.update(env)
    return subprocess.Popen(
        [sys.executable, "-m", "nonstop.cli", "serve", "--port", "0", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=base,
        cwd=cwd,
        # a shell that starts these tests in the background (`cmd &`) ignores SIGINT, and a child
        # would inherit that: serve must see Ctrl-C as a terminal sends it
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )


@contextlib.contextmanager
def silent_hub() -> Iterator[tuple[str, threading.Event]]:
    """A hub endpoint on 127.0.0.1 that accepts connections and never answers (a stuck proxy);
    yields its URL and an event set once a client has connected."""
    connected, done = threading.Event(), threading.Event()
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(16)
        server.settimeout(0.2)
        held: list[socket.socket] = []

        def accept() -> None:
            while not done.is_set():
                try:
                    held.append(server.accept()[0])
                    connected.set()
                except TimeoutError:
                    continue

        t = threading.Thread(target=accept, name="silent-hub", daemon=True)
        t.start()
        try:
            yield f"http://127.0.0.1:{server.getsockname()[1]}", connected
        finally:
            done.set()
            t.join(5)
            for c in held:
                c.close()


def _one_clear_line(out: str, words: str) -> None:
    assert words in out and "Traceback" not in out, out
    assert len([line for line in out.splitlines() if line.strip()]) == 1, out


@pytest.mark.parametrize(
    "model, words",
    [
        ("/no/such/dir", "--model: no such folder: /no/such/dir"),
        ("empty", "holds no config.json (empty)"),
        ("weights.bin", "is a file; expected a model folder"),
        ("step_00000100", "is a checkpoint folder; its weights are in"),
    ],
)
def test_a_model_path_that_is_not_a_model_is_one_line(tmp_path, model, words):
    if model == "empty":
        (tmp_path / model).mkdir()
    elif model == "weights.bin":
        (tmp_path / model).write_bytes(b"\0")
    elif model.startswith("step_"):
        (tmp_path / model / "model").mkdir(parents=True)
        (tmp_path / model / "model" / "config.json").write_text("{}")
    proc = _serve(tmp_path, "--model", model)
    out = proc.communicate(timeout=120)[0]
    assert proc.returncode == 2
    _one_clear_line(out, words)


def test_hub_id_refused_by_the_network_is_one_line(tmp_path):
    with socket.socket() as closed:  # a port nothing listens on: connection refused
        closed.bind(("127.0.0.1", 0))
        endpoint = f"http://127.0.0.1:{closed.getsockname()[1]}"
    proc = _serve(tmp_path, "--model", "someorg/some-model", HF_ENDPOINT=endpoint)
    out = proc.communicate(timeout=120)[0]
    assert proc.returncode == 2
    _one_clear_line(out, "--model: 'someorg/some-model' is not a local folder and could not be fetched")


def test_hub_id_with_a_silent_hub_stops_on_ctrl_c(tmp_path):
    with silent_hub() as (endpoint, connected):
        proc = _serve(tmp_path, "--model", "someorg/some-model", HF_ENDPOINT=endpoint)
        try:
            assert connected.wait(60), "serve never asked the hub"
            proc.send_signal(signal.SIGINT)
            t0 = time.perf_counter()
            out = proc.communicate(timeout=30)[0]
            stopped_s = time.perf_counter() - t0
        finally:
            if proc.poll() is None:
                proc.kill()
    assert proc.returncode == 130, out
    _one_clear_line(out, "interrupted")
    print(f"stopped {stopped_s:.2f} s after SIGINT")
    assert stopped_s < 5, stopped_s  # measured 0.28 s; the bound leaves room for a loaded machine


@pytest.mark.slow  # waits out the hub bound (15 s)
def test_hub_id_with_a_silent_hub_gives_up_with_one_line(tmp_path):
    with silent_hub() as (endpoint, _):
        t0 = time.perf_counter()
        proc = _serve(tmp_path, "--model", "someorg/some-model", HF_ENDPOINT=endpoint)
        out = proc.communicate(timeout=120)[0]
        took_s = time.perf_counter() - t0
    assert proc.returncode == 2
    _one_clear_line(out, "(no answer within 15 s)")
    assert took_s < 25, took_s  # 15 s of waiting and the start-up; measured 16.5 s


def test_empty_api_key_in_the_environment_is_refused(tmp_path):
    proc = _serve(tmp_path, NONSTOP_API_KEY="")
    out = proc.communicate(timeout=120)[0]
    assert proc.returncode == 2 and "empty key" in out and "NONSTOP_API_KEY" in out and "Traceback" not in out, out


def test_ctrl_c_stops_serving_promptly_while_a_client_stalls_mid_body(tmp_path):
    """A client that sent its headers and part of its body holds a handler reading it; Ctrl-C must
    not wait for that client (aiohttp's default shutdown waited 60 s for it)."""
    proc = _serve(tmp_path)
    try:
        line = ""
        for line in proc.stdout:
            if line.startswith("serving '"):
                break
        port = int(line.split("http://127.0.0.1:")[1].split(" ")[0])
        with socket.create_connection(("127.0.0.1", port)) as stalled:
            stalled.sendall(
                b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                b'Content-Length: 100\r\n\r\n{"prompt":'
            )
            with socket.create_connection(("127.0.0.1", port)) as probe:  # answered: the server is reading
                probe.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")
                assert probe.recv(64).startswith(b"HTTP/1.1 200"), "serve did not answer /health"
            time.sleep(0.2)  # the stalled request's handler is waiting on its body
            proc.send_signal(signal.SIGINT)
            t0 = time.perf_counter()
            out = proc.communicate(timeout=60)[0]
            stopped_s = time.perf_counter() - t0
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0 and "Traceback" not in out, out
    print(f"stopped {stopped_s:.2f} s after SIGINT")
    # about 1 s alone on a 2-core machine, most of it the process's exit; 3.9 s once in a full CI run.
    # The bound is what the test is for: not aiohttp's 60 s wait for the stalled client.
    assert stopped_s < 10, stopped_s
