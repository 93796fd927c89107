"""What the nccl backend needs before a communicator exists: CuPy, a device, a unique id.

* :func:`unavailable_reason` says why NCCL cannot be used here, importing CuPy only when asked.
* :func:`choose_device` picks this rank's GPU: the ``device`` group option, else the only
  visible device (``srun --gpus-per-task`` and similar launchers narrow CUDA_VISIBLE_DEVICES to
  one GPU per task), else the local rank (LOCAL_RANK as colls-run and torchrun set, else srun's
  or mpiexec's), else CuPy's current device.
* :func:`exchange_unique_id`: rank 0 makes the NCCL unique id and publishes it through the
  group's store (prefixed per group, so every group gets a fresh id); the others read it. Making
  an id needs libnccl but no GPU and no driver.
* :func:`check_distinct_devices`: every rank publishes its GPU's UUID; two ranks on one GPU are
  reported naming both ranks and the device, before NCCL would fail with "duplicate GPU".
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, Final

from colls import launch_env
from colls.errors import BackendUnavailableError

if TYPE_CHECKING:
    from colls.store.base import Store

__all__ = [
    "INSTALL_HINT",
    "check_distinct_devices",
    "choose_device",
    "exchange_unique_id",
    "id_bytes",
    "import_nccl",
    "new_communicator",
    "unavailable_reason",
]

INSTALL_HINT: Final = (
    "pip install -e '.[cuda12]' in a checkout of colls ('.[cuda13]' for CUDA 13), or pip install "
    "cupy-cuda12x nvidia-nccl-cu12"
)
#: Store key (in the group's prefixed store) of the group's NCCL unique id.
UNIQUE_ID_KEY: Final = "nccl/unique_id"
#: Store key prefix of each rank's GPU identity ("nccl/device/<rank>").
DEVICE_KEY: Final = "nccl/device/{rank}"
#: Bytes in an NCCL unique id (NCCL_UNIQUE_ID_BYTES in nccl.h).
UNIQUE_ID_BYTES: Final = 128


def import_nccl() -> tuple[Any, Any]:
    """Return ``(cupy, cupy.cuda.nccl)``.

    Raises:
        BackendUnavailableError: CuPy is missing, or cannot load libnccl (the reason says which).
    """
    try:
        import cupy
    except ImportError:
        raise BackendUnavailableError(
            f"nccl: cupy is not installed ({INSTALL_HINT})"
        ) from None
    except Exception as exc:  # a broken CuPy install raises anything at import
        raise BackendUnavailableError(
            f"nccl: cupy failed to import: {type(exc).__name__}: {exc}"
        ) from exc
    try:
        from cupy.cuda import nccl
    except ImportError as exc:
        raise BackendUnavailableError(f"nccl: cupy has no NCCL bindings ({exc})") from None
    if not getattr(nccl, "available", False):
        raise BackendUnavailableError(
            "nccl: cupy cannot load libnccl (pip install nvidia-nccl-cu12, or nvidia-nccl-cu13 "
            "for CUDA 13)"
        )
    return cupy, nccl


def unavailable_reason() -> str | None:
    """Return None when NCCL can run here, else why not (no CuPy, no libnccl, no device)."""
    try:
        cupy, _nccl = import_nccl()
    except BackendUnavailableError as exc:
        return str(exc)
    try:
        count = int(cupy.cuda.runtime.getDeviceCount())
    except Exception as exc:  # CUDARuntimeError: no driver, or a driver older than the runtime
        return f"nccl: no CUDA device ({type(exc).__name__}: {exc})"
    if count == 0:
        return "nccl: no CUDA device (the driver reports none)"
    return None


def choose_device(
    extra: Mapping[str, Any], environ: Mapping[str, str], device_count: int, current: int
) -> int:
    """Return the CUDA device index this rank uses.

    Args:
        extra: the group's options; ``extra["device"]`` (an int) wins when given.
        environ: the environment; the local rank picks the device when set and more than one
            device is visible (LOCAL_RANK, else srun's or mpiexec's:
            :func:`colls.launch_env.local_rank_variable`).
        device_count: the number of visible CUDA devices; with exactly one, it is used whatever
            the local rank (each task of the node sees its own GPU as device 0).
        current: CuPy's current device, used when neither is set.

    Raises:
        ValueError: the chosen index is not a visible device, or not an int.
    """
    if "device" in extra:
        device, source = extra["device"], "pg_options device"
    elif device_count == 1:
        return 0
    elif (local := launch_env.local_rank_variable(environ)) is not None:
        name, text = local
        try:
            device = int(text)
        except ValueError:
            raise ValueError(f"nccl: {name}={text!r} is not an integer") from None
        source = f"{name}={text}"
    else:
        device, source = current, "the current CUDA device"
    if isinstance(device, bool) or not isinstance(device, int):
        raise ValueError(f"nccl: {source} must be an int, got {type(device).__name__}")
    if not 0 <= device < device_count:
        raise ValueError(
            f"nccl: {source} selects CUDA device {device}, but {device_count} "
            f"device(s) are visible (0..{device_count - 1}); set CUDA_VISIBLE_DEVICES or "
            "pass pg_options={'device': index}"
        )
    return device


def exchange_unique_id(
    store: Store, rank: int, make_id: Callable[[], bytes], timeout: float
) -> bytes:
    """Return the group's NCCL unique id: made by rank 0, read from the store by the others.

    Raises:
        StoreTimeoutError: rank 0 did not publish the id within ``timeout`` seconds.
        BackendError: the value in the store is not a unique id.
    """
    if rank == 0:
        unique_id = id_bytes(make_id())
        store.set(UNIQUE_ID_KEY, unique_id)
    else:
        store.wait([UNIQUE_ID_KEY], timeout)
        unique_id = store.get(UNIQUE_ID_KEY)
    if len(unique_id) != UNIQUE_ID_BYTES:
        from colls.errors import BackendError

        raise BackendError(
            f"nccl: the unique id in the group's store has {len(unique_id)} bytes, expected "
            f"{UNIQUE_ID_BYTES}"
        )
    return unique_id


def id_bytes(made: Any) -> bytes:
    """Return a unique id from ``nccl.get_unique_id()`` as bytes.

    CuPy 14 returns bytes; CuPy 13 a tuple of C ``char`` values, signed (-128..127).
    """
    if isinstance(made, (bytes, bytearray)):
        return bytes(made)
    return bytes(value & 0xFF for value in made)


def new_communicator(nccl: Any, world_size: int, unique_id: bytes, rank: int) -> Any:
    """Run ``NcclCommunicator(world_size, unique_id, rank)`` with the id in the form this CuPy
    takes: bytes (CuPy 14), or the tuple of signed chars that CuPy 13's get_unique_id returns.
    """
    try:
        return nccl.NcclCommunicator(world_size, unique_id, rank)
    except TypeError:
        signed = tuple(value - 256 if value > 127 else value for value in unique_id)
        return nccl.NcclCommunicator(world_size, signed, rank)


def check_distinct_devices(
    store: Store, rank: int, world_size: int, identity: str, description: str, timeout: float
) -> None:
    """Publish this rank's GPU and refuse the group if two ranks share one.

    Args:
        store: the group's store.
        rank: this rank in the group.
        world_size: the group size.
        identity: a globally unique name of the GPU (its UUID).
        description: how to name the GPU to a human ("CUDA device 0 (GPU-1a2b...)").
        timeout: seconds to wait for the other ranks' entries.

    Raises:
        ValueError: two ranks use one GPU (names both ranks and the device).
        StoreTimeoutError: a rank did not publish its GPU within ``timeout``.
    """
    store.set(DEVICE_KEY.format(rank=rank), f"{identity}\n{description}")
    keys = [DEVICE_KEY.format(rank=r) for r in range(world_size)]
    store.wait(keys, timeout)
    owner: dict[str, int] = {}
    for r, value in enumerate(store.multi_get(keys)):
        their_identity, _, their_description = value.decode().partition("\n")
        first = owner.setdefault(their_identity, r)
        if first != r:
            raise ValueError(
                f"nccl: ranks {first} and {r} of the group both use {their_description}; NCCL "
                "allows one rank per GPU (duplicate GPU). Give each rank its own device: run "
                "one process per GPU with LOCAL_RANK set (colls-run does), or pass "
                "pg_options={'device': index}"
            )

