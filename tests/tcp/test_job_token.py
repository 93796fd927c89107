"""Let no one in by default: tokens of a useful length, a warning for exposed listeners without
one, a pre-authentication cap on what the store client reads, and a random token per colls-run job.

Everything listens on loopback only: the warning for an exposed listener is checked through the
function that decides (given non-loopback address strings, never bound) and, for the real store
and mesh, by making that function answer "exposed" for their loopback listeners.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import socket
import subprocess
import sys
import threading
import time
import warnings
from pathlib import Path

import numpy as np
import pytest
from _support import on_threads
from sec_helpers import backend

from colls import auth, dtypes
from colls.errors import NetworkError, StoreError
from colls.reduce_ops import ReduceOp, resolve_op
from colls.run.cli import parse_config
from colls.run.config import LaunchConfig, job_token
from colls.run.processes import worker_env
from colls.store import HashStore, TCPStore, _wire
from colls.store._wire import Status

HERE = Path(__file__).resolve().parent
REPO_ROOT = HERE.parents[1]
TOKEN = "sixteen bytes ok"  # exactly MIN_TOKEN_BYTES


@pytest.fixture
def fresh_warnings(monkeypatch):
    """Forget which listeners were warned about, so each test sees its own first warning."""
    monkeypatch.setattr(auth, "_WARNED", set())


def _exposed(caught: list[warnings.WarningMessage]) -> list[str]:
    return [str(w.message) for w in caught if issubclass(w.category,
                                                         auth.ExposedWithoutTokenWarning)]


# -- tokens shorter than 16 bytes -----------------------------------------------------------------


@pytest.mark.timeout(60)
def test_a_short_token_argument_is_refused_naming_the_argument():
    with pytest.raises(ValueError, match="auth_token must be at least 16 bytes, got 15"):
        TCPStore("127.0.0.1", 0, is_master=True, timeout=5, auth_token=TOKEN[:-1])


@pytest.mark.timeout(60)
def test_a_short_token_in_the_environment_is_refused_naming_the_variable(monkeypatch):
    monkeypatch.setenv("COLLS_AUTH_TOKEN", "tok")
    with pytest.raises(ValueError, match="COLLS_AUTH_TOKEN must be at least 16 bytes, got 3"):
        TCPStore("127.0.0.1", 0, is_master=True, timeout=5)
    store = HashStore()
    with pytest.raises(ValueError, match="auth_token must be at least 16 bytes, got 5"):
        backend(store, 0, 2, token="short")


@pytest.mark.timeout(60)
def test_a_token_of_sixteen_bytes_authenticates(monkeypatch):
    monkeypatch.delenv("COLLS_AUTH_TOKEN", raising=False)
    with TCPStore("127.0.0.1", 0, is_master=True, timeout=5, auth_token=TOKEN) as master:
        with TCPStore("127.0.0.1", master.port, timeout=5, auth_token=TOKEN) as client:
            client.set("k", b"v")
            assert master.get("k") == b"v"
        with pytest.raises(StoreError, match="authentication required"):
            TCPStore("127.0.0.1", master.port, timeout=5)


# -- the warning for a listener other hosts can reach ----------------------------------------------


@pytest.mark.parametrize(("host", "exposed"), [
    ("10.1.2.3", True), ("0.0.0.0", True), ("::", True), ("fe80::1%eth0", True),
    ("192.168.0.7", True), ("2001:db8::5", True),
    ("127.0.0.1", False), ("127.8.9.10", False), ("::1", False), ("::ffff:127.0.0.1", False),
])
def test_which_addresses_need_a_token(host, exposed):
    assert auth.exposed_without_token(host, None) is exposed
    assert auth.exposed_without_token(host, TOKEN.encode()) is False


def test_an_exposed_listener_warns_once_naming_the_address_and_the_variable(fresh_warnings):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert auth.warn_if_exposed("TCPStore", "10.1.2.3", 29500, None)
        assert not auth.warn_if_exposed("TCPStore", "10.1.2.3", 29501, None)  # once
        assert not auth.warn_if_exposed("TCPStore", "127.0.0.1", 29500, None)
        assert not auth.warn_if_exposed("TCPStore", "10.9.9.9", 29500, TOKEN.encode())
        assert auth.warn_if_exposed("tcp peer listener", "::", 4000, None)
    messages = _exposed(caught)
    assert len(messages) == 2, messages
    assert messages[0].startswith("TCPStore listens on 10.1.2.3:29500, which other hosts can "
                                  "reach, without authentication"), messages[0]
    assert "COLLS_AUTH_TOKEN" in messages[0]
    assert messages[1].startswith("tcp peer listener listens on [::]:4000"), messages[1]


@pytest.mark.timeout(60)
def test_a_loopback_store_without_a_token_does_not_warn(fresh_warnings, monkeypatch):
    monkeypatch.delenv("COLLS_AUTH_TOKEN", raising=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        TCPStore("127.0.0.1", 0, is_master=True, timeout=5).close()
    assert _exposed(caught) == []


def _decide_exposed(monkeypatch) -> list[tuple[str, bytes | None]]:
    """Make the deciding function call every listener exposed; return what it was asked."""
    asked: list[tuple[str, bytes | None]] = []

    def exposed(host: str, token: bytes | None) -> bool:
        asked.append((host, token))
        return token is None

    monkeypatch.setattr(auth, "exposed_without_token", exposed)
    return asked


@pytest.mark.timeout(60)
def test_the_store_server_asks_about_its_bound_address_and_warns(fresh_warnings, monkeypatch):
    monkeypatch.delenv("COLLS_AUTH_TOKEN", raising=False)
    asked = _decide_exposed(monkeypatch)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with TCPStore("127.0.0.1", 0, is_master=True, timeout=5) as store:
            port = store.port
        TCPStore("127.0.0.1", 0, is_master=True, timeout=5, auth_token=TOKEN).close()
    assert asked == [("127.0.0.1", None), ("127.0.0.1", TOKEN.encode())]
    messages = _exposed(caught)
    assert len(messages) == 1, messages
    assert f"TCPStore listens on 127.0.0.1:{port}" in messages[0]
    assert "COLLS_AUTH_TOKEN" in messages[0]


@pytest.mark.timeout(60)
def test_the_mesh_listeners_warn_once_and_the_group_still_works(fresh_warnings, monkeypatch):
    """Two ranks (threads of this process) without a token: one warning, a working group."""
    monkeypatch.delenv("COLLS_AUTH_TOKEN", raising=False)
    monkeypatch.setenv("COLLS_SHM", "0")
    asked = _decide_exposed(monkeypatch)
    store = HashStore()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        backends = on_threads(lambda r: backend(store, r, 2, name="warned"), 2,
                              errors_as_results=True)
    try:
        assert not any(isinstance(b, BaseException) for b in backends), backends
        assert [host for host, _ in asked] == ["127.0.0.1", "127.0.0.1"]
        messages = _exposed(caught)
        assert len(messages) == 1, messages
        assert re.match(r"tcp peer listener listens on 127\.0\.0\.1:\d+, which other hosts",
                        messages[0]), messages[0]
        arrays = [np.full(3, r + 1.0) for r in range(2)]
        total = resolve_op(ReduceOp.SUM, dtypes.FLOAT64, op_name="all_reduce")
        on_threads(lambda r: backends[r].all_reduce(arrays[r], total, -1), 2)
        assert [a.tolist() for a in arrays] == [[3.0] * 3, [3.0] * 3]
    finally:
        for b in backends:
            if not isinstance(b, BaseException):
                b.close()


# -- the store client's cap before the server has proved itself -----------------------------------


def _liar(announced: int) -> tuple[socket.socket, threading.Thread]:
    """Listen on loopback; answer the first frame of one client with a header announcing
    ``announced`` payload bytes, then hold the connection open without sending them."""
    listener = socket.create_server(("127.0.0.1", 0))

    def serve() -> None:
        conn, _ = listener.accept()
        with conn:
            conn.recv(4096)
            conn.sendall(_wire.HEADER.pack(_wire.MAGIC, _wire.VERSION, Status.OK, announced))
            time.sleep(10)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    return listener, thread


@pytest.mark.timeout(60)
@pytest.mark.parametrize("token", [TOKEN, None])
def test_the_client_reads_the_auth_reply_with_the_pre_auth_cap(token, monkeypatch):
    """A server announcing 1 GiB in its reply to AUTH (or PING) is refused at the header."""
    monkeypatch.delenv("COLLS_AUTH_TOKEN", raising=False)
    listener, thread = _liar(1 << 30)
    start = time.monotonic()
    try:
        with pytest.raises(NetworkError, match=(
                "connection lost during authentication .*payload length 1073741824 exceeds the "
                f"limit of {_wire.MAX_PREAUTH_PAYLOAD_BYTES} bytes")):
            TCPStore("127.0.0.1", listener.getsockname()[1], timeout=30, auth_token=token)
        assert time.monotonic() - start < 10.0, "refused at the header, not after a read"
    finally:
        listener.close()


# -- colls-run makes a token per job ---------------------------------------------------------------


def test_job_token_is_random_per_job_and_yields_to_the_user():
    first, second = job_token(1, {}), job_token(1, {})
    assert re.fullmatch(r"[0-9a-f]{64}", first) and first != second
    assert job_token(1, {"COLLS_AUTH_TOKEN": "the user's token, 25 bytes"}) == ""
    assert job_token(1, {"COLLS_AUTH_TOKEN": ""}) == ""  # explicitly off
    assert job_token(2, {}) == ""  # other nodes' launchers could not know it


def test_workers_get_the_job_token_unless_the_user_set_one(tmp_path):
    script = tmp_path / "a.py"
    script.write_text("")
    parsed = parse_config(["--nproc-per-node", "2", str(script)])
    config = dataclasses.replace(parsed, store_port=4001)  # as WorkerGroup has bound it
    assert re.fullmatch(r"[0-9a-f]{64}", config.auth_token)
    assert config.auth_token not in repr(config)
    envs = [worker_env(config, r, "/e", base={}) for r in range(2)]
    assert [e["COLLS_AUTH_TOKEN"] for e in envs] == [config.auth_token] * 2
    mine = {"COLLS_AUTH_TOKEN": "the user's token, 25 bytes"}
    assert worker_env(config, 0, "/e", base=mine)["COLLS_AUTH_TOKEN"] == mine["COLLS_AUTH_TOKEN"]
    assert "COLLS_AUTH_TOKEN" not in worker_env(LaunchConfig(str(script)), 0, "/e", base={})


@pytest.mark.timeout(120)
def test_a_colls_run_job_is_authenticated_by_default(tmp_path, monkeypatch):
    monkeypatch.delenv("COLLS_AUTH_TOKEN", raising=False)
    env = {k: v for k, v in os.environ.items() if k != "COLLS_AUTH_TOKEN"}
    env["PYTHONPATH"] = str(REPO_ROOT)
    done = subprocess.run(
        [sys.executable, "-m", "colls.run", "--nproc-per-node", "2", str(HERE / "token_job.py"),
         str(tmp_path)],
        env=env, capture_output=True, text=True, timeout=90, check=False)
    assert done.returncode == 0, done.stderr
    reports = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    tokens = {r["token"] for r in reports}
    assert len(tokens) == 1 and re.fullmatch(r"[0-9a-f]{64}", tokens.pop()), reports
    assert all(r["sum"] == [3.0] * 4 for r in reports), reports
    assert "authentication required" in reports[0]["refused"], reports[0]
