"""TCPStore under load: N concurrent clients doing set/get/add/wait, colls vs torch.distributed.

Each client (a thread of this process, with its own store object and connection) runs ROUNDS
rounds of: ``set(k_i)``, ``add(counter)``, ``get(k_{i+1})`` (blocks until the neighbour has set
it, so blocking requests are exercised), ``wait([k_{i+7}])``. The server runs in a separate
process for both libraries, so neither competes with the clients for this process's GIL. The
time is from the first connection to the last client's last reply, best of ``--repeat`` runs.

    python benchmarks/bench_store_load.py --clients 1000 --rounds 3

prints one line per library and the ratio colls / torch (lower is better for colls).
"""

from __future__ import annotations

import argparse
import datetime
import multiprocessing
import os
import threading
import time
from collections.abc import Callable
from typing import Any

#: Thread stack size for the clients (1000 threads with the default 8 MiB would reserve 8 GiB).
STACK_BYTES = 512 * 1024


def _make_store(lib: str, port: int, master: bool, timeout: float) -> Any:
    if lib == "torch":
        os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")  # one warning per client else
        import torch.distributed as dist

        return dist.TCPStore("127.0.0.1", port, None, master,
                             timeout=datetime.timedelta(seconds=timeout), wait_for_workers=False)
    from colls.store import TCPStore

    return TCPStore("127.0.0.1", port, None, is_master=master, timeout=timeout)


def _serve(lib: str, port_queue: Any, stop: Any) -> None:
    store = _make_store(lib, 0, True, 600.0)
    port_queue.put(store.port)
    stop.wait()


def _client(lib: str, port: int, index: int, clients: int, rounds: int, prefix: str,
            barrier: threading.Barrier, errors: list[BaseException],
            ends: list[float]) -> None:
    try:
        store = _make_store(lib, port, False, 120.0)
        barrier.wait()
        for r in range(rounds):
            key = f"{prefix}/{r}/{index}"
            store.set(key, str(index).encode())
            store.add(f"{prefix}/counter", 1)
            neighbour = f"{prefix}/{r}/{(index + 1) % clients}"
            if store.get(neighbour) != str((index + 1) % clients).encode():
                raise AssertionError(f"client {index}: wrong value under {neighbour}")
            store.wait([f"{prefix}/{r}/{(index + 7) % clients}"])
        ends.append(time.perf_counter())
        closer: Callable[[], None] | None = getattr(store, "close", None)
        if closer is not None:
            closer()
    except BaseException as exc:  # noqa: BLE001 - reported by the caller
        errors.append(exc)


def run_load(lib: str, port: int, clients: int, rounds: int, prefix: str,
             connect_times: list[float] | None = None) -> float:
    """Run the load once against the server at ``port``; return the seconds the requests took.

    The seconds it took all clients to connect are appended to ``connect_times`` when given.
    """
    errors: list[BaseException] = []
    ends: list[float] = []
    released: list[float] = []
    # the barrier's action runs once, just before every client is released: the start time
    barrier = threading.Barrier(clients + 1, action=lambda: released.append(time.perf_counter()))
    connect_start = time.perf_counter()
    old = threading.stack_size(STACK_BYTES)
    try:
        threads = [threading.Thread(target=_client, args=(lib, port, i, clients, rounds, prefix,
                                                          barrier, errors, ends), daemon=True)
                   for i in range(clients)]
        for t in threads:
            t.start()
    finally:
        threading.stack_size(old)
    barrier.wait(timeout=600)  # every client is connected: time the requests only
    for t in threads:
        t.join(600)
    if errors:
        raise RuntimeError(f"{lib}: {len(errors)} clients failed, first: {errors[0]!r}")
    start = released[0]
    if connect_times is not None:
        connect_times.append(start - connect_start)
    return max(ends) - start  # from the release to the last client's last reply


def bench(lib: str, clients: int, rounds: int, repeat: int) -> tuple[float, float]:
    """Start a server process for ``lib``; return the best request and connect times."""
    ctx = multiprocessing.get_context("spawn")
    ports, stop = ctx.Queue(), ctx.Event()
    server = ctx.Process(target=_serve, args=(lib, ports, stop), daemon=True)
    server.start()
    try:
        port = ports.get(timeout=120)
        connects: list[float] = []
        best = min(run_load(lib, port, clients, rounds, f"run{i}", connects)
                   for i in range(repeat))
        return best, min(connects)
    finally:
        stop.set()
        server.join(10)
        if server.is_alive():
            server.kill()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=1000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--libs", default="colls,torch")
    args = parser.parse_args()
    times = {}
    connects = {}
    for lib in args.libs.split(","):
        times[lib], connects[lib] = bench(lib, args.clients, args.rounds, args.repeat)
        ops = args.clients * args.rounds * 4
        print(f"{lib:6s} {args.clients} clients x {args.rounds} rounds: {times[lib]:.3f} s "
              f"({ops / times[lib]:,.0f} requests/s); connecting them: {connects[lib]:.2f} s")
    if "colls" in times and "torch" in times:
        print(f"ratio colls/torch: requests {times['colls'] / times['torch']:.2f}, "
              f"connecting {connects['colls'] / connects['torch']:.2f}")


if __name__ == "__main__":
    main()
