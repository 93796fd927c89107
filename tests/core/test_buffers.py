"""Tests for colls.buffers and the ctypes DLPack consumer/producer pair."""

from __future__ import annotations

import array
import contextlib
import importlib.util
from typing import Any

import numpy as np
import pytest

from colls import dtypes
from colls.buffers import (
    Buffer,
    as_buffer,
    as_buffers,
    empty_array,
    empty_like_buffer,
    new_array_like,
)
from colls.dtypes import DTYPES, DType
from colls.testing.arrays import (
    ArrayLibrary,
    CtypesDLPackArray,
    array_libraries,
    live_exports,
    random_array,
)

RNG_SEED = 1234
NOT_BF16 = [d for d in DTYPES if d is not dtypes.BFLOAT16]


def buf(obj: Any, writable: bool = True, rank: int | None = 0) -> Buffer:
    return as_buffer(obj, writable=writable, arg="tensor", op="all_reduce", rank=rank)


def ones_words(dtype: DType, n: int) -> np.ndarray:
    if dtype is dtypes.BFLOAT16:
        return dtypes.float32_to_bf16(np.ones(n, np.float32))
    return np.ones(n, dtype.numpy)


# --- NumPy ---------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", NOT_BF16, ids=lambda d: d.name)
def test_numpy_contiguous_is_zero_copy(dtype: DType) -> None:
    data = random_array(dtype, (3, 4), np.random.default_rng(RNG_SEED))
    b = buf(data)
    assert b.obj is data and b.dtype is dtype and b.shape == (3, 4) and b.device == "cpu"
    assert not b.staged and b.array.ndim == 1 and b.array.flags.c_contiguous
    assert np.shares_memory(b.array, data)
    assert b.numel == 12 and b.nbytes == 12 * dtype.itemsize
    b.array[5] = ones_words(dtype, 1)[0]
    assert data.reshape(-1)[5] == ones_words(dtype, 1)[0]
    b.write_back()  # no-op
    assert data.reshape(-1)[5] == ones_words(dtype, 1)[0]


def test_ml_dtypes_bfloat16_numpy_array_is_viewed_as_words() -> None:
    ml_dtypes = pytest.importorskip("ml_dtypes")
    data = np.array([1.0, 2.0, 3.0], dtype=ml_dtypes.bfloat16)
    b = buf(data)
    assert b.dtype is dtypes.BFLOAT16 and b.array.dtype == np.uint16
    assert np.shares_memory(b.array, data)
    np.testing.assert_array_equal(dtypes.bf16_to_float32(b.array), [1.0, 2.0, 3.0])


def test_read_only_numpy_message() -> None:
    data = np.zeros(3, np.float32)
    data.flags.writeable = False
    with pytest.raises(TypeError) as info:
        buf(data, rank=2)
    assert str(info.value) == (
        "all_reduce: argument 'tensor' on rank 2 is read-only (numpy.ndarray); in-place "
        "collectives write into their argument. Use colls.functional.all_reduce, which returns "
        "a new array, instead."
    )
    with pytest.raises(TypeError, match=r"^all_reduce: argument 'tensor' is read-only"):
        buf(data, rank=None)
    b = buf(data, writable=False)  # reading is fine
    assert np.shares_memory(b.array, data)


@pytest.mark.parametrize(
    "make_view",
    [
        lambda a: a.T,
        lambda a: a[:, ::2],
        lambda a: a[::-1],
        lambda a: a[::-1, ::-3],
        lambda a: a[1:, 1:3],
    ],
    ids=["transpose", "step", "negative", "negative-step", "slice"],
)
def test_numpy_non_contiguous_is_staged_and_written_back(make_view: Any) -> None:
    base = np.arange(30, dtype=np.float64).reshape(5, 6)
    original = base.copy()
    view = make_view(base)
    b = buf(view)
    assert b.staged and b.shape == view.shape and b.array.flags.c_contiguous
    np.testing.assert_array_equal(b.array, view.reshape(-1))
    assert not np.shares_memory(b.array, base)
    b.array *= -1
    np.testing.assert_array_equal(base, original)  # nothing written before write_back
    b.write_back()
    expected = original.copy()
    make_view(expected)[...] *= -1
    np.testing.assert_array_equal(base, expected)


def test_non_contiguous_read_only_argument_is_copied_not_staged() -> None:
    base = np.arange(12.0).reshape(3, 4)
    base.flags.writeable = False
    b = buf(base.T, writable=False)
    assert not b.staged and b.array.flags.c_contiguous
    np.testing.assert_array_equal(b.array, base.T.reshape(-1))
    b.write_back()  # nothing to do, and must not try to write the read-only view


def test_zero_d_and_zero_size_numpy() -> None:
    scalar = np.array(5.0, np.float32)
    b = buf(scalar)
    assert b.shape == () and b.numel == 1 and not b.staged
    b.array[0] = 7.0
    assert scalar == 7.0
    for shape in [(0,), (3, 0), (0, 4)]:
        b = buf(np.zeros(shape, np.int32))
        assert b.shape == shape and b.numel == 0 and b.nbytes == 0
    b = buf(np.zeros((4, 0))[::-1])
    assert b.numel == 0
    b.write_back()


def test_numpy_subclass_is_accepted() -> None:
    class Sub(np.ndarray):
        pass

    data = np.arange(4.0).view(Sub)
    b = buf(data)
    assert b.obj is data and type(b.array) is np.ndarray and np.shares_memory(b.array, data)


@pytest.mark.parametrize("bad", [np.zeros(2, "U3"), np.zeros(2, object), np.zeros(2, ">i4")])
def test_unsupported_numpy_dtype_message(bad: np.ndarray) -> None:
    if bad.dtype.isnative and bad.dtype.kind == "i":
        pytest.skip("big-endian machine")
    with pytest.raises(TypeError) as info:
        buf(bad, rank=1)
    message = str(info.value)
    assert message.startswith("all_reduce: argument 'tensor' on rank 1 (numpy.ndarray): ")
    assert "colls supports: bool, int8" in message


# --- Buffer protocol ----------------------------------------------------------------------


def test_buffer_protocol_objects() -> None:
    data = bytearray(b"\x01\x02\x03")
    b = buf(data)
    assert b.dtype is dtypes.UINT8 and b.shape == (3,)
    b.array[0] = 9
    assert data[0] == 9

    doubles = array.array("d", [1.0, 2.0])
    b = buf(doubles)
    assert b.dtype is dtypes.FLOAT64
    b.array[1] = 5.0
    assert doubles[1] == 5.0

    ints = array.array("i", [1, 2, 3, 4])
    b = buf(memoryview(ints)[::2])
    assert b.dtype is dtypes.INT32 and b.staged
    b.array[:] = [7, 8]
    b.write_back()
    assert list(ints) == [7, 2, 8, 4]


def test_read_only_buffer_protocol() -> None:
    with pytest.raises(TypeError, match=r"read-only \(bytes\).*colls\.functional\.all_reduce"):
        buf(b"abc")
    b = buf(b"abc", writable=False)
    assert bytes(b.array) == b"abc"


@pytest.mark.parametrize("bad", [3, "text", None, [1.0, 2.0]])
def test_not_an_array(bad: object) -> None:
    with pytest.raises(TypeError, match="must be an array supporting DLPack or the buffer"):
        buf(bad)


# --- torch ---------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: d.name)
def test_torch_cpu_is_zero_copy(dtype: DType) -> None:
    torch = pytest.importorskip("torch")
    tensor = torch.zeros((2, 3), dtype=getattr(torch, dtype.name))
    b = buf(tensor)
    assert b.dtype is dtype and b.shape == (2, 3) and not b.staged and b.device == "cpu"
    assert b.array.ctypes.data == tensor.data_ptr()
    b.array[:] = ones_words(dtype, 6)
    assert bool((tensor == 1).all())


def test_torch_bfloat16_is_zero_copy_and_shares_numpy_memory() -> None:
    torch = pytest.importorskip("torch")
    tensor = torch.arange(6, dtype=torch.float32).to(torch.bfloat16)
    b = buf(tensor)
    assert b.dtype is dtypes.BFLOAT16 and b.array.dtype == np.uint16
    assert np.shares_memory(b.array, tensor.view(torch.int16).numpy())
    np.testing.assert_array_equal(dtypes.bf16_to_float32(b.array), np.arange(6))
    b.array[:] = dtypes.float32_to_bf16(np.full(6, 2.5, np.float32))
    assert torch.equal(tensor, torch.full((6,), 2.5, dtype=torch.bfloat16))


@pytest.mark.parametrize("dtype", [dtypes.FLOAT32, dtypes.BFLOAT16, dtypes.INT64])
def test_torch_non_contiguous_is_staged_and_written_back(dtype: DType) -> None:
    torch = pytest.importorskip("torch")
    base = torch.arange(24).reshape(4, 6).to(getattr(torch, dtype.name))
    view = base.t()[::2]
    b = buf(view)
    assert b.staged and b.shape == tuple(view.shape)
    b.array[:] = ones_words(dtype, b.numel)
    assert not bool((view == 1).all())
    b.write_back()
    assert bool((view == 1).all())
    untouched = base.clone()
    untouched.t()[::2] = 1
    assert torch.equal(base, untouched)


def test_torch_requires_grad_says_detach() -> None:
    torch = pytest.importorskip("torch")
    with pytest.raises(TypeError, match=r"requires grad .*Pass tensor\.detach\(\) instead"):
        buf(torch.zeros(3, requires_grad=True), writable=False)
    b = buf(torch.zeros(3, requires_grad=True).detach())
    assert b.numel == 3


def test_torch_conjugate_view_is_refused_with_the_reason() -> None:
    torch = pytest.importorskip("torch")
    with pytest.raises(TypeError, match=r"could not be exported through DLPack: .*conjugate"):
        buf(torch.tensor([1 + 2j]).conj(), writable=False)
    b = buf(torch.tensor([1 + 2j]).conj().resolve_conj(), writable=False)
    assert b.array[0] == 1 - 2j


def test_torch_zero_d_and_zero_size() -> None:
    torch = pytest.importorskip("torch")
    scalar = torch.tensor(3.0)
    b = buf(scalar)
    assert b.shape == () and b.numel == 1
    b.array[0] = 4.0
    assert scalar.item() == 4.0
    b = buf(torch.zeros((3, 0), dtype=torch.bfloat16))
    assert b.shape == (3, 0) and b.numel == 0 and b.dtype is dtypes.BFLOAT16


# --- JAX -------------------------------------------------------------------------------------


def test_jax_is_read_only_for_in_place_and_readable_otherwise() -> None:
    jnp = pytest.importorskip("jax.numpy")
    for value, dtype in [(jnp.arange(4.0), dtypes.FLOAT32), (jnp.ones(4, jnp.bfloat16), None)]:
        with pytest.raises(TypeError, match=r"on rank 3 is read-only \(jax") as info:
            as_buffer(value, writable=True, arg="tensor", op="all_reduce", rank=3)
        assert "Use colls.functional.all_reduce" in str(info.value)
        b = as_buffer(value, writable=False, arg="tensor", op="all_reduce", rank=3)
        assert b.dtype is (dtype or dtypes.BFLOAT16)
        words = np.asarray(value).view(b.dtype.numpy)
        np.testing.assert_array_equal(b.array, words)


# --- ctypes producer -------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: d.name)
def test_ctypes_producer_every_dtype_zero_copy(dtype: DType) -> None:
    before = live_exports()
    data = random_array(dtype, (2, 5), np.random.default_rng(RNG_SEED))
    producer = CtypesDLPackArray(data, dtype_code=dtype.dlpack[0])
    b = buf(producer)
    assert b.dtype is dtype and b.shape == (2, 5) and not b.staged
    assert np.shares_memory(b.array, data)
    b.array[:] = ones_words(dtype, 10)
    np.testing.assert_array_equal(data.reshape(-1), ones_words(dtype, 10))
    del b
    assert live_exports() == before  # the consumer called the producer's deleter


def test_ctypes_bfloat16_non_contiguous_staged() -> None:
    words = dtypes.float32_to_bf16(np.arange(20, dtype=np.float32)).reshape(4, 5)
    view = words[::-1, 1::2]
    b = buf(CtypesDLPackArray(view, dtype_code=dtypes.KDL_BFLOAT))
    assert b.staged and b.dtype is dtypes.BFLOAT16 and b.shape == (4, 2)
    np.testing.assert_array_equal(b.array, view.reshape(-1))
    b.array[:] = 0
    b.write_back()
    assert (words[:, 1::2] == 0).all() and (words[:, ::2] != 0).sum() == 11


def test_ctypes_read_only_flag() -> None:
    data = np.arange(3, dtype=np.uint16)
    producer = CtypesDLPackArray(data, dtype_code=dtypes.KDL_BFLOAT, readonly=True)
    with pytest.raises(TypeError, match=r"read-only \(colls\.testing\.arrays\.CtypesDLPackArray\)"):
        buf(producer)
    b = buf(producer, writable=False)
    assert not b.array.flags.writeable and np.shares_memory(b.array, data)


class LegacyOnly:
    """A producer that only knows the pre-1.0 protocol (no max_version)."""

    def __init__(self, inner: CtypesDLPackArray) -> None:
        self.inner = inner
        self.capsules: list[Any] = []

    def __dlpack__(self, stream: Any = None) -> Any:
        capsule = self.inner.__dlpack__(stream=stream)
        self.capsules.append(capsule)
        return capsule

    def __dlpack_device__(self) -> tuple[int, int]:
        return self.inner.__dlpack_device__()


def test_legacy_capsule_is_read_only_and_renamed() -> None:
    words = dtypes.float32_to_bf16(np.array([1.0, 2.0], np.float32))
    producer = LegacyOnly(CtypesDLPackArray(words, dtype_code=dtypes.KDL_BFLOAT))
    b = buf(producer, writable=False)
    np.testing.assert_array_equal(b.array, words)
    assert not b.array.flags.writeable  # a legacy capsule cannot promise writability
    assert "used_dltensor" in repr(producer.capsules[-1])
    with pytest.raises(TypeError, match="read-only"):
        buf(producer)


def test_unsupported_dlpack_dtype_releases_the_capsule() -> None:
    before = live_exports()
    fp8 = CtypesDLPackArray(np.zeros(4, np.uint8), dtype_code=dtypes.KDL_FLOAT)
    with pytest.raises(TypeError) as info:
        buf(fp8, rank=0)
    message = str(info.value)
    assert message.startswith("all_reduce: argument 'tensor' on rank 0 (colls.testing")
    assert "type code 2 and 8 bits" in message and "bfloat16" in message
    assert live_exports() == before


def test_unconsumed_capsule_is_reclaimed() -> None:
    before = live_exports()
    producer = CtypesDLPackArray(np.zeros(4))
    capsule = producer.__dlpack__(max_version=(1, 0))
    legacy = producer.__dlpack__()
    assert live_exports() == before + 2
    del capsule, legacy
    assert live_exports() == before


def test_refusing_consumer_keeps_its_own_error() -> None:
    # NumPy drops the capsule while raising; the producer must not turn that into a SystemError.
    before = live_exports()
    producer = CtypesDLPackArray(np.zeros(4, np.uint16), dtype_code=dtypes.KDL_BFLOAT)
    with pytest.raises((RuntimeError, BufferError, TypeError)) as info:
        np.from_dlpack(producer)
    assert not isinstance(info.value, SystemError)
    assert live_exports() == before


@pytest.mark.parametrize("dtype", [dtypes.FLOAT32, dtypes.BFLOAT16])
def test_torch_consumes_the_ctypes_producer(dtype: DType) -> None:
    torch = pytest.importorskip("torch")
    before = live_exports()
    words = ones_words(dtype, 4)
    tensor = torch.from_dlpack(CtypesDLPackArray(words, dtype_code=dtype.dlpack[0]))
    assert tensor.dtype == getattr(torch, dtype.name) and tensor.data_ptr() == words.ctypes.data
    assert bool((tensor == 1).all())
    del tensor
    assert live_exports() == before


@pytest.mark.parametrize("dtype", [dtypes.FLOAT32, dtypes.BFLOAT16], ids=lambda d: d.name)
def test_pinned_cuda_host_memory_is_cpu(dtype: DType) -> None:
    words = ones_words(dtype, 3)
    producer = CtypesDLPackArray(words, dtype_code=dtype.dlpack[0], device_type=3)
    b = buf(producer)
    assert b.device == "cpu" and b.dtype is dtype and np.shares_memory(b.array, words)


def test_numpy_consumes_the_ctypes_producer() -> None:
    data = np.arange(6.0).reshape(2, 3)[:, ::2]
    imported = np.from_dlpack(CtypesDLPackArray(data))
    np.testing.assert_array_equal(imported, data)
    assert np.shares_memory(imported, data)


class FakeDevice:
    def __init__(self, device_type: int) -> None:
        self.device_type = device_type

    def __dlpack__(self, **kwargs: Any) -> Any:
        raise AssertionError("must not be exported")

    def __dlpack_device__(self) -> tuple[int, int]:
        return (self.device_type, 0)


def test_unknown_device_named() -> None:
    with pytest.raises(TypeError, match=r"DLPack device type 10 \(kDLROCM\).*CPU and CUDA"):
        buf(FakeDevice(10))


def test_cuda_without_cupy() -> None:
    try:
        import cupy  # noqa: F401

        pytest.skip("cupy is installed")
    except ImportError:
        pass
    with pytest.raises(TypeError, match="is a CUDA array .*needs cupy for CUDA arrays"):
        buf(FakeDevice(2))


class FakeJaxGpuArray(FakeDevice):
    """Announces CUDA memory from a JAX module, as a JAX GPU array does (never exported)."""


FakeJaxGpuArray.__module__ = "jaxlib.xla_extension"


def test_a_jax_gpu_array_is_refused_before_an_in_place_write() -> None:
    # JAX exports a legacy capsule without the read-only flag (and CuPy would ignore it):
    # colls must know a JAX array is immutable on the GPU too, before it exports anything.
    with pytest.raises(TypeError, match=r"is read-only \(jaxlib\.xla_extension\.FakeJaxGpuArray\)"
                       r".*colls\.functional\.all_reduce"):
        buf(FakeJaxGpuArray(2))


# --- every library ----------------------------------------------------------------------------


#: The array libraries of colls.testing.arrays, each with the module it needs.
LIBRARIES = {"numpy": None, "torch": "torch", "jax": "jax", "ctypes": None}


def _library(name: str, dtype: DType) -> ArrayLibrary:
    """Return the library ``name``; skip, naming it, when what it needs is not installed."""
    needs = LIBRARIES[name]
    if needs is not None:
        pytest.importorskip(needs, reason=f"needs {needs}")
    if name == "numpy" and dtype is dtypes.BFLOAT16:
        pytest.importorskip("ml_dtypes", reason="needs ml_dtypes (NumPy has no bfloat16)")
    [library] = [lib for lib in array_libraries() if lib.name == name]
    return library


def _holding_64_bits(name: str) -> contextlib.AbstractContextManager[Any]:
    """JAX holds 64-bit dtypes only with jax_enable_x64: turn it on for the test."""
    if name != "jax":
        return contextlib.nullcontext()
    import jax

    return jax.enable_x64(True)  # type: ignore[no-any-return]


def test_every_installed_library_is_listed() -> None:
    names = [lib.name for lib in array_libraries()]
    installed = [n for n, needs in LIBRARIES.items()
                 if needs is None or importlib.util.find_spec(needs) is not None]
    assert names == installed


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: d.name)
@pytest.mark.parametrize("name", list(LIBRARIES))
def test_every_library_round_trips(name: str, dtype: DType) -> None:
    library = _library(name, dtype)
    with _holding_64_bits(name):
        assert library.supports(dtype)
        words = random_array(dtype, (3, 2), np.random.default_rng(RNG_SEED))
        obj = library.from_numpy(words, dtype)
        b = as_buffer(obj, writable=False, arg="x", op="broadcast")
        assert b.dtype is dtype
        np.testing.assert_array_equal(b.array, words.reshape(-1))
        np.testing.assert_array_equal(library.to_numpy(obj), words)
        if name == "jax":  # read-only for in-place ops (test_jax_is_read_only_...)
            return
        b = as_buffer(obj, writable=True, arg="x", op="broadcast")
        b.array[:] = ones_words(dtype, 6)
        np.testing.assert_array_equal(library.to_numpy(obj).reshape(-1), ones_words(dtype, 6))


# --- lists, empties ---------------------------------------------------------------------------


def test_as_buffers_names_the_element() -> None:
    good = np.zeros(2)
    bad = np.zeros(2)
    bad.flags.writeable = False
    buffers = as_buffers([good, good], writable=True, arg="tensor_list", op="all_gather")
    assert len(buffers) == 2 and all(np.shares_memory(b.array, good) for b in buffers)
    with pytest.raises(TypeError, match=r"argument 'tensor_list\[1\]' on rank 4 is read-only"):
        as_buffers([good, bad], writable=True, arg="tensor_list", op="all_gather", rank=4)
    with pytest.raises(TypeError, match="'tensor_list' must be a list of arrays, got numpy"):
        as_buffers(good, writable=True, arg="tensor_list", op="all_gather")  # type: ignore


def test_empty_like_buffer_and_empty_array() -> None:
    b = buf(np.zeros((2, 3), np.float16))
    out = empty_like_buffer(b)
    assert out.shape == (6,) and out.dtype == np.float16
    assert empty_like_buffer(b, (4, 3)).shape == (12,)
    assert empty_array((2,), dtypes.BFLOAT16).dtype == np.uint16
    with pytest.raises(ValueError, match="device must be 'cpu' or 'cuda'"):
        empty_array(1, dtypes.FLOAT32, "tpu")


# --- new_array_like ---------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", NOT_BF16, ids=lambda d: d.name)
def test_new_array_like_numpy(dtype: DType) -> None:
    words = random_array(dtype, 6, np.random.default_rng(RNG_SEED))
    out = new_array_like(np.zeros(1, dtype.numpy), words, (2, 3))
    assert type(out) is np.ndarray and out.shape == (2, 3) and out.dtype == dtype.numpy
    np.testing.assert_array_equal(out.reshape(-1), words)


def test_new_array_like_ml_dtypes_and_unknown_producer() -> None:
    ml_dtypes = pytest.importorskip("ml_dtypes")
    words = dtypes.float32_to_bf16(np.array([1.5, -2.0], np.float32))
    out = new_array_like(np.zeros(2, ml_dtypes.bfloat16), words)
    assert out.dtype == np.dtype(ml_dtypes.bfloat16)
    np.testing.assert_array_equal(out.astype(np.float32), [1.5, -2.0])
    producer = CtypesDLPackArray(np.zeros(2, np.uint16), dtype_code=dtypes.KDL_BFLOAT)
    out = new_array_like(producer, words)
    assert type(out) is np.ndarray and out.dtype == np.uint16


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: d.name)
def test_new_array_like_torch(dtype: DType) -> None:
    torch = pytest.importorskip("torch")
    tdtype = getattr(torch, dtype.name)
    words = random_array(dtype, 6, np.random.default_rng(RNG_SEED))
    out = new_array_like(torch.zeros(1, dtype=tdtype), words, (3, 2))
    assert isinstance(out, torch.Tensor) and out.dtype == tdtype and tuple(out.shape) == (3, 2)
    np.testing.assert_array_equal(buf(out, writable=False).array, words)


@pytest.mark.parametrize("dtype", [d for d in DTYPES if d.itemsize < 8 or d is dtypes.COMPLEX64])
def test_new_array_like_jax(dtype: DType) -> None:
    jnp = pytest.importorskip("jax.numpy")
    jdtype = jnp.bfloat16 if dtype is dtypes.BFLOAT16 else dtype.numpy
    words = random_array(dtype, 6, np.random.default_rng(RNG_SEED))
    out = new_array_like(jnp.zeros(1, jdtype), words, (2, 3))
    assert type(out).__module__.startswith("jax") and out.shape == (2, 3)
    assert dtypes.from_any(out) is dtype
    np.testing.assert_array_equal(np.asarray(out).view(dtype.numpy).reshape(-1), words)
