/* colls_jax._ffi_native: the XLA FFI handler of colls_jax's jit path (optional extension).
 *
 * Inside jax.jit every colls_jax collective is an XLA custom call to the target
 * "colls_jax_call" (colls_jax/_ffi.py). XLA calls `handler` below with a call frame that holds
 * pointers to its own input and output buffers and one attribute, `key`: the index of the call
 * site in colls_jax._ffi's table (the collective and its static arguments, bound at trace time).
 * The handler wraps each buffer in a writable memoryview (no copy), takes the GIL and calls the
 * call site's runner, item `key` of the Python list set by `set_sites`, with those memoryviews as
 * its positional arguments (inputs, then outputs); the runner views them as NumPy arrays and runs
 * the group's backend call on them. No tuple and no dispatcher frame stand between XLA and the
 * runner: at 8 bytes the collective itself costs a few microseconds, and each Python call and
 * allocation on the way is a visible share of it. A Python exception becomes an XLA FFI error
 * carrying its message, which JAX raises to the caller.
 *
 * `device_handler` is the same custom call on XLA's CUDA platform. There the buffers are device
 * memory, which no memoryview may wrap: the handler asks XLA for the stream the call runs on and
 * the device's ordinal, and calls the dispatcher set by `set_device_dispatch` as
 * dispatch(key, inputs, outputs, stream, device), with each buffer as a (pointer, bytes) pair.
 * It never calls CUDA itself (so it builds without CUDA): the dispatcher views the buffers as
 * CuPy arrays and runs the collective ordered on that stream.
 *
 * Ordering tokens (operands and results of dtype TOKEN) are skipped: they only order the calls.
 *
 * The structs below are the subset of XLA's FFI C API (xla/ffi/api/c_api.h, API 0.x, shipped in
 * jaxlib under jax.ffi.include_dir()) that this handler reads, declared here so that the
 * extension builds without jaxlib installed at build time. The C API is versioned and keeps its
 * layout stable; the handler reports API version 0.1 in its metadata.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#define INTERFACE 3

/* -- the subset of xla/ffi/api/c_api.h ---------------------------------------------------- */

typedef struct XLA_FFI_Extension_Base {
    size_t struct_size;
    int type; /* XLA_FFI_Extension_Type */
    struct XLA_FFI_Extension_Base *next;
} XLA_FFI_Extension_Base;

enum { XLA_FFI_Extension_Metadata = 1 };

typedef struct {
    size_t struct_size;
    XLA_FFI_Extension_Base *extension_start;
    int major_version;
    int minor_version;
} XLA_FFI_Api_Version;

typedef struct {
    int64_t type_id;
} XLA_FFI_TypeId;

typedef struct {
    size_t struct_size;
    XLA_FFI_Api_Version api_version;
    uint32_t traits;
    XLA_FFI_TypeId state_type_id;
} XLA_FFI_Metadata;

typedef struct {
    XLA_FFI_Extension_Base extension_base;
    XLA_FFI_Metadata *metadata;
} XLA_FFI_Metadata_Extension;

typedef struct XLA_FFI_Error XLA_FFI_Error;

typedef struct {
    size_t struct_size;
    XLA_FFI_Extension_Base *extension_start;
    const char *message;
    int errc; /* XLA_FFI_Error_Code */
} XLA_FFI_Error_Create_Args;

enum { XLA_FFI_Error_Code_INTERNAL = 13 };

typedef XLA_FFI_Error *XLA_FFI_Error_Create(XLA_FFI_Error_Create_Args *args);

typedef struct {
    size_t struct_size;
    XLA_FFI_Extension_Base *extension_start;
    void *ctx;
    void *stream; /* out: a cudaStream_t on the CUDA platform */
} XLA_FFI_Stream_Get_Args;

typedef XLA_FFI_Error *XLA_FFI_Stream_Get(XLA_FFI_Stream_Get_Args *args);

typedef struct {
    size_t struct_size;
    XLA_FFI_Extension_Base *extension_start;
    void *ctx;
    int32_t device_ordinal; /* out */
} XLA_FFI_DeviceOrdinal_Get_Args;

typedef XLA_FFI_Error *XLA_FFI_DeviceOrdinal_Get(XLA_FFI_DeviceOrdinal_Get_Args *args);

/* The function table, in c_api.h's order; the functions this file does not call are opaque. A
 * table is as long as its struct_size says: functions added in later API versions are read
 * only when it covers them. */
typedef struct {
    size_t struct_size;
    XLA_FFI_Extension_Base *extension_start;
    XLA_FFI_Api_Version api_version;
    const void *internal_api;
    XLA_FFI_Error_Create *XLA_FFI_Error_Create;
    void *XLA_FFI_Error_GetMessage;
    void *XLA_FFI_Error_Destroy;
    void *XLA_FFI_Handler_Register;
    XLA_FFI_Stream_Get *XLA_FFI_Stream_Get;
    void *XLA_FFI_Type_Register;
    void *XLA_FFI_ExecutionContext_Get;
    void *XLA_FFI_State_Set;
    void *XLA_FFI_State_Get;
    void *XLA_FFI_DeviceMemory_Allocate;
    void *XLA_FFI_DeviceMemory_Free;
    void *XLA_FFI_ThreadPool_Schedule;
    void *XLA_FFI_ThreadPool_NumThreads;
    void *XLA_FFI_Future_Create;
    void *XLA_FFI_Future_SetAvailable;
    void *XLA_FFI_Future_SetError;
    void *XLA_FFI_RunId_Get;
    XLA_FFI_DeviceOrdinal_Get *XLA_FFI_DeviceOrdinal_Get;
} XLA_FFI_Api;

#define API_HAS(api, field) \
    ((api)->struct_size >= offsetof(XLA_FFI_Api, field) + sizeof((api)->field))

typedef struct {
    size_t struct_size;
    XLA_FFI_Extension_Base *extension_start;
    int dtype; /* XLA_FFI_DataType */
    void *data;
    int64_t rank;
    int64_t *dims;
} XLA_FFI_Buffer;

enum { XLA_FFI_DataType_TOKEN = 17, XLA_FFI_DataType_S64 = 5 };

typedef struct {
    size_t struct_size;
    XLA_FFI_Extension_Base *extension_start;
    int64_t size;
    int *types;
    void **items;
} XLA_FFI_Items; /* XLA_FFI_Args and XLA_FFI_Rets share this layout */

typedef struct {
    const char *ptr;
    size_t len;
} XLA_FFI_ByteSpan;

typedef struct {
    int dtype;
    void *value;
} XLA_FFI_Scalar;

typedef struct {
    size_t struct_size;
    XLA_FFI_Extension_Base *extension_start;
    int64_t size;
    int *types;
    XLA_FFI_ByteSpan **names;
    void **attrs;
} XLA_FFI_Attrs;

enum { XLA_FFI_AttrType_SCALAR = 3 };

typedef struct {
    size_t struct_size;
    XLA_FFI_Extension_Base *extension_start;
    const XLA_FFI_Api *api;
    void *ctx;
    int stage;
    XLA_FFI_Items args;
    XLA_FFI_Items rets;
    XLA_FFI_Attrs attrs;
    void *future;
} XLA_FFI_CallFrame;

/* -- the handler ------------------------------------------------------------------------- */

static PyObject *sites = NULL;           /* set by set_sites (a list); a strong reference */
static PyObject *device_dispatch = NULL; /* set by set_device_dispatch; a strong reference */
static char empty_buffer[1];      /* what a zero-byte buffer (data may be NULL) is viewed as */

static size_t dtype_bytes(int dtype) {
    switch (dtype) {
    case 1: case 2: case 6: case 19: case 20: case 23: case 24: case 25: case 28: case 29: case 33:
        return 1; /* PRED, S8, U8, F8 types */
    case 3: case 7: case 10: case 16:
        return 2; /* S16, U16, F16, BF16 */
    case 4: case 8: case 11:
        return 4; /* S32, U32, F32 */
    case 5: case 9: case 12: case 15:
        return 8; /* S64, U64, F64, C64 */
    case 18:
        return 16; /* C128 */
    default:
        return 0;
    }
}

static XLA_FFI_Error *make_error(const XLA_FFI_CallFrame *frame, const char *message) {
    XLA_FFI_Error_Create_Args args;
    memset(&args, 0, sizeof args);
    args.struct_size = sizeof args;
    args.message = message;
    args.errc = XLA_FFI_Error_Code_INTERNAL;
    return frame->api->XLA_FFI_Error_Create(&args);
}

/* Return a new reference to XLA buffer `buf` as Python sees it, or NULL (Python error): a
 * writable memoryview of host memory, or a (pointer, bytes) pair of device memory when `device`
 * is set. */
static PyObject *view_of(const XLA_FFI_Buffer *buf, int device) {
    size_t width = dtype_bytes(buf->dtype);
    if (width == 0) {
        PyErr_Format(PyExc_TypeError, "colls_jax FFI: XLA dtype %d is not supported", buf->dtype);
        return NULL;
    }
    Py_ssize_t nbytes = (Py_ssize_t)width;
    for (int64_t d = 0; d < buf->rank; d++) nbytes *= (Py_ssize_t)buf->dims[d];
    if (device) return Py_BuildValue("(Kn)", (unsigned long long)(uintptr_t)buf->data, nbytes);
    char *data = (nbytes == 0 || buf->data == NULL) ? empty_buffer : (char *)buf->data;
    return PyMemoryView_FromMemory(data, nbytes, PyBUF_WRITE);
}

/* Return a tuple of the non-token device buffers as (pointer, bytes) pairs, or NULL (Python
 * error). */
static PyObject *device_buffers(const XLA_FFI_Items *items) {
    Py_ssize_t count = 0;
    for (int64_t i = 0; i < items->size; i++) {
        if (((XLA_FFI_Buffer *)items->items[i])->dtype != XLA_FFI_DataType_TOKEN) count++;
    }
    PyObject *tuple = PyTuple_New(count);
    if (tuple == NULL) return NULL;
    Py_ssize_t at = 0;
    for (int64_t i = 0; i < items->size; i++) {
        XLA_FFI_Buffer *buf = (XLA_FFI_Buffer *)items->items[i];
        if (buf->dtype == XLA_FFI_DataType_TOKEN) continue;
        PyObject *view = view_of(buf, 1);
        if (view == NULL) {
            Py_DECREF(tuple);
            return NULL;
        }
        PyTuple_SET_ITEM(tuple, at++, view);
    }
    return tuple;
}

/* The most buffers (inputs and outputs, tokens not counted) a host call passes its runner: a
 * colls_jax collective has at most one of each. */
#define MAX_VIEWS 8

/* Append memoryviews of the non-token host buffers of `items` to views[*count...]; return 0, or
 * -1 (Python error; the views appended so far stay for the caller to release). */
static int append_views(const XLA_FFI_Items *items, PyObject **views, Py_ssize_t *count) {
    for (int64_t i = 0; i < items->size; i++) {
        XLA_FFI_Buffer *buf = (XLA_FFI_Buffer *)items->items[i];
        if (buf->dtype == XLA_FFI_DataType_TOKEN) continue;
        if (*count == MAX_VIEWS) {
            PyErr_Format(PyExc_ValueError, "colls_jax FFI: a call passes more than %d buffers",
                         MAX_VIEWS);
            return -1;
        }
        PyObject *view = view_of(buf, 0);
        if (view == NULL) return -1;
        views[(*count)++] = view;
    }
    return 0;
}

static int64_t key_of(const XLA_FFI_CallFrame *frame) {
    for (int64_t i = 0; i < frame->attrs.size; i++) {
        const XLA_FFI_ByteSpan *name = frame->attrs.names[i];
        if (frame->attrs.types[i] != XLA_FFI_AttrType_SCALAR || name->len != 3 ||
            memcmp(name->ptr, "key", 3) != 0) continue;
        const XLA_FFI_Scalar *scalar = (const XLA_FFI_Scalar *)frame->attrs.attrs[i];
        if (scalar->dtype == XLA_FFI_DataType_S64) return *(const int64_t *)scalar->value;
    }
    return -1;
}

/* The XLA error for the Python exception being raised, "TypeName: message" (JAX shows it in
 * the XlaRuntimeError it raises); clears the exception. */
static XLA_FFI_Error *error_from_python(const XLA_FFI_CallFrame *frame) {
    PyObject *type, *value, *trace;
    PyErr_Fetch(&type, &value, &trace);
    PyErr_NormalizeException(&type, &value, &trace);
    PyObject *text = value ? PyObject_Str(value) : NULL;
    const char *name = type ? ((PyTypeObject *)type)->tp_name : "Error";
    PyObject *message = PyUnicode_FromFormat("%s: %U", name,
                                             text ? text : PyUnicode_FromString("?"));
    const char *utf8 = message ? PyUnicode_AsUTF8(message) : NULL;
    XLA_FFI_Error *error = make_error(frame, utf8 ? utf8 : "colls_jax FFI: the collective failed");
    Py_XDECREF(message);
    Py_XDECREF(text);
    Py_XDECREF(type);
    Py_XDECREF(value);
    Py_XDECREF(trace);
    PyErr_Clear();
    return error;
}

/* Take the GIL on one of XLA's threads, keeping the thread's Python thread state for good.
 *
 * PyGILState_Ensure on a thread that has no thread state makes one, and the matching Release
 * deletes it: every call then ran on a brand-new thread state, so every threading.local the
 * collective touches (colls keeps per-thread caches) started empty, and making and deleting the
 * state cost more than the 1-rank collective itself (jitted 4 KiB all_reduce at 1 rank: 58-61
 * us a call, 34-37 with the state kept). The first call on a thread takes one Ensure that is
 * never released, so the state lives as long as the thread (XLA's pool threads live as long as
 * the process). */
static PyGILState_STATE take_gil(void) {
    if (PyGILState_GetThisThreadState() == NULL) {
        (void)PyGILState_Ensure(); /* makes this thread's state, kept: never released */
        PyEval_SaveThread();       /* drops the GIL, so the Ensure below takes it (UNLOCKED) */
    }
    return PyGILState_Ensure();
}

/* Call the host runner `key` (set_sites) on memoryviews of the frame's buffers; return its
 * error or NULL. */
static XLA_FFI_Error *call_site(const XLA_FFI_CallFrame *frame, int64_t key) {
    PyGILState_STATE gil = take_gil();
    PyObject *views[MAX_VIEWS];
    Py_ssize_t count = 0;
    PyObject *result = NULL;
    if (append_views(&frame->args, views, &count) == 0 &&
        append_views(&frame->rets, views, &count) == 0) {
        if (sites == NULL || key >= PyList_GET_SIZE(sites)) {
            PyErr_Format(PyExc_RuntimeError, "colls_jax FFI: no call site %lld was registered",
                         (long long)key);
        } else {
            PyObject *site = PyList_GET_ITEM(sites, key);
            Py_INCREF(site); /* held through the call, whatever set_sites does meanwhile */
            result = PyObject_Vectorcall(site, views, (size_t)count, NULL);
            Py_DECREF(site);
        }
    }
    XLA_FFI_Error *error = result == NULL ? error_from_python(frame) : NULL;
    Py_XDECREF(result);
    for (Py_ssize_t i = 0; i < count; i++) Py_DECREF(views[i]);
    PyGILState_Release(gil);
    return error;
}

/* Call the device dispatcher on the frame's buffers as (pointer, bytes) pairs, with `stream`
 * and `ordinal`; return its error or NULL. */
static XLA_FFI_Error *call_device_dispatcher(const XLA_FFI_CallFrame *frame, int64_t key,
                                             void *stream, int32_t ordinal) {
    PyGILState_STATE gil = take_gil();
    PyObject *ins = device_buffers(&frame->args);
    PyObject *outs = ins == NULL ? NULL : device_buffers(&frame->rets);
    PyObject *result = NULL;
    if (outs != NULL) {
        if (device_dispatch == NULL) {
            PyErr_SetString(PyExc_RuntimeError, "colls_jax FFI: no dispatcher was set");
        } else {
            result = PyObject_CallFunction(device_dispatch, "LOOKi", (long long)key, ins, outs,
                                           (unsigned long long)(uintptr_t)stream, (int)ordinal);
        }
    }
    XLA_FFI_Error *error = result == NULL ? error_from_python(frame) : NULL;
    Py_XDECREF(result);
    Py_XDECREF(ins);
    Py_XDECREF(outs);
    PyGILState_Release(gil);
    return error;
}

static XLA_FFI_Error *run(const XLA_FFI_CallFrame *frame) {
    int64_t key = key_of(frame);
    if (key < 0) return make_error(frame, "colls_jax FFI: the call has no int64 attribute 'key'");
    return call_site(frame, key);
}

/* The device handler's run: XLA's stream and device ordinal, then the device dispatcher. */
static XLA_FFI_Error *run_device(const XLA_FFI_CallFrame *frame) {
    int64_t key = key_of(frame);
    if (key < 0) return make_error(frame, "colls_jax FFI: the call has no int64 attribute 'key'");
    const XLA_FFI_Api *api = frame->api;
    if (!API_HAS(api, XLA_FFI_Stream_Get) || api->XLA_FFI_Stream_Get == NULL)
        return make_error(frame, "colls_jax FFI: XLA's FFI API has no XLA_FFI_Stream_Get");
    XLA_FFI_Stream_Get_Args stream_args;
    memset(&stream_args, 0, sizeof stream_args);
    stream_args.struct_size = sizeof stream_args;
    stream_args.ctx = frame->ctx;
    XLA_FFI_Error *error = api->XLA_FFI_Stream_Get(&stream_args);
    if (error != NULL) return error;
    int32_t ordinal = -1; /* an API older than DeviceOrdinal_Get: the dispatcher asks CUDA */
    if (API_HAS(api, XLA_FFI_DeviceOrdinal_Get) && api->XLA_FFI_DeviceOrdinal_Get != NULL) {
        XLA_FFI_DeviceOrdinal_Get_Args device_args;
        memset(&device_args, 0, sizeof device_args);
        device_args.struct_size = sizeof device_args;
        device_args.ctx = frame->ctx;
        error = api->XLA_FFI_DeviceOrdinal_Get(&device_args);
        if (error != NULL) return error;
        ordinal = device_args.device_ordinal;
    }
    return call_device_dispatcher(frame, key, stream_args.stream, ordinal);
}

/* XLA asks for the handler's API version and traits when it registers the target: no traits
 * (in particular not command-buffer compatible: the call runs host code). Returns 1 if it
 * answered such a query. */
static int answer_metadata(XLA_FFI_CallFrame *frame) {
    XLA_FFI_Extension_Base *ext = frame->extension_start;
    if (ext == NULL || ext->type != XLA_FFI_Extension_Metadata) return 0;
    XLA_FFI_Metadata *metadata = ((XLA_FFI_Metadata_Extension *)ext)->metadata;
    metadata->api_version.major_version = 0;
    metadata->api_version.minor_version = 1;
    metadata->traits = 0;
    return 1;
}

static XLA_FFI_Error *handler(XLA_FFI_CallFrame *frame) {
    return answer_metadata(frame) ? NULL : run(frame);
}

static XLA_FFI_Error *device_handler(XLA_FFI_CallFrame *frame) {
    return answer_metadata(frame) ? NULL : run_device(frame);
}

/* -- the module -------------------------------------------------------------------------- */

static PyObject *py_handler(PyObject *self, PyObject *unused) {
    return PyCapsule_New((void *)handler, NULL, NULL);
}

static PyObject *py_device_handler(PyObject *self, PyObject *unused) {
    return PyCapsule_New((void *)device_handler, NULL, NULL);
}

static PyObject *set_callable(PyObject **slot, PyObject *fn, const char *name) {
    if (!PyCallable_Check(fn)) {
        PyErr_Format(PyExc_TypeError, "%s expects a callable", name);
        return NULL;
    }
    Py_INCREF(fn);
    Py_XSETREF(*slot, fn);
    Py_RETURN_NONE;
}

static PyObject *py_set_sites(PyObject *self, PyObject *list) {
    if (!PyList_CheckExact(list)) {
        PyErr_SetString(PyExc_TypeError, "set_sites expects a list");
        return NULL;
    }
    Py_INCREF(list);
    Py_XSETREF(sites, list);
    Py_RETURN_NONE;
}

static PyObject *py_set_device_dispatch(PyObject *self, PyObject *fn) {
    return set_callable(&device_dispatch, fn, "set_device_dispatch");
}

static PyMethodDef methods[] = {
    {"handler", py_handler, METH_NOARGS, "The XLA FFI handler (host buffers), as a PyCapsule."},
    {"device_handler", py_device_handler, METH_NOARGS,
     "The XLA FFI handler of the CUDA platform (device buffers), as a PyCapsule."},
    {"set_sites", py_set_sites, METH_O,
     "Set the list of host call sites: the handler calls item `key` with a writable memoryview "
     "of each input and output buffer, in that order."},
    {"set_device_dispatch", py_set_device_dispatch, METH_O,
     "Set dispatch(key, inputs, outputs, stream, device), called with tuples of "
     "(pointer, bytes) pairs, XLA's stream as an int and the device ordinal (-1: unknown)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_ffi_native", "colls_jax's XLA FFI handler.", -1, methods,
};

PyMODINIT_FUNC PyInit__ffi_native(void) {
    PyObject *m = PyModule_Create(&module);
    if (m != NULL && PyModule_AddIntConstant(m, "INTERFACE", INTERFACE) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
