"""The launch configuration of colls-run: one frozen, validated value built from the command line.

Keeping the configuration a plain immutable value (rather than an argparse Namespace passed around)
lets the process layer and the tests build launches without going through argument parsing, and
puts every range check in one place. This module imports only the standard library, because
colls-run must start in a few milliseconds.
"""

from __future__ import annotations

import secrets
import socket
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass, field

#: The variable the workers read their shared secret from (colls.auth).
AUTH_TOKEN_VAR = "COLLS_AUTH_TOKEN"
#: The variable that tells the workers where the launcher serves the job's store (colls.rendezvous).
STORE_PORT_VAR = "COLLS_STORE_PORT"
#: Highest TCP port number.
MAX_PORT = 65535

#: How Python workers are started (``--start-method``): forked from the launcher, which has
#: preloaded NumPy and colls (fast, see colls.run.forking), or a fresh interpreter each (``exec``).
START_METHODS = ("fork", "exec")

#: Who serves the job's TCPStore (``--store-host``): colls-run on node 0 (colls.run.job_store),
#: or rank 0, as torch's env:// has it.
STORE_HOSTS = ("launcher", "rank0")

#: What colls-run does when a worker dies (``--on-failure``): stop every worker (torchrun's
#: behaviour), let the job go on without it, or go on and start a replacement in its slot that
#: joins the running job (colls.run.replacing).
ON_FAILURE_MODES = ("stop", "shrink", "replace")
#: Replacements one colls-run starts at most (``--max-replacements``) unless told otherwise: a
#: worker that dies at once every time must not be restarted forever.
DEFAULT_MAX_REPLACEMENTS = 3
#: The variable that tells a replacement to join the running job instead of starting one
#: (colls' init_process_group; the survivors call colls.grow_group).
JOIN_VAR = "COLLS_JOIN"
#: The variable that tells a replacement which one of its slot it is: 1, 2, ...
INCARNATION_VAR = "COLLS_INCARNATION"


@dataclass(frozen=True)
class LaunchConfig:
    """What to start on this node, and the rendezvous address every worker is told.

    Attributes:
        script: The program to run: a Python script path, a module name (``module=True``) or an
            executable (``no_python=True``).
        script_args: Arguments passed to the program unchanged.
        nproc_per_node: Workers started on this node (LOCAL_WORLD_SIZE).
        nnodes: Nodes in the job; WORLD_SIZE is ``nnodes * nproc_per_node``.
        node_rank: This node's index in ``[0, nnodes)`` (GROUP_RANK).
        master_addr: Address of rank 0's host, exported as MASTER_ADDR.
        master_port: Port exported as MASTER_PORT (already resolved; never 0).
        module: Run ``script`` as a module, like ``python -m``.
        no_python: Execute ``script`` directly instead of through the Python interpreter.
        tag_output: Prefix every output line of each worker with ``[rank N]: ``.
        start_method: ``fork`` or ``exec`` (one of START_METHODS); ``fork`` falls back to ``exec``
            where it cannot apply (see colls.run.forking.use_fork).
        auth_token: COLLS_AUTH_TOKEN handed to the workers ("": none; see :func:`job_token`).
        store_port: Where the launcher of node 0 serves the job's TCPStore, on master_addr
            (colls.run.job_store), exported as COLLS_STORE_PORT: a port, or 0 for one the OS
            picks (single node only). None: no launcher serves it, and rank 0 serves the store
            on MASTER_PORT, as torch's env:// does.
        on_failure: What to do when a worker dies, one of ON_FAILURE_MODES: ``stop`` every
            worker, or go on without it (``shrink``), or go on and replace it (``replace``).
            The last two need the launcher's store (``store_port`` set): the store must outlive
            any rank.
        max_replacements: Replacements this launcher starts at most with ``replace``; then it
            goes on as with ``shrink``.
    """

    script: str
    script_args: tuple[str, ...] = field(default_factory=tuple)
    nproc_per_node: int = 1
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int = 29500
    module: bool = False
    no_python: bool = False
    tag_output: bool = False
    start_method: str = "fork"
    auth_token: str = field(default="", repr=False)
    store_port: int | None = None
    on_failure: str = "stop"
    max_replacements: int = DEFAULT_MAX_REPLACEMENTS

    def __post_init__(self) -> None:
        """Check ranges and flag combinations; the messages name the flag and the value."""
        if not self.script:
            raise ValueError("colls-run: script: expected a program to run, got an empty string")
        _require_positive("--nproc-per-node", self.nproc_per_node)
        _require_positive("--nnodes", self.nnodes)
        if not 0 <= self.node_rank < self.nnodes:
            raise ValueError(
                f"colls-run: --node-rank {self.node_rank} is out of range; expected "
                f"0 <= node rank < --nnodes ({self.nnodes})"
            )
        if not self.master_addr:
            raise ValueError("colls-run: --master-addr: expected a host name or address, got ''")
        if not 1 <= self.master_port <= MAX_PORT:
            raise ValueError(
                f"colls-run: --master-port {self.master_port} is out of range; "
                f"expected 1..{MAX_PORT}"
            )
        self._check_store_port()
        if self.module and self.no_python:
            raise ValueError(
                "colls-run: --module and --no-python cannot be used together "
                "(a module needs the Python interpreter)"
            )
        if self.start_method not in START_METHODS:
            raise ValueError(
                f"colls-run: --start-method {self.start_method!r} is invalid; expected one of "
                f"{', '.join(START_METHODS)}"
            )
        self._check_on_failure()

    def _check_on_failure(self) -> None:
        if self.on_failure not in ON_FAILURE_MODES:
            raise ValueError(
                f"colls-run: --on-failure {self.on_failure!r} is invalid; expected one of "
                f"{', '.join(ON_FAILURE_MODES)}"
            )
        if self.max_replacements < 0:
            raise ValueError(
                f"colls-run: --max-replacements {self.max_replacements} is invalid; expected "
                "an integer >= 0"
            )
        if self.on_failure != "stop" and self.store_port is None:
            raise ValueError(
                f"colls-run: --on-failure {self.on_failure} needs the job's store to outlive "
                "every rank, but here rank 0 serves it (--store-host rank0, the default with "
                "--nnodes > 1 and no --store-port): if rank 0 died, the survivors would lose the "
                "store through which they agree on who died. Use --store-host launcher (with "
                "--nnodes > 1, give every node the same --store-port)"
            )

    def _check_store_port(self) -> None:
        port = self.store_port
        if port is None:
            return
        if not 0 <= port <= MAX_PORT:
            raise ValueError(
                f"colls-run: --store-port {port} is out of range; expected 1..{MAX_PORT}"
            )
        if port == 0 and self.nnodes > 1:
            raise ValueError(
                f"colls-run: --nnodes {self.nnodes} needs a fixed --store-port, the same on "
                "every node (only a single node can let the OS pick one)"
            )
        if port == self.master_port:
            raise ValueError(
                f"colls-run: --store-port {port} is also --master-port; give the store another "
                "port (MASTER_PORT stays free for a torch.distributed store in the job)"
            )

    @property
    def serves_store(self) -> bool:
        """Whether this launcher serves the job's store: node 0's, when store_port is set."""
        return self.store_port is not None and self.node_rank == 0

    @property
    def goes_on_after_failure(self) -> bool:
        """Whether a worker's death leaves the others running (``--on-failure`` not stop)."""
        return self.on_failure != "stop"

    @property
    def world_size(self) -> int:
        """Return the number of workers in the whole job."""
        return self.nnodes * self.nproc_per_node

    def global_rank(self, local_rank: int) -> int:
        """Return the job-wide RANK of the worker with ``local_rank`` on this node."""
        return self.node_rank * self.nproc_per_node + local_rank

    def apply_thread_defaults(self, env: MutableMapping[str, str]) -> None:
        """Set OMP_NUM_THREADS=1 in ``env`` unless it is set, when this node runs several workers.

        As torchrun: N workers each spawning one OpenMP/BLAS thread per core overload the machine.
        The one place for this rule: worker environments get it, and so does the launcher's own
        environment before it preloads NumPy for forked workers (OpenBLAS sizes its thread pool
        from the environment at import time).
        """
        if self.nproc_per_node > 1:
            env.setdefault("OMP_NUM_THREADS", "1")


def job_token(nnodes: int, environ: Mapping[str, str]) -> str:
    """Return the COLLS_AUTH_TOKEN colls-run makes for its workers, or "" to make none.

    A single-node job gets a fresh random token (256 bits from :mod:`secrets`), so its store and
    mesh let in only its own workers. None is made when the user set COLLS_AUTH_TOKEN (theirs
    wins, and an explicitly empty one turns authentication off), nor for ``nnodes > 1``: the
    launchers of other nodes could not know it, so such jobs set COLLS_AUTH_TOKEN on every node.
    """
    if AUTH_TOKEN_VAR in environ or nnodes > 1:
        return ""
    return secrets.token_hex(32)


def _require_positive(flag: str, value: int) -> None:
    if value < 1:
        raise ValueError(f"colls-run: {flag} {value} is invalid; expected a positive integer")


def find_free_port(host: str) -> int:
    """Return a TCP port that is free on ``host`` now, chosen by the OS (bind to port 0).

    The socket is closed before the workers start, so another process could take the port in
    between; the window is short and this is what torchrun's standalone mode does too.

    Raises:
        ValueError: ``host`` cannot be resolved or no socket can be bound on it.
    """
    try:
        infos = socket.getaddrinfo(host, 0, type=socket.SOCK_STREAM)
    except OSError as exc:
        raise ValueError(f"colls-run: --master-addr {host!r} cannot be resolved: {exc}") from exc
    last_error: OSError | None = None
    for family, sock_type, proto, _name, address in infos:
        try:
            with socket.socket(family, sock_type, proto) as sock:
                sock.bind(address)
                return int(sock.getsockname()[1])
        except OSError as exc:
            last_error = exc
    raise ValueError(
        f"colls-run: cannot bind a free port on --master-addr {host!r} "
        f"(pass --master-port explicitly, or an address of this host): {last_error}"
    )
