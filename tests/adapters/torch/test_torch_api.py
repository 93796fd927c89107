"""Units of colls_torch: the error table, reduce ops, Backend, Work, stores, single-process use.

Anything that starts threads or a group (a TCPStore server) runs in a child process
(``run_fresh``), so that no test leaves threads or sockets behind in the pytest process.
"""

from __future__ import annotations

import datetime

import pytest

torch = pytest.importorskip("torch")
import colls_torch as C  # noqa: E402
import torch.distributed as T  # noqa: E402
from colls_torch import _errors, _ops  # noqa: E402
from colls_torch._stores import TorchStore  # noqa: E402
from colls_torch._tensors import Staging, shared_numpy  # noqa: E402
from ct_pool import run_fresh  # noqa: E402

import colls  # noqa: E402
from colls import errors  # noqa: E402
from colls.reduce_ops import PremulSum, RedOpType  # noqa: E402
from colls.testing.spawn import free_port  # noqa: E402

# -- the error table ---------------------------------------------------------------------------


@pytest.mark.parametrize("colls_error, torch_error", [
    (errors.StoreTimeoutError, T.DistStoreError),
    (errors.StoreError, T.DistStoreError),
    (errors.NetworkError, T.DistNetworkError),
    (errors.CollsTimeoutError, T.DistBackendError),
    (errors.BackendError, T.DistBackendError),
    (errors.RendezvousError, _errors.RendezvousError),  # a ValueError and a RuntimeError
    (errors.CollsError, T.DistError),
])
def test_error_table_maps_and_chains(colls_error, torch_error):
    with pytest.raises(torch_error, match="peer 3 is gone") as info:
        with _errors.translated():
            raise colls_error("peer 3 is gone")
    assert type(info.value) is torch_error
    assert isinstance(info.value.__cause__, colls_error)


def test_backend_unavailable_passes_through_unchanged():
    with pytest.raises(errors.BackendUnavailableError):
        with _errors.translated():
            raise errors.BackendUnavailableError("nccl: cupy is not installed")


def test_backend_call_turns_colls_argument_errors_into_runtime_errors():
    with pytest.raises(RuntimeError, match="expected 3") as info:
        with _errors.backend_call():
            raise ValueError("tensor_list must hold 3 arrays, expected 3")
    assert isinstance(info.value.__cause__, ValueError)


def test_caller_mistakes_keep_their_types():
    with pytest.raises(TypeError), _errors.translated():
        raise TypeError("not a tensor")


# -- reduce ops --------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["SUM", "AVG", "PRODUCT", "MIN", "MAX", "BAND", "BOR", "BXOR"])
def test_torch_ops_map_to_colls_ops(name):
    assert _ops.to_colls(getattr(T.ReduceOp, name)) is RedOpType[name]
    assert _ops.to_colls(T.ReduceOp(getattr(T.ReduceOp, name))) is RedOpType[name]


@pytest.mark.parametrize("factor", [2.5, torch.tensor([2.5])])
def test_premul_sum_keeps_its_factor(factor):
    op = _ops.to_colls(T._make_nccl_premul_sum(factor))
    assert isinstance(op, PremulSum) and op.factor == 2.5


def test_bad_op_is_a_type_error():
    with pytest.raises(TypeError, match="ReduceOp"):
        _ops.to_colls(3.5)


@pytest.mark.parametrize("op, dtype, fn, error", [
    ("BAND", torch.float32, "all_reduce", RuntimeError),
    ("BXOR", torch.bfloat16, "reduce", RuntimeError),
    ("AVG", torch.int64, "all_reduce", RuntimeError),
    ("PREMUL_SUM", torch.int32, "all_reduce", RuntimeError),
    ("MAX", torch.complex64, "all_reduce", ValueError),
    ("MIN", torch.complex64, "reduce", RuntimeError),
])
def test_op_dtype_rules(op, dtype, fn, error):
    with pytest.raises(error):
        _ops.check_reduction(op, dtype, fn)


#: (op, inputs of rank 0 and rank 1, expected result): pairs the rules allow, on values exact
#: in their dtype. bool SUM is OR, as in torch; colls multiplies complex numbers correctly.
ALLOWED_PAIRS = [
    ("SUM", torch.tensor([True, False, False]), torch.tensor([True, True, False]),
     torch.tensor([True, True, False])),
    ("BAND", torch.tensor([True, False, True]), torch.tensor([True, True, False]),
     torch.tensor([True, False, False])),
    ("AVG", torch.tensor([1.0, 2.0, -3.0, 0.5], dtype=torch.bfloat16),
     torch.tensor([3.0, 2.0, 1.0, 0.5], dtype=torch.bfloat16),
     torch.tensor([2.0, 2.0, -1.0, 0.5], dtype=torch.bfloat16)),
    ("PRODUCT", torch.tensor([1 + 2j, -1j], dtype=torch.complex64),
     torch.tensor([3 - 1j, 2 + 0j], dtype=torch.complex64),
     torch.tensor([5 + 5j, -2j], dtype=torch.complex64)),
]


def _reduce_allowed_pairs(rank: int, size: int) -> list[torch.Tensor]:
    C.init_process_group("gloo")  # env:// from RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT
    out = []
    for op, first, second, _ in ALLOWED_PAIRS:
        t = (first if rank == 0 else second).clone()
        C.reduce(t, 0, op=getattr(T.ReduceOp, op))
        out.append(t)
    C.destroy_process_group()
    return out


def test_allowed_op_dtype_pairs_reduce_correctly():
    at_root, _ = run_fresh(_reduce_allowed_pairs, 2)
    for (op, _, _, expected), got in zip(ALLOWED_PAIRS, at_root, strict=True):
        assert got.dtype == expected.dtype and torch.equal(got, expected), (op, got, expected)


def _all_reduce_lanes(rank: int, size: int) -> list[tuple[str, bool, bool, list[float]]]:
    """all_reduce tensors of several kinds; note which ones ran in the core's fast path."""
    from colls import _fast_path

    ran: list[bool] = []
    fast = _fast_path.all_reduce

    def recorded(tensor, op, group=None):  # the core calls its fast path through the module
        done = fast(tensor, op, group)
        ran.append(done)
        return done

    _fast_path.all_reduce = recorded
    C.init_process_group("gloo")  # env:// from RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT
    out = []
    for name, tensor in (
        ("float32", torch.full((3,), float(rank + 1))),
        ("Parameter", torch.nn.Parameter(torch.full((2,), float(rank + 1)))),
        ("0-d int64", torch.tensor(rank + 1)),
        ("bfloat16", torch.full((3,), float(rank + 1), dtype=torch.bfloat16)),
        ("strided", torch.full((3, 2), float(rank + 1))[:, 0]),
    ):
        ran.clear()
        C.all_reduce(tensor)
        out.append((name, ran == [True], bool(ran), tensor.detach().float().reshape(-1).tolist()))
    row = C.new_group([0, 1])  # a subgroup's all_reduce takes the fast path too
    tensor = torch.full((3,), float(rank + 1))
    ran.clear()
    C.all_reduce(tensor, group=row)
    out.append(("subgroup", ran == [True], bool(ran), tensor.tolist()))
    C.destroy_process_group()
    return out


def test_all_reduce_of_plain_cpu_tensors_takes_the_core_fast_path():
    for rank_results in run_fresh(_all_reduce_lanes, 2):
        by_name = {name: (fast, tried, values) for name, fast, tried, values in rank_results}
        for name in ("float32", "Parameter", "0-d int64", "subgroup"):
            fast, _, values = by_name[name]
            assert fast, f"{name}: not run by the core's fast path"
            assert values == [3.0] * len(values), (name, values)
        for name in ("bfloat16", "strided"):  # DLPack and the general path, as before
            fast, _, values = by_name[name]
            assert not fast and values == [3.0] * len(values), (name, values)


# -- Backend, availability -----------------------------------------------------------------------


def test_backend_names_normalise_as_torch():
    assert C.Backend("GLOO") == "gloo" == C.Backend.GLOO
    assert C.Backend("Tcp") == "tcp" and isinstance(C.Backend("mpi"), str)
    with pytest.raises(ValueError):
        C.Backend(3)


def test_availability_follows_colls_backends():
    status = colls.available_backends()
    assert C.is_available() and C.is_gloo_available()
    assert C.is_mpi_available() == (status.get("mpi", "absent") is None)
    assert C.is_nccl_available() == (status.get("nccl", "absent") is None)
    assert C.is_backend_available("gloo") and not C.is_backend_available("no-such")


def test_the_colls_backend_is_registered_with_torch():
    assert "colls" in T.Backend.backend_list
    assert T.Backend.backend_capability["colls"] == ["cpu", "cuda"]
    assert T.Backend.default_device_backend_map["cpu"] == "gloo"  # not taken over


# -- Work --------------------------------------------------------------------------------------


def test_failed_work_raises_torch_errors_everywhere():
    inner = colls.Work.failed(errors.NetworkError("rank 2 (10.0.0.2:1234) died"))
    work = C.Work(inner, [torch.ones(1)])
    with pytest.raises(T.DistNetworkError, match="rank 2") as info:
        work.wait()
    assert isinstance(info.value.__cause__, errors.NetworkError)
    assert work.is_completed() and not work.is_success()
    assert isinstance(work.exception(), T.DistNetworkError)
    with pytest.raises(T.DistNetworkError):
        work.get_future().wait()


def test_completed_work_future_has_the_outputs():
    out = torch.arange(3.0)
    work = C.Work(colls.Work.completed(None), [out])
    assert work.wait(datetime.timedelta(seconds=1)) is True
    assert work.result() == [out] and work.get_future().wait() == [out]


def test_work_future_completes_later():
    inner = colls.Work(description="pending op")
    work = C.Work(inner, [torch.zeros(1)])
    future = work.get_future()
    assert not future.done()
    inner.set_result(None)
    assert future.done() and torch.equal(future.wait()[0], torch.zeros(1))


def test_work_wait_timeout_is_a_backend_error():
    work = C.Work(colls.Work(description="stuck op"))
    with pytest.raises(T.DistBackendError, match="stuck op"):
        work.wait(datetime.timedelta(milliseconds=50))


# -- staging -----------------------------------------------------------------------------------


def test_staging_detaches_grad_tensors_and_shares_storage():
    param = torch.nn.Parameter(torch.ones(3))
    st = Staging(("cpu",))
    target = st.target(param)
    assert not target.requires_grad and target.data_ptr() == param.data_ptr()
    assert not st.staged


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.int64, torch.bool,
                                   torch.complex128])
def test_shared_numpy_views_a_contiguous_cpu_tensor_without_copying(dtype):
    tensor = torch.nn.Parameter(torch.ones(2, 3, dtype=dtype), requires_grad=dtype.is_floating_point
                                or dtype.is_complex)
    array = shared_numpy(tensor)
    assert array.shape == (2, 3) and array.ctypes.data == tensor.data_ptr()
    assert str(array.dtype) == str(tensor.dtype).removeprefix("torch.")


@pytest.mark.parametrize("make", [
    lambda: torch.ones(4, dtype=torch.bfloat16),  # NumPy has no bfloat16: DLPack and ml_dtypes
    lambda: torch.ones(4, 4)[:, 1],  # not contiguous
    lambda: torch.ones(3, dtype=torch.complex64).conj(),  # a lazy conjugate
    lambda: torch.ones(3).to_sparse(),
], ids=["bfloat16", "strided", "conjugate", "sparse"])
def test_shared_numpy_leaves_other_tensors_to_dlpack(make):
    assert shared_numpy(make()) is None


# -- stores ------------------------------------------------------------------------------------


def test_hash_store_timeout_is_dist_store_error():
    store = C.HashStore(timeout=datetime.timedelta(milliseconds=50))
    store.set("a", b"1")
    assert store.get("a") == b"1" and store.add("n", 2) == 2
    with pytest.raises(T.DistStoreError, match="missing"):
        store.get("missing")


def test_tcp_store_unreachable_is_dist_network_error():
    with pytest.raises(T.DistNetworkError):
        C.TCPStore("127.0.0.1", free_port(), timeout=datetime.timedelta(milliseconds=300))


def test_prefix_store_accepts_a_torch_store():
    base = T.HashStore()
    store = C.PrefixStore("job", base)
    store.set("k", "v")
    assert base.get("job/k") == b"v" and store.get("k") == b"v"


def test_torch_store_adapter_implements_the_colls_store():
    raw = T.HashStore()
    store = TorchStore(raw)
    store.set("k", b"v")
    assert store.get("k") == b"v" and raw.get("k") == b"v"
    assert store.add("c", 5) == 5 and store.add("c", 1) == 6
    assert store.compare_set("k", b"v", b"w") == b"w"
    assert store.check(["k", "c"]) and not store.check(["nope"])
    store.wait(["k"], 1.0)
    assert store.num_keys() == raw.num_keys()
    assert store.delete_key("k") and not store.check(["k"])
    with pytest.raises(errors.StoreTimeoutError, match="nope"):
        store.wait(["nope"], 0.05)


def test_torch_store_adapter_close_ends_a_wait():
    store = TorchStore(T.HashStore())
    store.close()
    with pytest.raises(errors.StoreError, match="closed"):
        store.get("k")


# -- one process, one world -----------------------------------------------------------------------


def _single_process(rank: int, size: int) -> dict[str, object]:
    C.init_process_group("gloo", store=T.HashStore(), rank=0, world_size=1)
    t = torch.arange(4.0)
    out = {
        "backend": str(C.get_backend()),
        "torch's world": (T.is_initialized(), T.get_backend(), C.group.WORLD is T.group.WORLD),
        "all_reduce": (C.all_reduce(t), t.tolist()),
        "twice": _raises(lambda: C.init_process_group("gloo", store=T.HashStore(), rank=0,
                                                      world_size=1)),
        "world group rank": C.get_group_rank(C.group.WORLD, 7),
    }
    C.destroy_process_group()
    out["after destroy"] = (C.is_initialized(), _raises(lambda: C.get_rank()),
                            T.is_initialized())
    return out


def _raises(call):
    try:
        call()
    except Exception as exc:
        return type(exc).__name__
    return "no error"


def test_single_process_world_is_torchs_world():
    [out] = run_fresh(_single_process, 1)
    assert out == {
        "backend": "gloo", "torch's world": (True, "colls", True),
        "all_reduce": (None, [0.0, 1.0, 2.0, 3.0]),
        "twice": "ValueError", "world group rank": 7,
        "after destroy": (False, "ValueError", False),
    }


def _dropin_env(rank: int, size: int) -> tuple[str, list[float], int]:
    C.init_process_group("gloo")  # env:// from RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT
    t = torch.tensor([float(rank + 1)])
    C.all_reduce(t)
    result = (str(C.get_backend()), t.tolist(), C.get_world_size())
    C.destroy_process_group()
    return result


def test_dropin_env_rendezvous():
    assert run_fresh(_dropin_env, 2) == [("gloo", [3.0], 2)] * 2


# -- group bookkeeping: get_pg_count, get_backend_config, default backends -----------------------


def _group_bookkeeping(dist: object) -> list[object]:
    """The same calls through ``dist`` (torch.distributed or colls_torch), one rank."""
    seen: list[object] = [dist.get_pg_count()]
    dist.init_process_group("gloo", store=T.HashStore(), rank=0, world_size=1)
    seen += [dist.get_pg_count(), dist.get_backend_config()]
    first = dist.new_group([0])
    second = dist.new_group([0], backend="gloo")
    seen += [dist.get_pg_count(), dist.get_backend_config(second)]
    dist.destroy_process_group(first)
    seen.append(dist.get_pg_count())
    dist.destroy_process_group()
    seen += [dist.get_pg_count(), _raises(dist.get_backend_config)]
    seen += [dist.get_default_backend_for_device(d) for d in ("cpu", torch.device("cpu"))]
    seen.append(_raises(lambda: dist.get_default_backend_for_device("meta")))
    seen += [dist.supports_complex(op) for op in (T.ReduceOp.SUM, T.ReduceOp.MAX)]
    return seen


def _bookkeeping_both_faces(rank: int, size: int) -> tuple[list[object], list[object]]:
    return _group_bookkeeping(T), _group_bookkeeping(C)


def test_group_bookkeeping_matches_torch():
    [(from_torch, from_colls)] = run_fresh(_bookkeeping_both_faces, 1)
    assert from_colls == from_torch
    assert from_colls[:5] == [0, 1, "cpu:gloo,cuda:gloo", 3, "cpu:gloo,cuda:gloo"]


def test_default_backend_for_cuda_is_one_colls_can_run():
    chosen = C.get_default_backend_for_device("cuda")
    assert C.is_backend_available(chosen)  # what a script passes on to init_process_group
    assert chosen == ("nccl" if C.is_nccl_available() else "gloo")
    assert C.get_default_backend_for_device(torch.device("cuda", 0)) == chosen
    assert C.supports_complex is T.supports_complex
