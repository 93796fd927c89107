"""TCPStore authentication: HMAC challenge-response with a shared token (colls.auth).

A client with the right token is served; a wrong or missing token is refused with a clear
StoreError on the client, logged by the server, and nothing it sent is executed.
"""

from __future__ import annotations

import logging
import socket
import threading

import pytest

from colls.errors import StoreError, StoreTimeoutError
from colls.store import TCPStore, _wire
from colls.store._wire import Command, Status
from colls.testing.spawn import free_port

TOKEN = "correct horse battery staple"
#: Another token, long enough to be accepted.
WRONG = "not the token, but long enough"


@pytest.fixture
def master():
    store = TCPStore("127.0.0.1", 0, is_master=True, timeout=5, auth_token=TOKEN)
    yield store
    store.close()


def _raw_reply(sock: socket.socket) -> tuple[int, list[bytes]]:
    header = b""
    while len(header) < _wire.HEADER.size:
        chunk = sock.recv(_wire.HEADER.size - len(header))
        assert chunk, "server closed before replying"
        header += chunk
    status, length = _wire.decode_header(header)
    body = b""
    while len(body) < length:
        body += sock.recv(length - len(body))
    return status, _wire.decode_fields(body)


@pytest.mark.timeout(60)
def test_clients_with_the_token_are_served(master):
    with TCPStore("127.0.0.1", master.port, timeout=5, auth_token=TOKEN) as client:
        client.set("k", b"v")
        assert master.get("k") == b"v"
        assert client.add("n", 2) == 2


@pytest.mark.timeout(60)
def test_token_comes_from_the_environment(master, monkeypatch):
    monkeypatch.setenv("COLLS_AUTH_TOKEN", TOKEN)
    with TCPStore("127.0.0.1", master.port, timeout=5) as client:
        client.set("env", b"ok")
    assert master.get("env") == b"ok"


@pytest.mark.timeout(60)
def test_wrong_token_is_refused_and_logged(master, caplog):
    caplog.set_level(logging.WARNING, logger="colls.store")
    with pytest.raises(StoreError, match="could not prove it knows COLLS_AUTH_TOKEN"):
        TCPStore("127.0.0.1", master.port, timeout=5, auth_token=WRONG)
    assert not master.check(["__colls_store__/join/count"])


@pytest.mark.timeout(60)
def test_missing_token_is_refused_with_a_clear_error_and_logged(master, caplog, monkeypatch):
    monkeypatch.delenv("COLLS_AUTH_TOKEN", raising=False)
    caplog.set_level(logging.WARNING, logger="colls.store")
    with pytest.raises(StoreError, match="authentication required"):
        TCPStore("127.0.0.1", master.port, world_size=2, timeout=5)
    assert "refused connection from 127.0.0.1" in caplog.text
    assert "authentication required" in caplog.text


@pytest.mark.timeout(60)
def test_a_client_token_against_a_server_without_one_is_an_error(monkeypatch):
    monkeypatch.delenv("COLLS_AUTH_TOKEN", raising=False)
    with TCPStore("127.0.0.1", 0, is_master=True, timeout=5) as open_master:
        with pytest.raises(StoreError, match="no auth token but the client sent one"):
            TCPStore("127.0.0.1", open_master.port, timeout=5, auth_token=TOKEN)


@pytest.mark.timeout(60)
def test_the_job_does_not_start_with_a_wrong_token():
    port = free_port()
    outcome: list[BaseException] = []

    def run_master() -> None:
        try:
            TCPStore("127.0.0.1", port, world_size=2, is_master=True, timeout=2.0,
                     auth_token=TOKEN).close()
        except BaseException as exc:  # noqa: BLE001 - checked by the test thread
            outcome.append(exc)

    thread = threading.Thread(target=run_master, daemon=True)
    thread.start()
    with pytest.raises(StoreError, match="could not prove it knows COLLS_AUTH_TOKEN"):
        TCPStore("127.0.0.1", port, world_size=2, timeout=2.0, auth_token=WRONG)
    thread.join(30)
    assert len(outcome) == 1 and isinstance(outcome[0], StoreTimeoutError), outcome
    assert "only 1 of world_size=2 clients joined" in str(outcome[0])


@pytest.mark.timeout(60)
def test_unauthenticated_request_bytes_are_never_executed(master):
    with socket.create_connection(("127.0.0.1", master.port), timeout=5) as sock:
        sock.sendall(_wire.encode_frame(Command.SET, [b"pwned", b"1"]))
        status, fields = _raw_reply(sock)
        assert status == Status.ERROR
        assert b"authentication required" in fields[0]
        assert sock.recv(1) == b""  # and the connection is closed
    assert not master.check(["pwned"])


@pytest.mark.timeout(60)
def test_a_replayed_proof_does_not_authenticate(master):
    """A proof is bound to both nonces: one recorded on another connection is useless."""
    with socket.create_connection(("127.0.0.1", master.port), timeout=5) as sock:
        sock.sendall(_wire.encode_frame(Command.AUTH, [b"\0" * 32]))
        status, _ = _raw_reply(sock)
        assert status == Status.OK
        sock.sendall(_wire.encode_frame(Command.AUTH_PROOF, [b"\1" * 32]))
        status, fields = _raw_reply(sock)
        assert status == Status.ERROR and b"authentication failed" in fields[0]
