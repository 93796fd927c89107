"""colls_jax in one process (a world of one): errors, ordering in the compiled program, copies.

The multi-process behaviour is in test_jax_multiprocess.py; what needs no peer is checked here,
where it is fast: every user-facing error and its message, the token chain that orders the
callbacks of a jitted function, that unused collectives still run, and that inputs reach colls
without a copy.
"""

from __future__ import annotations

import re
import threading

import colls_jax as cj
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from colls_jax import _host
from jax.experimental import io_callback

import colls
from colls.store import HashStore

pytestmark = [pytest.mark.timeout(120), pytest.mark.usefixtures("world_of_one", "jit_path")]

X = np.arange(6, dtype=np.float32).reshape(2, 3)
#: (result, token operand) of each staged collective in a lowered program: the host callback
#: takes the token first and returns it first, the FFI call takes and returns it last.
_STAGED = {
    "callback": (re.compile(r"(%\d+):2 = stablehlo\.custom_call @\w*callback\((%[\w#]+), "), 0),
    "ffi": (re.compile(r"(%\d+):2 = stablehlo\.custom_call @colls_jax_call\([^)]*?(%[\w#]+)\)"),
            1),
}


# -- what colls_jax does not have -------------------------------------------------------------


@pytest.mark.parametrize(("name", "hint"), [
    ("all_gather_into_tensor", r"colls_jax\.all_gather\(x, tiled=True\)"),
    ("reduce_scatter_tensor", r"colls_jax\.reduce_scatter\(x, tiled=True\)"),
    ("isend", r"colls_jax\.send .* ppermute/shift"),
    ("batch_isend_irecv", r"colls_jax\.ppermute\(x, perm\)"),
    ("all_reduce_", r"colls_jax\.all_reduce, which returns the result"),
])
def test_in_place_and_async_names_explain_the_alternative(name: str, hint: str) -> None:
    with pytest.raises(AttributeError, match=r"JAX arrays are immutable.*" + hint):
        getattr(cj, name)


def test_core_names_point_to_colls() -> None:
    with pytest.raises(AttributeError, match=r"use colls\.init_process_group"):
        cj.init_process_group  # noqa: B018
    with pytest.raises(AttributeError, match=r"has no attribute 'no_such_thing'"):
        cj.no_such_thing  # noqa: B018


def test_core_in_place_call_on_a_jax_array_names_the_functional_api() -> None:
    with pytest.raises(TypeError, match=r"read-only .*Use colls\.functional\.all_reduce"):
        colls.all_reduce(jnp.asarray(X))


# -- mapped traces ------------------------------------------------------------------------------

MAPPED = r"inside jax\.pmap, jax\.shard_map or a jax\.vmap with axis_name \(named axes: {}\)"


def test_pmap_is_refused() -> None:
    with pytest.raises(NotImplementedError, match=MAPPED.format("devices") + r".*jax\.lax"):
        jax.pmap(cj.all_reduce, axis_name="devices")(jnp.asarray(X[:1]))


def test_shard_map_is_refused() -> None:
    mesh = jax.make_mesh((1,), ("d",))
    mapped = jax.shard_map(cj.all_gather, mesh=mesh, in_specs=jax.P(), out_specs=jax.P())
    with pytest.raises(NotImplementedError, match=MAPPED.format("d")):
        mapped(jnp.asarray(X))


def test_vmap_with_axis_name_is_refused() -> None:
    with pytest.raises(NotImplementedError, match=MAPPED.format("i")):
        jax.vmap(cj.all_reduce, axis_name="i")(jnp.asarray(X))


def test_plain_vmap_is_supported() -> None:
    np.testing.assert_array_equal(jax.vmap(cj.all_gather)(jnp.asarray(X)), X[:, None, :])


# -- differentiation ------------------------------------------------------------------------------


@pytest.mark.parametrize(("fn", "message"), [
    (lambda x: cj.all_reduce(x, cj.ReduceOp.MAX),
     r"all_reduce with ReduceOp\.MAX is not differentiable; only SUM, AVG and PREMUL_SUM"),
    (lambda x: cj.reduce_scatter(x, cj.ReduceOp.PRODUCT, tiled=True),
     r"reduce_scatter with ReduceOp\.PRODUCT is not differentiable; only SUM and AVG"),
    (lambda x: cj.reduce(x, 0, cj.ReduceOp.MIN),
     r"reduce with ReduceOp\.MIN is not differentiable; only SUM"),
])
def test_nonlinear_reductions_refuse_gradients(fn, message: str) -> None:
    with pytest.raises(NotImplementedError, match=message):
        jax.grad(lambda x: jnp.sum(fn(x)))(jnp.asarray(X))
    np.testing.assert_array_equal(fn(jnp.asarray(X)), X)  # forward still works (world of one)


def test_forward_mode_is_refused_by_jax() -> None:
    with pytest.raises(TypeError, match=r"forward-mode autodiff \(jvp\) to a custom_vjp"):
        jax.jvp(cj.all_reduce, (jnp.asarray(X),), (jnp.asarray(X),))


def test_gradient_does_not_flow_into_a_send_or_stop_nonfloat() -> None:
    got = jax.grad(lambda x: jnp.sum(cj.all_reduce(x) * 2.0))(jnp.asarray(X))
    np.testing.assert_array_equal(got, np.full_like(X, 2.0))
    ints = jnp.arange(4, dtype=jnp.int32)
    np.testing.assert_array_equal(jax.jit(cj.all_reduce)(ints), np.arange(4))


# -- argument errors, raised at trace time (not inside a callback) -------------------------------


@pytest.mark.parametrize(("call", "error", "message"), [
    (lambda x: cj.reduce_scatter(x), ValueError,
     r"colls_jax\.reduce_scatter on rank 0: x has shape \(2, 3\); axis 0 must equal the group "
     r"size 1 \(tiled=False .*pass tiled=True"),
    (lambda x: cj.all_to_all(x[0, 0]), ValueError,
     r"colls_jax\.all_to_all on rank 0: x must have at least one axis"),
    (lambda x: cj.all_gather(x[0, 0], tiled=True), ValueError,
     r"all_gather on rank 0: x must have at least one axis \(tiled=True concatenates"),
    (lambda x: cj.scatter(x), ValueError, r"scatter on rank 0: x has shape \(2, 3\); axis 0 "
     r"must equal the group size 1"),
    (lambda x: cj.all_reduce(x, cj.ReduceOp.BAND), TypeError,
     r"colls_jax\.all_reduce on rank 0: ReduceOp\.BAND is not defined for float32"),
    (lambda x: cj.all_reduce(x.astype(jnp.int32), cj.ReduceOp.AVG), TypeError,
     r"ReduceOp\.AVG is not defined for int32"),
    (lambda x: cj.all_reduce(x, "median"), TypeError, r"unknown reduce op 'median'"),
    (lambda x: cj.all_reduce(x.astype(jnp.float8_e4m3fn)), TypeError,
     r"x has dtype float8_e4m3fn, which colls cannot move"),
    (lambda x: cj.broadcast(x, 3), ValueError,
     r"colls_jax\.broadcast on rank 0: src=3 is not a member of group"),
    (lambda x: cj.broadcast(x), ValueError, r"either src \(a world rank\) or group_src"),
    (lambda x: cj.ppermute(x, [(0, 1)]), ValueError,
     r"perm holds rank 1, out of range for a group of size 1"),
    (lambda x: cj.ppermute(x, [(0, 0), (0, 0)]), ValueError,
     r"perm names a source rank more than once"),
    (lambda x: cj.ppermute(x, [0]), TypeError, r"perm must be a sequence of \(source, "),
    (lambda x: cj.shift(x, 1.5), TypeError, r"shift on rank 0: offset must be an int"),
    (lambda x: cj.send(x, 0), ValueError,
     r"colls_jax\.send on rank 0: dst is this rank's own rank \(0\)"),
    (lambda x: cj.send(x, group_dst=0, tag=-1), ValueError, r"tag must be in \[0, 2\*\*63\)"),
])
def test_argument_errors_name_the_op_rank_and_value(call, error, message: str) -> None:
    with pytest.raises(error, match=message):
        call(jnp.asarray(X))
    with pytest.raises(error, match=message):  # the same error while tracing, before any run
        jax.jit(call)(jnp.asarray(X))


def test_recv_checks_its_arguments() -> None:
    with pytest.raises(ValueError, match=r"recv on rank 0: src is this rank's own rank"):
        cj.recv((2,), jnp.float32, 0)
    with pytest.raises(ValueError, match=r"shape \(2, -1\) has a negative dimension"):
        cj.recv((2, -1), jnp.float32, group_src=0)


# -- ordering, effects and copies -----------------------------------------------------------------


def test_jitted_collectives_are_chained_by_one_token(jit_path: str) -> None:
    def independent(a, b, c):
        return cj.all_reduce(a), cj.broadcast(b, 0), cj.all_gather(c)

    text = jax.jit(independent).lower(
        jnp.ones(3), jnp.ones(2, jnp.int32), jnp.ones(4, jnp.bfloat16)).as_text()
    pattern, token_result = _STAGED[jit_path]
    chain = pattern.findall(text)
    assert len(chain) == 3, text
    assert chain[0][1].startswith("%arg")  # the token the program receives
    for (previous, _), (_, token) in zip(chain, chain[1:], strict=False):
        assert token == f"{previous}#{token_result}", text  # waits for the one traced before


def test_unordered_callbacks_would_not_be_chained() -> None:
    """What colls_jax avoids: without ordered=True no token orders the callbacks."""
    def unordered(a, b):
        spec = jax.ShapeDtypeStruct((3,), jnp.float32)
        return (io_callback(np.asarray, spec, a, ordered=False),
                io_callback(np.asarray, spec, b, ordered=False))

    text = jax.jit(unordered).lower(jnp.ones(3), jnp.ones(3)).as_text()
    assert "stablehlo.token" not in text and "custom_call" in text


def test_a_collective_whose_result_is_unused_still_runs(monkeypatch) -> None:
    calls = []

    def counting(x, out, **kwargs):
        calls.append(np.asarray(x).copy())
        return _host_all_reduce(x, out, **kwargs)

    _host_all_reduce = _host.all_reduce
    monkeypatch.setattr(_host, "all_reduce", counting)

    @jax.jit
    def ignore_result(x):
        cj.all_reduce(x * 2)
        return x + 1

    np.testing.assert_array_equal(ignore_result(jnp.asarray(X)), X + 1)
    jax.effects_barrier()
    assert len(calls) == 1
    np.testing.assert_array_equal(calls[0], X * 2)


def test_eager_inputs_reach_colls_without_a_copy(monkeypatch) -> None:
    seen = []
    real = colls.all_gather_into_tensor

    def spy(out, src, **kwargs):
        seen.append(np.asarray(src).ctypes.data)
        return real(out, src, **kwargs)

    monkeypatch.setattr(colls, "all_gather_into_tensor", spy)
    x = jnp.asarray(X)
    assert isinstance(cj.all_gather(x), jax.Array)
    assert seen == [x.unsafe_buffer_pointer()]


def test_eager_and_jitted_results_are_new_jax_arrays_of_the_input_dtype() -> None:
    for dtype in (jnp.float32, jnp.bfloat16, jnp.int32, jnp.bool_):
        x = jnp.asarray(X).astype(dtype)
        for fn in (cj.all_reduce, jax.jit(cj.all_reduce)):
            out = fn(x)
            assert isinstance(out, jax.Array) and out.dtype == dtype and out is not x
            np.testing.assert_array_equal(np.asarray(out), np.asarray(x))
    assert cj.barrier() is None and jax.jit(lambda: cj.barrier())() is None


@pytest.mark.parametrize("dtype", [np.float32, np.float16, np.int8, np.uint32, np.bool_,
                                   np.complex64, jnp.bfloat16, np.float64, np.int64])
def test_eager_results_are_what_jnp_asarray_gives(dtype, monkeypatch) -> None:
    """The eager result's hand-off (JAX's transfer called directly where it can be) gives what
    ``jnp.asarray`` gives: values, canonical dtype, device, and an uncommitted array. The direct
    transfer is what ran for every dtype JAX keeps as it is (not a silent ``jnp.asarray``), and
    the others (64-bit ones without jax_enable_x64) go through ``jnp.asarray``."""
    from colls_jax import _jit

    host = (np.arange(6) % 2).astype(dtype).reshape(2, 3)
    want = jnp.asarray(host)
    _jit._to_jax(host.copy())  # looks the transfer up
    assert _jit._HOST_TRANSFER is not None, "JAX's CPU transfer did not load: jnp.asarray ran"
    direct = []
    transfer = _jit._HOST_TRANSFER
    monkeypatch.setattr(_jit, "_HOST_TRANSFER", lambda out: direct.append(1) or transfer(out))
    got = _jit._to_jax(host.copy())
    assert direct == ([1] if np.dtype(dtype) in (np.float32, np.float16, np.int8, np.uint32,
                                                 np.bool_, np.complex64, jnp.bfloat16) else [])
    assert type(got) is type(want)
    assert (got.dtype, got.shape, got.weak_type) == (want.dtype, want.shape, want.weak_type)
    assert got.sharding == want.sharding and got.committed == want.committed
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_collectives_inside_scan_cond_and_fori_loop() -> None:
    xs = jnp.arange(12.0, dtype=jnp.float32).reshape(4, 3)

    @jax.jit
    def control_flow(xs, flag):
        total, gathered = jax.lax.scan(
            lambda c, x: (c + cj.all_reduce(x), cj.all_gather(x)), jnp.zeros(3), xs)
        chosen = jax.lax.cond(flag, lambda: cj.broadcast(xs[0], 0), lambda: xs[0] * 0)
        looped = jax.lax.fori_loop(0, 3, lambda i, c: cj.all_reduce(c) + 1, xs[1])
        return total, gathered, chosen, looped

    total, gathered, chosen, looped = control_flow(xs, True)
    np.testing.assert_array_equal(total, np.asarray(xs).sum(0))
    np.testing.assert_array_equal(gathered, np.asarray(xs)[:, None, :])
    np.testing.assert_array_equal(chosen, np.asarray(xs[0]))
    np.testing.assert_array_equal(looped, np.asarray(xs[1]) + 3)


def test_a_failure_inside_a_jitted_collective_surfaces_with_the_colls_message(monkeypatch
                                                                               ) -> None:
    def broken(x, out, **kwargs):
        raise colls.CollsTimeoutError("simulated: rank 1 did not answer")

    monkeypatch.setattr(_host, "all_reduce", broken)
    with pytest.raises(colls.CollsTimeoutError, match="simulated"):
        cj.all_reduce(jnp.asarray(X))  # eager: the colls error itself
    with pytest.raises(jax.errors.JaxRuntimeError, match=r"(?s)CollsTimeoutError: simulated"):
        jax.block_until_ready(jax.jit(lambda x: cj.all_reduce(x))(jnp.asarray(X)))


def test_a_cached_jitted_function_follows_a_recreated_default_group() -> None:
    """group=None means the default group when the collective runs, not when it was traced."""
    jitted = jax.jit(lambda x: cj.all_gather(x, tiled=True))
    np.testing.assert_array_equal(jitted(jnp.asarray(X)), X)
    colls.destroy_process_group()
    colls.init_process_group("tcp", store=HashStore(), rank=0, world_size=1)
    np.testing.assert_array_equal(jitted(jnp.asarray(X)), X)  # cached trace, new group


def test_a_group_of_another_size_than_traced_is_refused_when_the_collective_runs() -> None:
    traced_for_two = _host.bind(_host.all_reduce, _host.Target(None, 2), "all_reduce",
                                op=cj.ReduceOp.SUM)
    with pytest.raises(ValueError, match=r"colls_jax\.all_reduce on rank 0: this call was traced "
                                         r"for a group of 2 ranks but the group now has 1; .*"
                                         r"jax\.clear_caches\(\)"):
        traced_for_two(X, np.empty_like(X))


def test_a_collective_on_a_captured_constant_runs_on_every_call(monkeypatch) -> None:
    """A concrete array in a jitted function's closure is staged, not reduced once at trace."""
    calls = []
    real = _host.all_reduce
    monkeypatch.setattr(_host, "all_reduce",
                        lambda x, out, **kw: (calls.append(1), real(x, out, **kw))[1])
    constant = jnp.asarray(X)
    jitted = jax.jit(lambda: cj.all_reduce(constant))
    for _ in range(2):
        np.testing.assert_array_equal(jitted(), X)
    jax.effects_barrier()
    assert len(calls) == 2


# -- the FFI path: XLA's own buffers ------------------------------------------------------------


def test_ffi_path_hands_xla_buffers_to_colls_without_a_copy(jit_path: str, monkeypatch) -> None:
    """all_reduce computes in the donated input buffer; all_gather reads XLA's parameter."""
    if jit_path != "ffi":
        pytest.skip("the callback path copies by design (NumPy arrays in and out)")
    seen: dict[str, int] = {}
    real_reduce, real_gather = colls.all_reduce, colls.all_gather_into_tensor

    def spy_reduce(out, *args, **kwargs):
        seen["all_reduce"] = out.ctypes.data
        return real_reduce(out, *args, **kwargs)

    def spy_gather(out, src, **kwargs):
        seen["all_gather"] = src.ctypes.data
        return real_gather(out, src, **kwargs)

    monkeypatch.setattr(colls, "all_reduce", spy_reduce)
    monkeypatch.setattr(colls, "all_gather_into_tensor", spy_gather)
    x = jnp.asarray(X) + 1
    address = x.unsafe_buffer_pointer()
    out = jax.jit(cj.all_reduce, donate_argnums=0)(x)
    np.testing.assert_array_equal(out, X + 1)
    assert seen["all_reduce"] == address == out.unsafe_buffer_pointer()
    y = jnp.asarray(X)
    np.testing.assert_array_equal(jax.jit(cj.all_gather)(y), X[None])
    assert seen["all_gather"] == y.unsafe_buffer_pointer()


def test_ffi_handler_keeps_each_xla_threads_python_state(jit_path: str, monkeypatch) -> None:
    """XLA runs custom calls on its own threads; the handler keeps one Python thread state per
    thread, so what colls keeps per thread (threading.local) survives from call to call. A new
    state per call emptied it every time and cost more than a 1-rank collective."""
    if jit_path != "ffi":
        pytest.skip("the callbacks run on JAX's callback thread, not in a handler")
    local = threading.local()
    fresh: list[int] = []
    threads: set[int] = set()
    real_reduce = colls.all_reduce

    def spy_reduce(out, *args, **kwargs):
        threads.add(threading.get_native_id())
        if not hasattr(local, "seen"):
            local.seen = True
            fresh.append(threading.get_native_id())
        return real_reduce(out, *args, **kwargs)

    monkeypatch.setattr(colls, "all_reduce", spy_reduce)

    @jax.jit
    def chain(v):
        for _ in range(5):
            v = cj.all_reduce(v) * 0.5
        return v

    data = np.arange(4096, dtype=np.float32)  # XLA runs programs this size on its own threads
    x = jnp.asarray(data)
    results = [chain(x) for _ in range(40)]  # dispatched back to back
    np.testing.assert_array_equal(results[-1], data * colls.get_world_size() ** 5 * 0.5 ** 5)
    jax.effects_barrier()
    assert threads - {threading.get_native_id()}, "every call ran on the caller's thread"
    assert sorted(fresh) == sorted(threads), f"{len(fresh)} fresh states on {len(threads)} threads"


def test_the_chosen_path_is_reported_under_colls_debug(jit_path: str, monkeypatch, capsys
                                                       ) -> None:
    from colls_jax import _ffi

    monkeypatch.setenv("COLLS_DEBUG", "info")
    _ffi.reset()
    jax.jit(cj.all_reduce).lower(jnp.asarray(X))
    assert f"colls_jax: jit path: {jit_path}: " in capsys.readouterr().err


def test_without_the_extension_jit_falls_back_to_callbacks(monkeypatch, capsys) -> None:
    """A checkout built without a C compiler: auto takes the callbacks, ffi says why it can't."""
    import sys

    from colls_jax import _ffi

    monkeypatch.setitem(sys.modules, "colls_jax._ffi_native", None)  # import raises ImportError
    monkeypatch.delattr(cj, "_ffi_native", raising=False)  # and the package does not hold it
    monkeypatch.setenv("COLLS_DEBUG", "info")
    monkeypatch.setenv("COLLS_JAX_JIT", "auto")
    _ffi.reset()
    jax.clear_caches()
    assert _ffi.path() == "callback"
    assert "colls_jax: jit path: callback: the extension colls_jax._ffi_native is not built" in (
        capsys.readouterr().err)
    np.testing.assert_array_equal(jax.jit(lambda x: cj.all_reduce(x) * 2)(jnp.asarray(X)), X * 2)
    monkeypatch.setenv("COLLS_JAX_JIT", "ffi")
    _ffi.reset()
    with pytest.raises(RuntimeError, match=r"COLLS_JAX_JIT=ffi but the FFI path cannot load: "
                                           r"the extension colls_jax\._ffi_native is not built"):
        _ffi.path()
    _ffi.reset()
