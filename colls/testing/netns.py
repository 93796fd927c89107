"""Emulated hosts for tests and benchmarks: network namespaces on a bridge.

:func:`emulated_hosts` makes ``K`` network namespaces ("hosts"), each with loopback and one veth
``vh<i>`` at ``10.<a>.<b>.<i+1>/24`` whose peer ``vb<i>`` is a port of a bridge that lives in a
namespace of its own. Nothing is added to the namespace the caller runs in: no interface, route
or address, so the only traffic is between the namespaces it made. Optionally each link is
capped with ``tbf`` in both directions (a full-duplex link of that rate per host into one
switch; the method of ``../shared/anchors/netns_hosts.sh``).

The namespaces are always deleted when the context ends (processes still running in them are
killed first), also on failure; their names carry this process's pid and a counter, so
concurrent runs never meet. Needs root and iproute2 (``ip``; ``tc`` for rates):
:func:`missing` says which of them is absent, for a skip that names it.

Run a command on host ``i`` with ``hosts.exec_prefix(i) + [cmd, ...]``; give the processes a
host identity of their own with ``COLLS_HOST_ID`` (:meth:`EmulatedHosts.env`), since every
namespace shares this kernel (and so its hostname and boot id). An MPI job across the hosts runs
``mpiexec`` on host 0 with :meth:`EmulatedHosts.hydra_args`.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import secrets
import shlex
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field

_counter = itertools.count()

#: Seconds any one ``ip``/``tc`` call may take on a loaded machine.
IP_TIMEOUT_S = 30.0


def missing(rates: bool = False) -> str | None:
    """Return what emulated hosts need and this process lacks ("needs root ..."), or None."""
    if os.geteuid() != 0:
        return "needs root to create network namespaces"
    if shutil.which("ip") is None:
        return "needs iproute2 (the ip command)"
    if rates and shutil.which("tc") is None:
        return "needs iproute2's tc to cap link rates"
    return None


def ip(*args: str) -> str:
    """Run ``ip ARGS`` and return its output.

    Raises:
        subprocess.CalledProcessError: ip failed (its stderr is in the exception).
    """
    done = subprocess.run(["ip", *args], check=True, capture_output=True, text=True,
                          timeout=IP_TIMEOUT_S)
    return done.stdout


def _tc(*args: str) -> None:
    subprocess.run(["tc", *args], check=True, capture_output=True, text=True,
                   timeout=IP_TIMEOUT_S)


@dataclass(frozen=True)
class EmulatedHosts:
    """``K`` namespaces ``names[i]`` at ``addresses[i]`` (device ``vh<i>``) on one bridge."""

    names: tuple[str, ...]
    addresses: tuple[str, ...]
    bridge: str
    tag: str
    token: str = field(default_factory=lambda: secrets.token_hex(16), repr=False)

    def __len__(self) -> int:
        return len(self.names)

    def device(self, index: int) -> str:
        """The veth of host ``index`` inside its namespace."""
        return f"vh{index}"

    def exec_prefix(self, index: int) -> list[str]:
        """The argv prefix that runs a command in host ``index``'s namespace."""
        return ["ip", "netns", "exec", self.names[index]]

    def host_id(self, index: int) -> str:
        """The ``COLLS_HOST_ID`` of host ``index``."""
        return f"{self.tag}-host{index}"

    def env(self, index: int, base: Mapping[str, str] | None = None) -> dict[str, str]:
        """An environment for processes of host ``index``: its host identity, address, devices,
        and the job token all hosts share (their listeners are reachable from the bridge)."""
        env = dict(os.environ if base is None else base)
        env.update(
            COLLS_AUTH_TOKEN=self.token,
            COLLS_HOST_ID=self.host_id(index),
            COLLS_TCP_HOST=self.addresses[index],
            GLOO_SOCKET_IFNAME=self.device(index),
        )
        return env

    def set_rate(self, rate: str | None) -> None:
        """Cap every link at ``rate`` (a tc rate: "1gbit") both ways; None removes the caps.

        The burst is 1 ms at the rate and at least 128 KiB (more than one 64 KiB GSO packet).
        """
        for index, name in enumerate(self.names):
            pairs = ((name, self.device(index)), (self.bridge, f"vb{index}"))
            for namespace, device in pairs:
                if rate is None:
                    with contextlib.suppress(subprocess.CalledProcessError):
                        _tc("-n", namespace, "qdisc", "del", "dev", device, "root")
                    continue
                burst = max(_rate_bytes(rate) // 1000, 128 * 1024)
                _tc("-n", namespace, "qdisc", "replace", "dev", device, "root", "tbf",
                    "rate", rate, "burst", str(burst), "latency", "20ms")

    def traffic(self, index: int) -> int:
        """Bytes host ``index``'s link has carried so far, both directions."""
        stats = {}
        lines = ip("-n", self.names[index], "-s", "link", "show", "dev", self.device(index))
        rows = lines.splitlines()
        for i, row in enumerate(rows):
            head = row.split(":")[0].strip()
            if head in ("RX", "TX") and i + 1 < len(rows):
                stats[head] = int(rows[i + 1].split()[0])
        return stats.get("RX", 0) + stats.get("TX", 0)

    def hydra_args(self, directory: str) -> list[str]:
        """mpiexec (hydra) flags that start one proxy per emulated host; run mpiexec on host 0.

        Hydra's ssh launcher is replaced by a script written into ``directory`` that enters the
        namespace of the address it is asked to reach (``python -m colls.testing.netns ssh``),
        and hydra's control traffic uses host 0's device. Every host is then a node of its own
        to MPICH: shared memory among the ranks of a host, the network between hosts.
        """
        mapping = ",".join(f"{a}={n}" for a, n in zip(self.addresses, self.names, strict=True))
        script = os.path.join(directory, f"{self.tag}-ssh")
        with open(script, "w") as f:
            f.write(f"#!/bin/sh\nexec {shlex.quote(sys.executable)} -m colls.testing.netns ssh "
                    f"{mapping} \"$@\"\n")
        os.chmod(script, 0o755)
        return ["-launcher", "ssh", "-launcher-exec", script, "-iface", self.device(0),
                "-hosts", ",".join(self.addresses)]

    def link_down(self, index: int) -> None:
        """Take host ``index``'s link down from its side: nothing reaches it, not even a reset."""
        ip("-n", self.names[index], "link", "set", self.device(index), "down")


def _rate_bytes(rate: str) -> int:
    """Bytes per second of a tc rate such as "500mbit", "1gbit", "10gbit"."""
    text = rate.lower()
    for suffix, scale in (("gbit", 1e9 / 8), ("mbit", 1e6 / 8), ("kbit", 1e3 / 8),
                          ("bit", 1 / 8)):
        if text.endswith(suffix):
            return int(float(text[: -len(suffix)]) * scale)
    raise ValueError(f"rate must look like '1gbit', '500mbit' or '10gbit', got {rate!r}")


@contextlib.contextmanager
def emulated_hosts(count: int, rate: str | None = None) -> Iterator[EmulatedHosts]:
    """Make ``count`` emulated hosts on one bridge (links capped at ``rate``); always delete them.

    Raises:
        ValueError: ``count`` is not in 2..250.
        RuntimeError: what :func:`missing` reports (call it first to skip instead).
        subprocess.CalledProcessError: an ``ip``/``tc`` command failed.
    """
    if not 2 <= count <= 250:
        raise ValueError(f"emulated_hosts: count must be in 2..250, got {count}")
    lack = missing(rates=rate is not None)
    if lack:
        raise RuntimeError(f"emulated_hosts: {lack}")
    serial = next(_counter)
    tag = f"colls{os.getpid()}n{serial}"
    subnet = f"10.{80 + serial % 100}.{os.getpid() % 250 + 1}"
    hosts = EmulatedHosts(
        names=tuple(f"{tag}h{i}" for i in range(count)),
        addresses=tuple(f"{subnet}.{i + 1}" for i in range(count)),
        bridge=f"{tag}br",
        tag=tag,
    )
    created: list[str] = []
    try:
        ip("netns", "add", hosts.bridge)
        created.append(hosts.bridge)
        ip("-n", hosts.bridge, "link", "set", "lo", "up")
        ip("-n", hosts.bridge, "link", "add", "br0", "type", "bridge")
        ip("-n", hosts.bridge, "link", "set", "br0", "up")
        for index, name in enumerate(hosts.names):
            ip("netns", "add", name)
            created.append(name)
            ip("-n", name, "link", "set", "lo", "up")
            device = hosts.device(index)
            ip("-n", hosts.bridge, "link", "add", f"vb{index}", "type", "veth", "peer", "name",
               device, "netns", name)
            ip("-n", hosts.bridge, "link", "set", f"vb{index}", "master", "br0")
            ip("-n", hosts.bridge, "link", "set", f"vb{index}", "up")
            ip("-n", name, "addr", "add", f"{hosts.addresses[index]}/24", "dev", device)
            ip("-n", name, "link", "set", device, "up")
        if rate is not None:
            hosts.set_rate(rate)
        yield hosts
    finally:
        for name in reversed(created):
            _delete(name)


def _delete(name: str) -> None:
    """Kill what still runs in namespace ``name`` (by pid), then delete it."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            pids = subprocess.run(["ip", "netns", "pids", name], capture_output=True, text=True,
                                  timeout=IP_TIMEOUT_S).stdout.split()
        except subprocess.TimeoutExpired:
            pids = []
        if not pids:
            break
        for pid in pids:
            with contextlib.suppress(ProcessLookupError, ValueError):
                os.kill(int(pid), sig)
        time.sleep(0.5)
    subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=IP_TIMEOUT_S)


def _ssh(argv: list[str]) -> None:
    """Hydra's "ssh": ``MAPPING [-x ...] ADDRESS COMMAND...`` runs COMMAND in ADDRESS's namespace.

    ``MAPPING`` is ``address=namespace,...`` (written by :meth:`EmulatedHosts.hydra_args`).
    """
    mapping = dict(item.split("=", 1) for item in argv[0].split(","))
    args = argv[1:]
    while args and args[0].startswith("-"):
        args = args[1:]
    if not args or args[0] not in mapping:
        raise SystemExit(f"colls.testing.netns ssh: no emulated host in {argv[1:]!r}")
    os.execvp("ip", ["ip", "netns", "exec", mapping[args[0]], "sh", "-c", " ".join(args[1:])])


if __name__ == "__main__" and sys.argv[1:2] == ["ssh"]:
    _ssh(sys.argv[2:])
