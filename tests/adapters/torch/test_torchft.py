"""torchft on colls: colls_torch.torchft.ProcessGroupColls under torchft 0.2's real Manager.

The scenarios run real processes from colls.testing's forkserver and the real torchft wheel:
a lighthouse in this process, one replica group of one process per spawned rank, torchft's
Manager, DistributedDataParallel and OptimizerWrapper. Everything listens on 127.0.0.1 only:
the replica stores get a socket bound there (torch's TCPStore binds every interface by itself),
torchft's ManagerServer (hard-wired to ``[::]``) is rebound, and the checkpoint transport is one
that refuses to be used (torchft's HTTP one binds every interface; these runs never heal).

The unit tests drive ``configure``/``errored``/``abort`` directly over a torch TCPStore.
"""

from __future__ import annotations

import datetime
import os
import signal
import socket
import subprocess
import sys
import time
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("torchft", reason="torchft is optional: pip install torchft==0.2.0")

from colls.testing.spawn import spawn  # noqa: E402

#: SGD learning rate, steps of the healthy run, and the step at which the victim dies.
LR = 0.1
STEPS = 6
KILL_AT = 3
VICTIM = 1
#: Seconds torchft's lighthouse waits for a replica's heartbeat before dropping it.
HEARTBEAT_TIMEOUT_MS = 1000
#: Timeout of the process groups and the Manager's calls in these tests.
GROUP_TIMEOUT = datetime.timedelta(seconds=15)


# -- what every replica runs ---------------------------------------------------------------------


def _model() -> Any:
    torch.manual_seed(0)  # every replica starts identical (the Manager's init_sync=False)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))


def _batch(replica: int, step: int) -> tuple[Any, Any]:
    gen = torch.Generator().manual_seed(1000 * replica + step)
    return torch.randn(5, 4, generator=gen), torch.randn(5, 2, generator=gen)


def _loopback_store() -> tuple[Any, socket.socket]:
    """A torch TCPStore server on 127.0.0.1 only (the replica group's store)."""
    import torch.distributed as tdist

    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(128)
    store = tdist.TCPStore("127.0.0.1", listener.getsockname()[1], is_master=True,
                           wait_for_workers=False, master_listen_fd=listener.fileno())
    return store, listener


def _loopback_manager_server() -> None:
    """Make torchft's Manager bind its ManagerServer to 127.0.0.1 (0.2 hard-wires ``[::]``)."""
    import torchft.manager as tm

    real = tm.ManagerServer
    if getattr(real, "loopback", False):
        return

    def loopback(*, bind: str, **kwargs: Any) -> Any:
        return real(bind=bind.replace("[::]", "127.0.0.1"), **kwargs)

    loopback.loopback = True  # type: ignore[attr-defined]
    tm.ManagerServer = loopback


def _no_checkpoints() -> Any:
    from torchft.checkpointing.transport import CheckpointTransport

    class NoCheckpoints(CheckpointTransport):  # type: ignore[type-arg]
        """These runs never heal a replica: any checkpoint transfer is a test failure."""

        def metadata(self) -> str:
            return "no-checkpoints"

        def send_checkpoint(self, dst_ranks: Any, step: int, state_dict: Any,
                            timeout: Any) -> None:
            raise AssertionError(f"unexpected checkpoint send to {dst_ranks} at step {step}")

        def recv_checkpoint(self, src_rank: int, metadata: str, step: int,
                            timeout: Any) -> Any:
            raise AssertionError(f"unexpected checkpoint fetch from {src_rank} at step {step}")

    return NoCheckpoints()


def _replica(replica: int, _n: int, lighthouse: str, kind: str, steps: int, min_replicas: int,
             barrier: Any, kill_at: int | None) -> dict[str, Any]:
    """Train with torchft's Manager + DDP over ``kind``'s group ("colls" or "gloo").

    Replica VICTIM dies in its all_reduce of step ``kill_at`` (None: nobody dies).
    """
    from colls_torch.torchft import ProcessGroupColls
    from torchft import DistributedDataParallel, Manager, Optimizer
    from torchft.process_group import ProcessGroupGloo

    _loopback_manager_server()
    store, _listener = _loopback_store()
    pg = (ProcessGroupColls(timeout=GROUP_TIMEOUT) if kind == "colls"
          else ProcessGroupGloo(timeout=GROUP_TIMEOUT))
    model = _model()
    optim = torch.optim.SGD(model.parameters(), lr=LR)
    manager = Manager(
        pg=pg, min_replica_size=min_replicas,
        load_state_dict=lambda sd: model.load_state_dict(sd["model"]),
        state_dict=lambda: {"model": model.state_dict()},
        replica_id=f"replica_{replica}", store_addr="127.0.0.1", store_port=store.port,
        rank=0, world_size=1, lighthouse_addr=lighthouse, hostname="127.0.0.1",
        checkpoint_transport=_no_checkpoints(), init_sync=False, timeout=GROUP_TIMEOUT,
        quorum_timeout=datetime.timedelta(seconds=30),
        connect_timeout=datetime.timedelta(seconds=10),
    )
    barrier.wait(60)  # both managers heartbeat before the first quorum: both are in it
    ddp = DistributedDataParallel(manager, model)
    opt = Optimizer(manager, optim)
    history: list[dict[str, Any]] = []
    calls_through_colls = 0
    try:
        while manager.current_step() < steps:
            step = manager.current_step()
            x, y = _batch(replica, step)
            opt.zero_grad()
            loss = torch.nn.functional.mse_loss(ddp(x), y)
            if replica == VICTIM and step == kill_at:
                _die_in_the_next_all_reduce(pg)
            loss.backward()
            opt.step()
            error = manager.errored()  # why this step was not committed, if it was not
            history.append({
                "step": step, "committed": manager.current_step() > step,
                "participants": manager.num_participants(), "loss": loss.item(),
                "error": None if error is None else str(error.original_exception),
                "time": time.monotonic(),
            })
        calls_through_colls = getattr(pg.parent, "calls_run", 0)  # the last quorum's group
    finally:
        manager.shutdown(wait=False)
        pg.shutdown()
    # NumPy, not tensors: torch's pickler would share them by fd, gone once this process ends.
    return {"params": [p.detach().numpy().copy() for p in model.parameters()],
            "history": history, "backend": pg.getBackendName(), "colls calls": calls_through_colls}


def _die_in_the_next_all_reduce(pg: Any) -> None:
    """SIGKILL this process when the Manager calls its next all_reduce.

    By then this replica's quorum of the step is complete, so the other replica's quorum is
    the same (this one included) and its all_reduce of the step waits for this one's data: it
    sees the connection drop, never a finished result (dying after starting the all_reduce
    would let a small one complete now and then, and the step commit on both sides).
    """

    def dying(tensors: Any, opts: Any) -> Any:
        os.kill(os.getpid(), signal.SIGKILL)

    pg.allreduce = dying  # torchft's Manager calls its pg's allreduce for every DDP bucket


# -- the reference and the lighthouse ------------------------------------------------------------


def _reference(schedule: list[list[int]]) -> list[Any]:
    """Parameters after SGD on the average gradient of the replicas of each step's list."""
    model = _model()
    optim = torch.optim.SGD(model.parameters(), lr=LR)
    for step, replicas in enumerate(schedule):
        grads = []
        for replica in replicas:
            model.zero_grad()
            x, y = _batch(replica, step)
            torch.nn.functional.mse_loss(model(x), y).backward()
            grads.append([p.grad.clone() for p in model.parameters()])
        for i, p in enumerate(model.parameters()):
            total = grads[0][i]
            for g in grads[1:]:
                total = total + g[i]
            p.grad = total / len(replicas)  # torchft: SUM all_reduce, then / participants
        optim.step()
    return [p.detach().clone() for p in model.parameters()]


class _Lighthouse:
    """torchft's lighthouse on 127.0.0.1, for the duration of a ``with`` block."""

    def __init__(self, min_replicas: int) -> None:
        from torchft._torchft import LighthouseServer

        self._server = LighthouseServer(bind="127.0.0.1:0", min_replicas=min_replicas,
                                        heartbeat_timeout_ms=HEARTBEAT_TIMEOUT_MS)
        port = self._server.address().rsplit(":", 1)[1]
        self.address = f"http://127.0.0.1:{port}"  # address() names the host, not loopback

    def __enter__(self) -> _Lighthouse:
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()


def _train(kind: str, *, min_replicas: int, steps: int, kill_at: int | None = None,
           timeout: float) -> list[Any]:
    from colls.testing.spawn import context

    barrier = context().Barrier(2)
    env = {"GLOO_SOCKET_IFNAME": "lo"}  # torch's gloo: loopback only, as colls
    with _Lighthouse(min_replicas) as lighthouse:
        return spawn(_replica, 2, backend=None, timeout=timeout, env=env,
                     args=(lighthouse.address, kind, steps, min_replicas, barrier, kill_at),
                     victims=() if kill_at is None else (VICTIM,))


def _assert_params_close(actual: list[Any], expected: list[Any], what: str) -> None:
    for i, (a, e) in enumerate(zip(actual, expected, strict=True)):
        torch.testing.assert_close(torch.as_tensor(a), torch.as_tensor(e), rtol=1e-6, atol=1e-7,
                                   msg=lambda m, i=i: f"{what}, parameter {i}: {m}")


# -- the scenarios -------------------------------------------------------------------------------


@pytest.mark.timeout(240)
def test_ddp_over_colls_equals_the_reference_and_gloo() -> None:
    colls_run = _train("colls", min_replicas=2, steps=STEPS, timeout=150)
    for result in colls_run:
        assert result["backend"] == "torchft-colls"
        assert [h["step"] for h in result["history"]] == list(range(STEPS))
        assert all(h["committed"] and h["participants"] == 2 for h in result["history"])
        assert result["colls calls"] >= STEPS  # DDP's all_reduces ran on colls' group
    # Both replicas apply the same all-reduced gradient to the same parameters: bitwise equal.
    for a, b in zip(colls_run[0]["params"], colls_run[1]["params"], strict=True):
        assert (a == b).all()
    # The reference computes the same sums and quotients in another process; the backward of
    # two processes may differ in the last bit (CPU kernels), hence a tight allclose.
    reference = _reference([[0, 1]] * STEPS)
    _assert_params_close(colls_run[0]["params"], reference, "colls vs the reference")

    gloo_run = _train("gloo", min_replicas=2, steps=STEPS, timeout=150)
    assert gloo_run[0]["backend"] == "torchft-gloo"
    for replica in (0, 1):
        losses = [h["loss"] for h in colls_run[replica]["history"]]
        gloo_losses = [h["loss"] for h in gloo_run[replica]["history"]]
        assert losses == pytest.approx(gloo_losses, rel=1e-6, abs=1e-7)
        _assert_params_close(colls_run[replica]["params"], gloo_run[replica]["params"],
                             f"colls vs torchft's ProcessGroupGloo, replica {replica}")


@pytest.mark.timeout(120)
def test_a_killed_replica_leaves_the_quorum_and_the_other_trains_on() -> None:
    steps = KILL_AT + 3
    survivor, victim = _train("colls", min_replicas=1, steps=steps, kill_at=KILL_AT,
                              timeout=90)
    assert victim is None  # it died, as meant
    history = survivor["history"]
    committed = [h for h in history if h["committed"]]
    assert [h["step"] for h in committed] == list(range(steps))
    # Before the kill both replicas took part; after it the quorum shrank to the survivor.
    assert [h["participants"] for h in committed[:KILL_AT]] == [2] * KILL_AT
    assert [h["participants"] for h in committed[KILL_AT:]] == [1] * (steps - KILL_AT)
    # The step whose all_reduce lost the peer is not committed, says why, and is done again.
    failed = [h for h in history if not h["committed"]]
    assert [h["step"] for h in failed] == [KILL_AT], history
    assert f"world rank {VICTIM} died" in failed[0]["error"], failed[0]["error"]
    # From the failed step to the first step of the shrunk quorum: the lighthouse's heartbeat
    # timeout, a quorum and a configure (the processes' start, importing torch and torchft,
    # is most of the test's time on a loaded machine, and not measured).
    recovery = committed[KILL_AT]["time"] - failed[0]["time"]
    assert recovery < 15, f"the survivor took {recovery:.1f} s to train on alone"
    expected = _reference([[0, 1]] * KILL_AT + [[0]] * (steps - KILL_AT))
    _assert_params_close(survivor["params"], expected, "survivor vs the reference")


# -- configure / errored / abort, without the Manager ---------------------------------------------


def _store_server(port: int) -> tuple[Any, socket.socket]:
    import torch.distributed as tdist

    listener = socket.socket()
    listener.bind(("127.0.0.1", port))
    listener.listen(128)
    store = tdist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False,
                           master_listen_fd=listener.fileno())
    return store, listener


def _sum(pg: Any, value: float, n: int = 3) -> list[float]:
    from torch.distributed import AllreduceOptions, ReduceOp

    opts = AllreduceOptions()
    opts.reduceOp = ReduceOp.SUM
    t = torch.full((n,), value)
    work = pg.allreduce([t], opts)
    if not work.wait():
        raise work.exception()
    return t.tolist()


def _failed_sum(pg: Any) -> dict[str, Any]:
    """What a failing all_reduce gives back: wait() says False; exception and future say why."""
    from torch.distributed import AllreduceOptions

    work = pg.allreduce([torch.ones(2)], AllreduceOptions())
    out: dict[str, Any] = {"wait": work.wait(), "exception": _described(work.exception())}
    try:
        work.get_future().wait()
        out["future"] = "succeeded"
    except Exception as exc:  # noqa: BLE001 - the test looks at what it is
        out["future"] = _described(exc)
    return out


def _described(error: BaseException | None) -> str:
    """``DistBackendError: <message>`` for any of torch's DistBackendError family, else repr."""
    from torch.distributed import DistBackendError

    if isinstance(error, DistBackendError):
        return f"DistBackendError: {error}"
    return repr(error)


def _reconfigure_scenario(rank: int, size: int) -> dict[str, Any]:
    from colls_torch.torchft import ProcessGroupColls

    port = int(os.environ["MASTER_PORT"])
    server = _store_server(port) if rank == 0 else None
    addr = f"127.0.0.1:{port}"
    pg = ProcessGroupColls(timeout=GROUP_TIMEOUT)
    out: dict[str, Any] = {}
    pg.configure(f"{addr}/torchft/1/0", "r", rank, size, quorum_id=1)
    out["first"] = (pg.size(), pg.colls_group.rank, _sum(pg, rank + 1.0))
    first_group = pg.colls_group
    # Quorum 2: ranks 0 and 1 together, the last rank alone.
    if rank < size - 1:
        pg.configure(f"{addr}/torchft/2/0", "r", rank, size - 1, quorum_id=2)
    else:
        pg.configure(f"{addr}/torchft/2/alone", "r", 0, 1, quorum_id=2)
    out["second"] = (pg.size(), pg.colls_group.rank, _sum(pg, rank + 1.0))
    out["old group closed"] = first_group.destroyed
    out["errored"] = pg.errored()
    pg.set_timeout(datetime.timedelta(seconds=7))
    out["timeout"] = pg.colls_group.timeout
    pg.shutdown()
    out["after shutdown"] = pg.colls_group
    _finish(rank, size, port, server)
    return out


def _finish(rank: int, size: int, port: int, server: Any) -> None:
    """Leave once every rank is done: the store's host (rank 0) leaves last."""
    import torch.distributed as tdist

    store = server[0] if server is not None else tdist.TCPStore(
        "127.0.0.1", port, is_master=False, wait_for_workers=False)
    store.add("done", 1)
    if server is None:
        return
    deadline = time.monotonic() + 30
    while store.add("done", 0) < size and time.monotonic() < deadline:
        time.sleep(0.05)


@pytest.mark.timeout(120)
def test_configure_again_makes_a_group_of_the_new_size() -> None:
    results = spawn(_reconfigure_scenario, 3, backend=None, timeout=90)
    for rank, out in enumerate(results):
        assert out["first"] == (3, rank, [6.0] * 3)
        expected = (2, rank, [3.0] * 3) if rank < 2 else (1, 0, [3.0] * 3)
        assert out["second"] == expected
        assert out["old group closed"] is True
        assert out["errored"] is None
        assert out["timeout"] == 7.0
        assert out["after shutdown"] is None


def _dead_peer_scenario(rank: int, size: int) -> dict[str, Any]:
    """Rank 1 dies after one all_reduce; rank 0 sees errored() name it and aborts at once."""
    from colls_torch.torchft import ProcessGroupColls

    port = int(os.environ["MASTER_PORT"])
    server = _store_server(port) if rank == 0 else None
    pg = ProcessGroupColls(timeout=GROUP_TIMEOUT)
    pg.configure(f"127.0.0.1:{port}/torchft/1/0", "r", rank, size, quorum_id=1)
    _sum(pg, 1.0)
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    out: dict[str, Any] = {}
    deadline = time.monotonic() + 10
    while pg.errored() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    error = pg.errored()
    out["errored"] = _described(error)
    out["next all_reduce"] = _failed_sum(pg)
    start = time.monotonic()
    pg.abort()
    out["abort seconds"] = time.monotonic() - start
    out["errored after abort"] = str(pg.errored())
    # The next quorum (alone) works, and errored() is clear again.
    pg.configure(f"127.0.0.1:{port}/torchft/2/0", "r", 0, 1, quorum_id=2)
    out["alone"] = (_sum(pg, 2.0), pg.errored())
    pg.shutdown()
    del server
    return out


@pytest.mark.timeout(90)
def test_errored_names_a_dead_peer_and_abort_does_not_wait_for_it() -> None:
    out, victim = spawn(_dead_peer_scenario, 2, backend=None, timeout=60, victims=(1,))
    assert victim is None
    message = out["errored"]
    assert message.startswith("DistBackendError: "), out  # or a subclass (PeerFailedError)
    assert "rank 1 died" in message and "torchft:torchft/1/0" in message, message
    # The all_reduce on the broken group does not raise: wait() is False (torchft's DDP needs
    # that), the exception and the future name the dead rank.
    after = out["next all_reduce"]
    assert after["wait"] is False, after
    assert after["exception"].startswith("DistBackendError") and "rank 1" in after["exception"]
    assert after["future"].startswith("DistBackendError") and "rank 1" in after["future"]
    assert out["abort seconds"] < 2.0, out
    assert "rank 1 died" in out["errored after abort"]
    assert out["alone"] == ([2.0] * 3, None)


def _hung_peer_scenario(rank: int, size: int) -> dict[str, Any]:
    """Rank 1 never joins an all_reduce: rank 0 aborts while it is pending (quorum 1), then
    waits for one with a timeout (quorum 2)."""
    from colls_torch.torchft import ProcessGroupColls
    from torch.distributed import AllreduceOptions

    port = int(os.environ["MASTER_PORT"])
    server = _store_server(port) if rank == 0 else None
    pg = ProcessGroupColls(timeout=GROUP_TIMEOUT)
    out: dict[str, Any] = {}
    for quorum in (1, 2):
        pg.configure(f"127.0.0.1:{port}/torchft/{quorum}/0", "r", rank, size, quorum_id=quorum)
        if rank == 0:
            work = pg.allreduce([torch.ones(4)], AllreduceOptions())
            time.sleep(0.3)
            pending = not work.is_completed()
            start = time.monotonic()
            if quorum == 1:
                pg.abort()
                ended = work.wait()
            else:
                ended = work.wait(datetime.timedelta(seconds=0.5))
            out[quorum] = {"pending": pending, "wait": ended,
                           "seconds": time.monotonic() - start,
                           "work": _described(work.exception()), "errored": str(pg.errored())}
        else:
            deadline = time.monotonic() + 10
            while pg.errored() is None and time.monotonic() < deadline:
                time.sleep(0.01)  # rank 0's failure record breaks this group too
            out[quorum] = {"errored": str(pg.errored())}
    pg.shutdown()
    _finish(rank, size, port, server)
    return out


@pytest.mark.timeout(90)
def test_abort_and_a_wait_past_its_timeout_fail_a_pending_collective_on_every_rank() -> None:
    zero, one = spawn(_hung_peer_scenario, 2, backend=None, timeout=60)
    aborted, timed_out = zero[1], zero[2]
    assert aborted["pending"] is True and aborted["wait"] is False
    assert aborted["seconds"] < 2.0, aborted
    assert aborted["work"].startswith("DistBackendError"), aborted
    assert "aborted by torchft" in aborted["work"] and "aborted by torchft" in aborted["errored"]
    assert "rank 0 reported: aborted by torchft" in one[1]["errored"], one
    # A wait that runs out of time returns False after its timeout and breaks the group.
    assert timed_out["pending"] is True and timed_out["wait"] is False
    assert 0.4 < timed_out["seconds"] < 2.5, timed_out
    assert "did not finish in time" in timed_out["errored"], timed_out
    assert "did not finish in time" in timed_out["work"], timed_out
    assert "rank 0 reported: a collective did not finish in time" in one[2]["errored"], one


# -- the optional import ---------------------------------------------------------------------------


def test_colls_torch_imports_without_torchft_and_the_module_says_how_to_get_it() -> None:
    code = (
        "import sys\n"
        "sys.modules['torchft'] = None  # as if it were not installed\n"
        "import colls_torch\n"
        "try:\n"
        "    import colls_torch.torchft\n"
        "except ImportError as exc:\n"
        "    print('ImportError:', exc)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    assert "ImportError: colls_torch.torchft needs torchft" in done.stdout
    assert "pip install torchft" in done.stdout
