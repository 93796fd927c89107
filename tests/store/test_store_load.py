"""TCPStore under load: 1,000 concurrent clients (threads of this process) doing set/get/add/wait.

Every client has its own store object and connection; its ``get`` and ``wait`` block on keys
other clients set, so parked requests and wake-ups are exercised at scale. The timing against
torch's TCPStore is in benchmarks/bench_store_load.py (docs/reliability.md has the figures).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

from colls.store import TCPStore

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from bench_store_load import run_load  # noqa: E402

CLIENTS = 1000
ROUNDS = 1
#: Generous bound for a loaded 2-core CI machine (a quiet one needs a few seconds).
TIME_BOUND_S = 120.0


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_thousand_concurrent_clients_are_served():
    master = TCPStore("127.0.0.1", 0, is_master=True, timeout=120)
    try:
        start = time.monotonic()
        elapsed = run_load("colls", master.port, CLIENTS, ROUNDS, "load")
        assert time.monotonic() - start < TIME_BOUND_S
        assert elapsed < TIME_BOUND_S
        assert master.add("load/counter", 0) == CLIENTS * ROUNDS
        assert master.multi_get([f"load/0/{i}" for i in (0, 499, 999)]) == [b"0", b"499", b"999"]
        server = master.server
        assert server is not None and server._thread is not None and server._thread.is_alive()
    finally:
        master.close()
