"""gpu_check.sh's first step: what this machine has, and whether NCCL can run here at all.

Prints one line each: the NCCL verdict, Python, the driver and the CUDA runtime (as CuPy reports
them), CuPy, NCCL, every visible device, torch (with its CUDA and whether it sees a GPU), jax
(with its devices), NumPy, pluggy, pytest and pytest-timeout. Each is looked up on its own: a
missing or broken one is printed as such and does not hide the others.

Exit status: 1, at once after those lines, when
:func:`colls_plugins.nccl.runtime.unavailable_reason` is not None (no CuPy, no libnccl, no
device), naming the reason: every GPU test would be skipped, and a run that skips everything
must not pass. 0 otherwise. Run from the repository root; needs colls importable (the tree on
PYTHONPATH is enough: nothing is installed yet when it runs).
"""

from __future__ import annotations

import importlib
import importlib.metadata
import platform
import sys
from collections.abc import Callable
from typing import Any


def _line(name: str, describe: Callable[[], Any]) -> None:
    try:
        text = describe()
    except Exception as exc:  # a missing or broken component is a finding, not a crash
        text = f"unavailable ({type(exc).__name__}: {exc})"
    print(f"{name:<16} {text}", flush=True)


def _version(module: str) -> str:
    return str(importlib.import_module(module).__version__)


def _cuda_version(number: int) -> str:
    return f"{number // 1000}.{number % 1000 // 10} ({number})"


def _devices() -> str:
    import cupy

    runtime = cupy.cuda.runtime
    names = []
    for index in range(runtime.getDeviceCount()):
        props = runtime.getDeviceProperties(index)
        name = props["name"].decode() if isinstance(props["name"], bytes) else props["name"]
        names.append(f"{index}: {name}, {props['totalGlobalMem'] / 2**30:.0f} GiB, "
                     f"sm_{props['major']}{props['minor']}")
    return "; ".join(names) or "none"


def _nccl() -> str:
    from cupy.cuda import nccl

    code = nccl.get_version()
    return f"{code // 10000}.{code // 100 % 100}.{code % 100} ({code})"


def _torch() -> str:
    import torch

    seen = torch.cuda.is_available()
    device = f", {torch.cuda.get_device_name(0)}" if seen else ""
    return f"{torch.__version__}, CUDA {torch.version.cuda}, cuda available: {seen}{device}"


def _jax() -> str:
    import jax

    return f"{jax.__version__}, devices: {jax.devices()}"


def main() -> int:
    """Print the lines; return the exit status."""
    from colls_plugins.nccl import runtime

    reason = runtime.unavailable_reason()
    print(f"{'nccl usable':<16} {'yes' if reason is None else 'NO: ' + reason}", flush=True)
    _line("python", lambda: f"{platform.python_version()} ({sys.executable})")
    _line("cuda driver", lambda: _cuda_version(
        importlib.import_module("cupy").cuda.runtime.driverGetVersion()))
    _line("cuda runtime", lambda: _cuda_version(
        importlib.import_module("cupy").cuda.runtime.runtimeGetVersion()))
    _line("cupy", lambda: _version("cupy"))
    _line("nccl", _nccl)
    _line("devices", _devices)
    _line("torch", _torch)
    _line("jax", _jax)
    for distribution in ("numpy", "pluggy", "pytest", "pytest-timeout"):
        _line(distribution, lambda name=distribution: importlib.metadata.version(name))
    if reason is not None:
        print(f"gpu_check: the GPU tests cannot run here: {reason}", flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
