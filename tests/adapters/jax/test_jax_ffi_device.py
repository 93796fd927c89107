"""colls_jax's FFI handlers called as XLA calls them: the CPU side of the CUDA handler
(``_ffi_native.device_handler``), and the host handler's hand-off to its call sites.

No GPU runs here: tests/gpu/test_jax_cuda.py runs the device handler under XLA on one. These
tests check what can be checked without one:

* the subset of XLA's FFI C API that ``_ffi_native.c`` declares has the layout of jaxlib's own
  ``xla/ffi/api/c_api.h`` (both compiled, offsets compared): the device handler reads
  ``XLA_FFI_Stream_Get`` and ``XLA_FFI_DeviceOrdinal_Get`` at fixed offsets of XLA's table;
* the handler, called as XLA calls it (a call frame built with ctypes, the FFI API's functions
  as ctypes callbacks), hands the device dispatcher the call site's key, every non-token buffer
  as its (pointer, bytes), the stream XLA_FFI_Stream_Get returned and the device ordinal; it
  answers XLA's metadata query, and it turns a dispatcher's exception and an FFI API error into
  XLA errors;
* the host handler (``_ffi_native.handler``, which jitted programs on the CPU run in every other
  test of colls_jax) calls the call site ``key`` of the list ``set_sites`` gave it with a
  writable memoryview of each non-token buffer, inputs then outputs, and turns a missing site
  and a runner's exception into XLA errors.
"""

from __future__ import annotations

import ctypes
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

jax = pytest.importorskip("jax", reason="needs jax")
try:
    from colls_jax import _ffi_native
except ImportError as exc:  # a checkout built without a C compiler
    pytest.skip(f"colls_jax._ffi_native was not built ({exc})", allow_module_level=True)

SOURCE = Path(__file__).parents[3] / "adapters" / "colls_jax" / "_ffi_native.c"

# -- ctypes mirrors of the structs XLA passes (xla/ffi/api/c_api.h) -----------------------------

c_size, c_i64, c_int, c_void = ctypes.c_size_t, ctypes.c_int64, ctypes.c_int, ctypes.c_void_p


class ExtensionBase(ctypes.Structure):
    _fields_ = [("struct_size", c_size), ("type", c_int), ("next", c_void)]


class Buffer(ctypes.Structure):
    _fields_ = [("struct_size", c_size), ("extension_start", c_void), ("dtype", c_int),
                ("data", c_void), ("rank", c_i64), ("dims", ctypes.POINTER(c_i64))]


class Items(ctypes.Structure):
    _fields_ = [("struct_size", c_size), ("extension_start", c_void), ("size", c_i64),
                ("types", ctypes.POINTER(c_int)), ("items", ctypes.POINTER(c_void))]


class ByteSpan(ctypes.Structure):
    _fields_ = [("ptr", ctypes.c_char_p), ("len", c_size)]


class Scalar(ctypes.Structure):
    _fields_ = [("dtype", c_int), ("value", c_void)]


class Attrs(ctypes.Structure):
    _fields_ = [("struct_size", c_size), ("extension_start", c_void), ("size", c_i64),
                ("types", ctypes.POINTER(c_int)),
                ("names", ctypes.POINTER(ctypes.POINTER(ByteSpan))),
                ("attrs", ctypes.POINTER(c_void))]


class ApiVersion(ctypes.Structure):
    _fields_ = [("struct_size", c_size), ("extension_start", c_void), ("major", c_int),
                ("minor", c_int)]


API_FUNCTIONS = ("Error_Create", "Error_GetMessage", "Error_Destroy", "Handler_Register",
                 "Stream_Get", "Type_Register", "ExecutionContext_Get", "State_Set", "State_Get",
                 "DeviceMemory_Allocate", "DeviceMemory_Free", "ThreadPool_Schedule",
                 "ThreadPool_NumThreads", "Future_Create", "Future_SetAvailable",
                 "Future_SetError", "RunId_Get", "DeviceOrdinal_Get")


class Api(ctypes.Structure):
    _fields_ = [("struct_size", c_size), ("extension_start", c_void), ("api_version", ApiVersion),
                ("internal_api", c_void)] + [(name, c_void) for name in API_FUNCTIONS]


class CallFrame(ctypes.Structure):
    _fields_ = [("struct_size", c_size), ("extension_start", c_void),
                ("api", ctypes.POINTER(Api)), ("ctx", c_void), ("stage", c_int),
                ("args", Items), ("rets", Items), ("attrs", Attrs), ("future", c_void)]


class ErrorCreateArgs(ctypes.Structure):
    _fields_ = [("struct_size", c_size), ("extension_start", c_void),
                ("message", ctypes.c_char_p), ("errc", c_int)]


class StreamGetArgs(ctypes.Structure):
    _fields_ = [("struct_size", c_size), ("extension_start", c_void), ("ctx", c_void),
                ("stream", c_void)]


class OrdinalGetArgs(ctypes.Structure):
    _fields_ = [("struct_size", c_size), ("extension_start", c_void), ("ctx", c_void),
                ("device_ordinal", ctypes.c_int32)]


class MetadataExtension(ctypes.Structure):
    _fields_ = [("extension_base", ExtensionBase), ("metadata", c_void)]


class Metadata(ctypes.Structure):
    _fields_ = [("struct_size", c_size), ("api_version", ApiVersion), ("traits", ctypes.c_uint32),
                ("state_type_id", c_i64)]


F32, S64, TOKEN, SCALAR_ATTR, EXTENSION_METADATA = 11, 5, 17, 3, 1
STREAM, CONTEXT = 0x7E57_0000, 0xC0_7E47


class FakeXla:
    """XLA's side of one call: the FFI API table and a call frame over host arrays standing in
    for device buffers (the handler never touches their memory, it passes their addresses)."""

    def __init__(self, *, ordinal: int = 3, stream_error: bool = False,
                 table_ends_before_ordinal: bool = False) -> None:
        self.errors: list[str] = []
        self.contexts: list[int] = []
        keep = self._keep = []  # everything the C side points into stays alive

        @ctypes.CFUNCTYPE(c_void, ctypes.POINTER(ErrorCreateArgs))
        def error_create(args):
            self.errors.append(args.contents.message.decode())
            return 0xE0  # an opaque XLA_FFI_Error*: the handler only returns it

        @ctypes.CFUNCTYPE(c_void, ctypes.POINTER(StreamGetArgs))
        def stream_get(args):
            self.contexts.append(args.contents.ctx)
            if stream_error:
                return 0xE5
            args.contents.stream = STREAM
            return None

        @ctypes.CFUNCTYPE(c_void, ctypes.POINTER(OrdinalGetArgs))
        def ordinal_get(args):
            args.contents.device_ordinal = ordinal
            return None

        keep += [error_create, stream_get, ordinal_get]
        self.api = Api()
        self.api.api_version = ApiVersion(ctypes.sizeof(ApiVersion), None, 0, 1)
        self.api.struct_size = (Api.DeviceOrdinal_Get.offset if table_ends_before_ordinal
                                else ctypes.sizeof(Api))
        self.api.Error_Create = ctypes.cast(error_create, c_void).value
        self.api.Stream_Get = ctypes.cast(stream_get, c_void).value
        self.api.DeviceOrdinal_Get = ctypes.cast(ordinal_get, c_void).value

    def _items(self, buffers: list[Buffer]) -> Items:
        types = (c_int * len(buffers))(*([1] * len(buffers)))
        pointers = (c_void * len(buffers))(*[ctypes.addressof(b) for b in buffers])
        self._keep += [buffers, types, pointers]
        return Items(ctypes.sizeof(Items), None, len(buffers), types, pointers)

    def _buffer(self, array: np.ndarray | None, dtype: int) -> Buffer:
        if array is None:  # an ordering token
            return Buffer(ctypes.sizeof(Buffer), None, TOKEN, None, 0, None)
        dims = (c_i64 * array.ndim)(*array.shape)
        self._keep += [array, dims]
        return Buffer(ctypes.sizeof(Buffer), None, dtype, array.ctypes.data, array.ndim, dims)

    def frame(self, key: int, ins: list[np.ndarray | None], outs: list[np.ndarray | None],
              extension: ctypes.Structure | None = None) -> CallFrame:
        name = ByteSpan(b"key", 3)
        value = c_i64(key)
        scalar = Scalar(S64, ctypes.addressof(value))
        names = (ctypes.POINTER(ByteSpan) * 1)(ctypes.pointer(name))
        attrs = (c_void * 1)(ctypes.addressof(scalar))
        types = (c_int * 1)(SCALAR_ATTR)
        self._keep += [name, value, scalar, names, attrs, types]
        frame = CallFrame()
        frame.struct_size = ctypes.sizeof(CallFrame)
        frame.extension_start = None if extension is None else ctypes.addressof(extension)
        frame.api = ctypes.pointer(self.api)
        frame.ctx = CONTEXT
        frame.args = self._items([self._buffer(a, F32) for a in ins])
        frame.rets = self._items([self._buffer(a, F32) for a in outs])
        frame.attrs = Attrs(ctypes.sizeof(Attrs), None, 1, types, names, attrs)
        return frame


def call(handler_capsule: object, frame: CallFrame) -> int | None:
    """Call an FFI handler capsule as XLA does; return the XLA_FFI_Error* (None: success)."""
    get = ctypes.pythonapi.PyCapsule_GetPointer
    get.restype, get.argtypes = c_void, [ctypes.py_object, ctypes.c_char_p]
    handler = ctypes.CFUNCTYPE(c_void, ctypes.POINTER(CallFrame))(get(handler_capsule, None))
    return handler(ctypes.byref(frame))


@pytest.fixture
def dispatched():
    """Install a recording device dispatcher; restore colls_jax's own afterwards."""
    from colls_jax import _ffi

    calls: list[tuple] = []
    _ffi_native.set_device_dispatch(lambda *args: calls.append(args))
    yield calls
    _ffi_native.set_device_dispatch(_ffi._dispatch_device)


def test_device_handler_passes_every_buffer_the_stream_and_the_device(dispatched):
    xla = FakeXla(ordinal=3)
    x, y, out = np.zeros((2, 3), np.float32), np.zeros(5, np.float32), np.zeros(7, np.float32)
    error = call(_ffi_native.device_handler(), xla.frame(41, [x, None, y], [out, None]))
    assert error is None and xla.errors == []
    assert dispatched == [(41, ((x.ctypes.data, 24), (y.ctypes.data, 20)),
                           ((out.ctypes.data, 28),), STREAM, 3)]
    assert xla.contexts == [CONTEXT]  # the stream asked for this call's execution context


def test_device_handler_passes_a_zero_size_buffer_with_zero_bytes(dispatched):
    empty = np.zeros((0, 4), np.float32)
    assert call(_ffi_native.device_handler(), FakeXla().frame(0, [empty], [empty])) is None
    assert dispatched[0][1] == ((empty.ctypes.data, 0),)


def test_device_handler_without_device_ordinal_get_passes_minus_one(dispatched):
    xla = FakeXla(table_ends_before_ordinal=True)
    x = np.zeros(2, np.float32)
    assert call(_ffi_native.device_handler(), xla.frame(5, [x], [x])) is None
    assert dispatched[0][3:] == (STREAM, -1)


def test_device_handler_turns_a_dispatcher_exception_into_an_xla_error():
    from colls_jax import _ffi

    def fails(*args):
        raise ValueError("colls_jax.all_reduce on rank 0: the peer left")

    _ffi_native.set_device_dispatch(fails)
    try:
        xla = FakeXla()
        x = np.zeros(2, np.float32)
        assert call(_ffi_native.device_handler(), xla.frame(1, [x], [x])) == 0xE0
    finally:
        _ffi_native.set_device_dispatch(_ffi._dispatch_device)
    assert xla.errors == ["ValueError: colls_jax.all_reduce on rank 0: the peer left"]


def test_device_handler_returns_the_stream_lookups_error(dispatched):
    x = np.zeros(2, np.float32)
    assert call(_ffi_native.device_handler(), FakeXla(stream_error=True).frame(1, [x], [x])) == 0xE5
    assert dispatched == []


def test_device_handler_answers_the_metadata_query_with_no_traits(dispatched):
    metadata = Metadata(ctypes.sizeof(Metadata), ApiVersion(), 0xFF, 0)
    extension = MetadataExtension(ExtensionBase(ctypes.sizeof(MetadataExtension),
                                                EXTENSION_METADATA, None),
                                  ctypes.addressof(metadata))
    x = np.zeros(2, np.float32)
    frame = FakeXla().frame(1, [x], [x], extension=extension)
    assert call(_ffi_native.device_handler(), frame) is None
    assert (metadata.api_version.major, metadata.api_version.minor, metadata.traits) == (0, 1, 0)
    assert dispatched == []  # a query, not a call


def _offsets_program(declarations: str) -> str:
    fields = ", ".join(f"offsetof(XLA_FFI_Api, XLA_FFI_{name})" for name in
                       ("Error_Create", "Stream_Get", "DeviceOrdinal_Get"))
    return (declarations + "\n#include <stdio.h>\nint main(void) {\n"
            f'  size_t v[] = {{{fields}, sizeof(XLA_FFI_Stream_Get_Args),\n'
            "    offsetof(XLA_FFI_Stream_Get_Args, stream),\n"
            "    offsetof(XLA_FFI_DeviceOrdinal_Get_Args, device_ordinal),\n"
            "    offsetof(XLA_FFI_CallFrame, attrs), sizeof(XLA_FFI_Buffer)};\n"
            '  for (unsigned i = 0; i < sizeof v / sizeof v[0]; i++) printf("%zu ", v[i]);\n'
            "  return 0;\n}\n")


def _run_c(source: str, tmp_path: Path, name: str, include: str | None = None) -> str:
    path = tmp_path / f"{name}.c"
    path.write_text(source)
    command = [shutil.which("cc") or "cc", str(path), "-o", str(tmp_path / name)]
    if include:
        command.insert(1, f"-I{include}")
    subprocess.run(command, check=True, capture_output=True, timeout=120)
    return subprocess.run([str(tmp_path / name)], check=True, capture_output=True, text=True,
                          timeout=30).stdout


@pytest.mark.skipif(shutil.which("cc") is None, reason="needs a C compiler")
def test_declared_ffi_structs_match_jaxlibs_c_api_header(tmp_path):
    text = SOURCE.read_text()
    start = text.index("/* -- the subset of xla/ffi/api/c_api.h")
    end = text.index("/* -- the handler")
    ours = "#include <stddef.h>\n#include <stdint.h>\n" + text[start:end]
    real = '#include <stddef.h>\n#include "xla/ffi/api/c_api.h"\n'
    expected = _run_c(_offsets_program(real), tmp_path, "real", jax.ffi.include_dir())
    assert _run_c(_offsets_program(ours), tmp_path, "ours") == expected


@pytest.fixture
def sites():
    """Give the host handler a list of call sites of its own; restore colls_jax's afterwards."""
    from colls_jax import _ffi

    mine: list = []
    _ffi_native.set_sites(mine)
    yield mine
    _ffi_native.set_sites(_ffi._host_sites)


def test_host_handler_calls_the_site_with_a_writable_view_of_each_buffer(sites):
    seen = []

    def runner(*views):  # the views are XLA's memory: read and write them during the call only
        seen.append([(v.readonly, v.nbytes, np.frombuffer(v, np.float32).tolist()) for v in views])
        np.frombuffer(views[-1], np.float32)[:] = 7.0

    sites += [None, runner]
    x, y = np.arange(6, dtype=np.float32).reshape(2, 3), np.array([9.0], np.float32)
    out = np.zeros(4, np.float32)
    xla = FakeXla()
    assert call(_ffi_native.handler(), xla.frame(1, [x, None, y], [None, out])) is None
    assert xla.errors == []
    assert seen == [[(False, 24, x.ravel().tolist()), (False, 4, [9.0]),
                     (False, 16, [0.0] * 4)]]
    assert out.tolist() == [7.0] * 4  # written in place, no copy


def test_host_handler_names_a_call_site_that_was_never_registered(sites):
    sites.append(lambda *views: None)
    xla = FakeXla()
    x = np.zeros(2, np.float32)
    assert call(_ffi_native.handler(), xla.frame(5, [x], [x])) == 0xE0
    assert xla.errors == ["RuntimeError: colls_jax FFI: no call site 5 was registered"]


def test_host_handler_turns_a_runners_exception_into_an_xla_error(sites):
    def fails(*views):
        raise ValueError("colls_jax.all_reduce on rank 0: the peer left")

    sites.append(fails)
    xla = FakeXla()
    x = np.zeros(2, np.float32)
    assert call(_ffi_native.handler(), xla.frame(0, [x], [x])) == 0xE0
    assert xla.errors == ["ValueError: colls_jax.all_reduce on rank 0: the peer left"]
