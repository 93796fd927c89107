"""Every ``COLLS_*`` environment variable, read and validated in this one module.

Other modules never touch ``os.environ`` for ``COLLS_*`` names; they call :func:`get`. Values are
read at call time (not import time) so tests and launchers can change them per process. docs/env.md
lists the same table; :func:`describe` prints it.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from colls.run.config import MAX_PORT, START_METHODS


def _parse_bool(text: str) -> bool:
    lowered = text.strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off", ""):
        return False
    raise ValueError(f"expected one of 1/0/true/false/yes/no/on/off, got {text!r}")


def _parse_positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise ValueError(f"expected a positive number, got {text!r}")
    return value


def _parse_positive_int(text: str) -> int:
    value = int(text, 0)
    if value <= 0:
        raise ValueError(f"expected a positive integer, got {text!r}")
    return value


def _parse_non_negative_int(text: str) -> int:
    value = int(text, 0)
    if value < 0:
        raise ValueError(f"expected 0 or a positive integer, got {text!r}")
    return value


def _parse_debug(text: str) -> str:
    lowered = text.strip().lower()
    if lowered not in ("off", "info", "detail"):
        raise ValueError(f"expected off, info or detail, got {text!r}")
    return lowered


def _parse_start_method(text: str) -> str:
    lowered = text.strip().lower()
    if lowered not in START_METHODS:
        raise ValueError(f"expected {' or '.join(START_METHODS)}, got {text!r}")
    return lowered


def _parse_str(text: str) -> str:
    return text.strip()


def _parse_port(text: str) -> int | None:
    if not text.strip():
        return None
    value = int(text)
    if not 1 <= value <= MAX_PORT:
        raise ValueError(f"expected a TCP port, 1..{MAX_PORT}, got {text!r}")
    return value


@dataclass(frozen=True)
class Setting:
    """One environment variable: its name, parser, default and meaning."""

    name: str
    parse: Callable[[str], Any]
    default: Any
    doc: str


SETTINGS: dict[str, Setting] = {
    s.name: s
    for s in (
        Setting(
            "COLLS_DISABLE_PLUGIN_AUTOLOAD", _parse_bool, False,
            "1 turns entry-point discovery of backend plugins off; only plugins registered "
            "explicitly with colls.plugin_manager.register_plugin are used.",
        ),
        Setting(
            "COLLS_DEBUG", _parse_debug, "off",
            "off | info | detail. detail checks each collective's fingerprint (op, sequence "
            "number, dtype, shape, root) across ranks before running it.",
        ),
        Setting(
            "COLLS_TIMEOUT", _parse_positive_float, 1800.0,
            "Default timeout in seconds of every blocking call when init_process_group / "
            "new_group get no timeout (torch's default is 30 minutes).",
        ),
        Setting(
            "COLLS_BACKEND", _parse_str, "",
            "Backend used by init_process_group(backend=None); empty means tcp for CPU.",
        ),
        Setting(
            "COLLS_SEGMENT_BYTES", _parse_positive_int, 1 << 20,
            "Segment size in bytes of the pipelined algorithms (ring all_reduce and friends).",
        ),
        Setting(
            "COLLS_ALGORITHM", _parse_str, "",
            "Force algorithms, e.g. 'all_reduce=ring,broadcast=binomial'; empty lets "
            "colls.algorithms.select choose by message size and world size.",
        ),
        Setting(
            "COLLS_SMALL_MESSAGE_BYTES", _parse_positive_int, 64 * 1024,
            "Messages up to this many bytes use latency-optimal algorithms "
            "(recursive doubling); larger ones use bandwidth-optimal ones (ring).",
        ),
        Setting(
            "COLLS_SHM", _parse_bool, True,
            "tcp backend: move collective data through shared memory between the ranks of a "
            "group that share a host (same COLLS_HOST_ID, else hostname and boot id); 0 keeps "
            "everything on TCP.",
        ),
        Setting(
            "COLLS_NATIVE", _parse_bool, True,
            "tcp backend: run the shared-memory hot loop (phase waits, tiny all_reduce) in the "
            "optional compiled extension when it was built; 0 runs the pure-Python path. Ranks "
            "may differ.",
        ),
        Setting(
            "COLLS_HOST_ID", _parse_str, "",
            "tcp backend: this process's host identity; ranks with equal identities share memory "
            "and form one host of the two-level collectives. Empty means hostname and kernel "
            "boot id; set it for containers that share a kernel but not /dev/shm, or to emulate "
            "hosts (network namespaces).",
        ),
        Setting(
            "COLLS_TCP_HOST", _parse_str, "",
            "Address the tcp backend binds and advertises to peers; empty means the address "
            "this host uses to reach the store (127.0.0.1 for a local store).",
        ),
        Setting(
            "COLLS_MPI_CUDA_AWARE", _parse_str, "",
            "mpi backend: auto (empty) asks the MPI library whether it accepts CUDA device "
            "memory; 1 asserts that it does; 0 stages CUDA arrays through host memory.",
        ),
        Setting(
            "COLLS_TORCH_TRANSPORT", _parse_str, "tcp",
            "Transport of colls' world when torch.distributed's 'colls' backend creates it "
            "(torch.distributed.init_process_group(\"colls\")): tcp, mpi or any other colls "
            "backend; groups torch makes later use the world's backend; "
            "pg_options={'transport': ...} overrides it per group.",
        ),
        Setting(
            "COLLS_AUTH_TOKEN", _parse_str, "",
            "Shared secret (at least 16 bytes): when set, every TCPStore and tcp peer "
            "connection must prove it knows it (HMAC-SHA256 challenge-response) before anything "
            "else is read; strangers are refused and logged. Set the same value on every rank; "
            "colls-run sets a random one for single-node jobs unless it is set "
            "(see docs/reliability.md).",
        ),
        Setting(
            "COLLS_STORE_PORT", _parse_port, None,
            "Port on MASTER_ADDR where a launcher serves the job's TCPStore (colls-run sets "
            "it). env:// then makes every rank, rank 0 included, a client of that store, "
            "instead of rank 0 serving one on MASTER_PORT; MASTER_PORT stays free for "
            "torch.distributed's own store (see docs/launcher.md).",
        ),
        Setting(
            "COLLS_HANDSHAKE_TIMEOUT", _parse_positive_float, 10.0,
            "Seconds a new TCPStore or tcp peer connection may take to authenticate or send "
            "its first frame (and a started frame to complete) before it is dropped as "
            "half-open.",
        ),
        Setting(
            "COLLS_KEEPALIVE_IDLE", _parse_positive_int, 5,
            "Seconds a TCPStore or tcp peer connection may stay silent before the kernel "
            "probes whether its peer's host is still there (TCP keepalive).",
        ),
        Setting(
            "COLLS_KEEPALIVE_INTERVAL", _parse_positive_int, 2,
            "Seconds between two keepalive probes of a silent connection.",
        ),
        Setting(
            "COLLS_KEEPALIVE_COUNT", _parse_positive_int, 5,
            "Unanswered keepalive probes after which a connection is dropped as lost; data "
            "unacknowledged for IDLE + INTERVAL * COUNT seconds (15 s by default) drops it "
            "too (TCP_USER_TIMEOUT).",
        ),
        Setting(
            "COLLS_MAX_MESSAGE_BYTES", _parse_positive_int, 1 << 36,
            "tcp backend: largest message in bytes a rank sends or accepts (set it equal on "
            "every rank). A larger send is a ValueError; a peer announcing a larger message "
            "loses its connection (NetworkError naming it) before any memory is reserved.",
        ),
        Setting(
            "COLLS_ERROR_FILE", _parse_str, "",
            "Set by colls-run for each worker: the file where the worker wrapper writes the "
            "traceback of an uncaught exception, for the launcher's root-cause report.",
        ),
        Setting(
            "COLLS_JOIN", _parse_bool, False,
            "1 makes init_process_group join a running job as a new rank instead of starting "
            "one: it waits until the members call colls.grow_group, which numbers it after "
            "them (colls-run --on-failure replace sets it for a replacement; "
            "see docs/reliability.md).",
        ),
        Setting(
            "COLLS_INCARNATION", _parse_non_negative_int, 0,
            "Set by colls-run --on-failure replace: 0 for a slot's first process, n for its "
            "n-th replacement (informational; colls itself does not read it).",
        ),
        Setting(
            "COLLS_FR_BUFFER_SIZE", _parse_non_negative_int, 2000,
            "Flight recorder: how many recent calls (of every group) each process keeps for "
            "its dumps; 0 turns the recorder off. Read when the process makes its first group.",
        ),
        Setting(
            "COLLS_FR_DUMP_DIR", _parse_str, "",
            "Flight recorder: the directory each rank writes its dump to "
            "(colls_fr_trace_rank_N for rank N) on a timeout, a dead peer, a mismatch, SIGUSR1 or "
            "colls.debug.dump(); empty means colls-fr-UID in the temp directory (colls-run "
            "sets one per job). Read it with colls-frtrace DIR.",
        ),
        Setting(
            "COLLS_START_METHOD", _parse_start_method, "fork",
            "colls-run's default for --start-method: fork (workers forked from the launcher, "
            "which preloaded NumPy and colls; fast startup) or exec (a fresh interpreter each).",
        ),
    )
}


def get(name: str) -> Any:
    """Return the parsed value of ``name`` from the environment, or its default.

    Raises:
        ValueError: the variable is set to a value its parser rejects (the message names it).
        KeyError: ``name`` is not a known colls setting (a programming error in colls).
    """
    setting = SETTINGS[name]
    raw = _raw(name)
    if raw is None:
        return setting.default
    last = _parsed.get(name)
    if last is not None and last[0] == raw:
        return last[1]
    try:
        value = setting.parse(raw)
    except ValueError as exc:
        raise ValueError(f"environment variable {name}={raw!r}: {exc}") from None
    _parsed[name] = (raw, value)
    return value


#: The last text parsed per variable and its value: collectives read some settings on every call.
_parsed: dict[str, tuple[str, Any]] = {}


def _raw(name: str) -> str | None:
    """Return ``os.environ.get(name)``, quickly when the variable is not set.

    ``os.environ.get`` of an unset name costs about 2 µs (``Mapping.get`` raises and catches a
    KeyError), a fifth of a small collective's whole time, and most ``COLLS_*`` variables are
    unset. CPython keeps the environment in ``os.environ._data`` under ``encodekey(name)``; that
    is read directly where it exists, and ``os.environ.get`` is the fallback (another Python, or
    ``os.environ`` replaced by a plain mapping).
    """
    environ = os.environ
    data = getattr(environ, "_data", None)
    encodekey = getattr(environ, "encodekey", None)
    if data is None or encodekey is None:
        return environ.get(name)
    key = _keys.get(name)
    if key is None:
        key = _keys[name] = encodekey(name)
    value = data.get(key)
    return None if value is None else environ.decodevalue(value)


_keys: dict[str, Any] = {}


def describe() -> str:
    """Return a Markdown table of every setting, its default and its meaning."""
    rows = ["| variable | default | meaning |", "|---|---|---|"]
    for s in SETTINGS.values():
        doc = s.doc.replace("|", "\\|")  # a bare | would end the Markdown cell
        rows.append(f"| `{s.name}` | `{s.default!r}` | {doc} |")
    return "\n".join(rows)
