"""all_reduce of a few elements through shared memory, in one phase and without NumPy per peer.

A solver's dot products are all_reduces of one float64; at that size a collective's time is
Python's, not the memory's, so this path does as little as it can:

* no slot: the payload goes into one of the two tiny lines of the rank's control page, next to
  its stamp (:class:`~colls_plugins.tcp.shm.group.ShmGroup`, "Tiny messages"), and is copied in
  with one memoryview assignment;
* one phase: post, wait for every peer's post, check their stamps, then every rank reduces all
  ranks' payloads itself in rank order (bitwise the same result everywhere);
* the reduction folds the payloads element by element as Python numbers through memoryviews of
  the array's format: a float32 store rounds the float64 sum of two float32 values to float32,
  which is exactly IEEE float32 addition (and likewise for multiplication), so the result is
  bitwise NumPy's ``((s0 + s1) + s2) + ...``. An integer result out of the type's range (which
  NumPy wraps) makes the store raise; that call, and every dtype or op without a fold
  (:data:`FOLDS`), combines with the op's NumPy kernel instead.

With the compiled extension (:mod:`colls_plugins.tcp.shm.native`), one C call stamps the line,
copies the payload in and posts, and another checks the stamps and folds: the same rank-order
fold in the element type (float32 in float32, integers wrapping as NumPy's do), so both paths
give NumPy's bits.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from colls import dtypes
from colls_plugins.tcp.shm.group import ShmGroup
from colls_plugins.tcp.shm.segment import TINY_BYTES

if TYPE_CHECKING:
    from colls.reduce_ops import ReduceSpec

WHAT = "all_reduce (shm, tiny)"

#: Dtypes with a fold, in the order of the compiled fold's codes (dtype index * 2 + product).
_FOLD_DTYPES = (dtypes.FLOAT32, dtypes.FLOAT64, dtypes.INT32, dtypes.INT64)

#: (op name, dtype) pairs folded without NumPy, to (adds, exact, code): ``adds`` False
#: multiplies; ``exact`` means Python's arithmetic on the values is the dtype's own until the
#: final store (float64 rounds each step as NumPy does; integers are exact and a result in range
#: equals NumPy's wrapped one), so intermediate values need no store; float32 rounds through the
#: store at every step. ``code`` names the fold to the compiled path.
FOLDS: dict[tuple[str, dtypes.DType], tuple[bool, bool, int]] = {
    (name, dtype): (name != "PRODUCT", dtype is not dtypes.FLOAT32,
                    2 * _FOLD_DTYPES.index(dtype) + (name == "PRODUCT"))
    for name in ("SUM", "AVG", "PREMUL_SUM", "PRODUCT")
    for dtype in _FOLD_DTYPES
}


def fits(array: Any) -> bool:
    """Whether ``array`` (a 1-D C-contiguous NumPy array) goes through this path."""
    return array.nbytes <= TINY_BYTES


def all_reduce(g: ShmGroup, array: Any, op: ReduceSpec, tag: int) -> None:
    """Reduce ``array`` (at most :data:`TINY_BYTES`, not empty) across the group in place."""
    fold = FOLDS.get((op.name, op.dtype))
    native = g.native
    if native is not None and fold is not None:
        line = g.post_tiny(array, tag)
        g.wait_all(g.phase, WHAT)
        if not native.tiny_fold(array, line, fold[2]):
            g.check_tiny(line, WHAT)  # raises, naming the peer
        return
    line = g.claim_tiny(tag)
    if fold is None:
        _exchange_numpy(g, array, op, line)
        return
    out = memoryview(array)
    payloads = g.tiny_payloads(line, out.format)
    count = len(out)
    payloads[g.rank][:count] = out
    g.post()
    g.wait_all(g.phase, WHAT)
    g.check_tiny(line, WHAT)
    try:
        _fold(out, payloads, count, fold[0], fold[1])
    except ValueError:  # an integer out of range: NumPy's kernel wraps it
        _combine(g, array, op, line)


def _fold(out: memoryview, payloads: list[memoryview], count: int, adds: bool, exact: bool
          ) -> None:
    """Set ``out`` to the rank-order sum (or product) of ``payloads[r][:count]``."""
    first, rest = payloads[0], payloads[1:]
    for i in range(count):
        acc = first[i]
        if exact:
            for payload in rest:
                acc = acc + payload[i] if adds else acc * payload[i]
        else:
            for payload in rest:  # the store rounds to the dtype after every step
                out[i] = acc + payload[i] if adds else acc * payload[i]
                acc = out[i]
        out[i] = acc


def _exchange_numpy(g: ShmGroup, array: Any, op: ReduceSpec, line: int) -> None:
    """The same exchange for dtypes and ops without a fold: NumPy copies and kernels."""
    arrays = g.tiny_arrays(line, array.dtype)
    arrays[g.rank][: array.size] = array
    g.post()
    g.wait_all(g.phase, WHAT)
    g.check_tiny(line, WHAT)
    _combine(g, array, op, line)


def _combine(g: ShmGroup, array: Any, op: ReduceSpec, line: int) -> None:
    """Set ``array`` to the rank-order reduction of every rank's payload with ``op``'s kernel."""
    arrays = g.tiny_arrays(line, array.dtype)
    count = array.size
    array[...] = arrays[0][:count]
    for other in arrays[1:]:
        op.combine(array, other[:count])


__all__ = ["FOLDS", "all_reduce", "fits"]
