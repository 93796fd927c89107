"""Collective fingerprints: never let mismatched calls across ranks produce a wrong result.

Two layers, both built here and called from :mod:`colls.dispatch`:

* **Signature in every tag** (always on, free). A collective's tag is negative and encodes its
  sequence number together with a 40-bit *signature* of what all ranks must agree on: the
  operation (8 bits, readable back) and a 32-bit hash (CRC-32) of the dtype, the agreed element
  count, the root and the reduce op. Messages of mismatched calls therefore carry different tags
  and are never matched to each other, so no rank combines bytes of another collective; two
  different calls of one op collide with probability 2**-32. A transport that matches by tag
  (tcp) turns "a message with the same sequence number but another signature" into an immediate
  error naming the peer (see :func:`describe_tag_conflict`); one that does not still cannot mix
  the data, and its timeout ends the call.

  Layout: ``tag = -(1 + (sequence % 2**22 << 40 | op_code << 32 | hash32))``: above -2**62,
  so it fits the int64 of tcp's frame headers and shared-memory stamps and never reaches tcp's
  control-frame tags near -2**63. The sequence number wraps every 2**22 (4,194,304) collectives
  of a group; tags of collectives that far apart are never in flight together, and
  :func:`sequence_after` compares wrapped numbers.

* **Full check under** ``COLLS_DEBUG=detail``. Before each collective every rank all-gathers a
  fixed-size text fingerprint (op, sequence number, dtype, shape, root, reduce op, group) through
  the group's own backend, so it works for every backend including third-party ones. If any
  differs, every rank raises :class:`CollectiveMismatchError` (a ``ValueError``) naming the ranks
  that differ and how, before any data moves; the group stays usable.

Which argument's size must agree is op specific (``all_to_all`` sizes legitimately differ);
:data:`AGREED_ARG` lists it per op (from :mod:`colls.collective_table`). Ops not listed are
checked on op, dtype, root and reduce op.
"""

from __future__ import annotations

import hashlib
import math
import zlib
from collections import Counter
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from colls.collective_table import BY_WIRE_CODE, COLLECTIVES

if TYPE_CHECKING:
    from colls.process_group import ProcessGroup

#: Bits of the tag below the sequence number: 8 for the op code, 32 for the argument hash.
SIGNATURE_BITS = 40
_HASH_BITS = 32
_HASH_MASK = (1 << _HASH_BITS) - 1
_OP_MASK = 0xFF
#: Bits of the sequence number in a tag (it wraps): tags stay above -2**62, clear of int64's
#: end where tcp keeps its control-frame tags.
SEQUENCE_BITS = 62 - SIGNATURE_BITS
SEQUENCE_MASK = (1 << SEQUENCE_BITS) - 1
#: Op code of operations not in :data:`OP_CODES` (checked by hash only).
UNKNOWN_OP_CODE = 0xFF

#: Operations with a readable op code in tags, by name: the wire codes of
#: :mod:`colls.collective_table`.
OP_CODES = {name: c.wire_code for name, c in COLLECTIVES.items()}

#: Per op, the argument whose element count (and shape, under COLLS_DEBUG=detail) every rank
#: must pass identically. Ops not listed have no agreed size (all_to_all, barrier, ...).
AGREED_ARG = {name: c.agreed_arg for name, c in COLLECTIVES.items() if c.agreed_arg is not None}

#: Bytes of the text fingerprint exchanged under COLLS_DEBUG=detail.
FINGERPRINT_BYTES = 256
_DIGEST_BYTES = 16


#: Signatures by (op, dtype, agreed shape, root, reduce op): a training loop repeats a handful.
_SIGNATURES: dict[tuple[Any, ...], int] = {}
_MAX_SIGNATURES = 4096


def _signature(
    op: str, dtype: str | None, numel: int | None, root: int | None, reduce_op: str | None
) -> int:
    code = OP_CODES.get(op, UNKNOWN_OP_CODE)
    text = f"{op}|{dtype}|{numel}|{root}|{reduce_op}"
    return (code << _HASH_BITS) | (zlib.crc32(text.encode("utf-8")) & _HASH_MASK)


class CollectiveMismatchError(ValueError):
    """Ranks called different collectives (or with different arguments) at the same point."""


@dataclass(slots=True)
class CallRecord:
    """What :mod:`colls.dispatch` saw of one call's arguments, for its signature.

    Attributes:
        op: the operation name ("all_reduce").
        dtype: name of the first array argument's dtype, or None without arrays.
        shape: shape of the argument every rank must pass identically (:data:`AGREED_ARG`).
        root: the group rank of the root, for rooted ops.
        reduce_op: the reduce op's name, for reductions.
    """

    op: str
    dtype: str | None = None
    shape: tuple[int, ...] | None = None
    root: int | None = None
    reduce_op: str | None = None

    def saw_array(self, arg: str, shape: tuple[int, ...], dtype: str) -> None:
        """Note array argument ``arg``: the first one's dtype, and the agreed one's shape."""
        if self.dtype is None:
            self.dtype = dtype
        if arg == AGREED_ARG.get(self.op):
            self.shape = shape

    def agreed_numel(self) -> int | None:
        """Return the element count every rank must pass, or None."""
        return None if self.shape is None else math.prod(self.shape)

    def signature(self) -> int:
        """Return the 40-bit signature carried by this call's tag (memoised: read per call)."""
        key = (self.op, self.dtype, self.shape, self.root, self.reduce_op)
        found = _SIGNATURES.get(key)
        if found is None:
            if len(_SIGNATURES) >= _MAX_SIGNATURES:
                _SIGNATURES.clear()  # a program with endless call shapes: start over
            found = _SIGNATURES[key] = _signature(
                self.op, self.dtype, self.agreed_numel(), self.root, self.reduce_op
            )
        return found

    def describe(self, seq: int, group: str) -> str:
        """Return the text fingerprint exchanged under COLLS_DEBUG=detail."""
        shape = self.shape
        fields = {
            "op": self.op,
            "seq": str(shown_number(seq)),
            "dtype": self.dtype or "-",
            "shape": "-" if shape is None else str(tuple(shape)),
            "root": "-" if self.root is None else str(self.root),
            "reduce_op": self.reduce_op or "-",
            "group": group,
        }
        return ";".join(f"{k}={v}" for k, v in fields.items())


# -- tags ---------------------------------------------------------------------------------------


def collective_tag(seq: int, signature: int) -> int:
    """Return the (negative, int64) tag of collective number ``seq`` with ``signature``.

    The sequence and the signature fill separate bits, so the tag is also
    ``collective_tag(0, signature) - ((seq & SEQUENCE_MASK) << SIGNATURE_BITS)``: the fast path
    (:mod:`colls._fast_path`) keeps the first term per kind of call and computes the rest inline.
    """
    return -1 - (((seq & SEQUENCE_MASK) << SIGNATURE_BITS)
                 | (signature & ((1 << SIGNATURE_BITS) - 1)))


def tag_sequence(tag: int) -> int:
    """Return the sequence number encoded in a collective (negative) tag (modulo 2**22)."""
    return (-1 - tag) >> SIGNATURE_BITS


def sequence_after(a: int, b: int) -> bool:
    """Return whether tag sequence number ``a`` comes after ``b`` (serial-number arithmetic).

    Numbers wrap modulo 2**SEQUENCE_BITS; ``a`` is after ``b`` when it is less than half the
    range ahead, which holds for any two collectives whose messages can meet.
    """
    ahead = (a - b) & SEQUENCE_MASK
    return 0 < ahead < 1 << (SEQUENCE_BITS - 1)


def shown_number(seq: int) -> int:
    """Return how messages number collective ``seq``: the same way with and without
    ``COLLS_DEBUG=detail``.

    Under detail each collective takes two sequence numbers (its fingerprint exchange, then the
    collective), so collective ``k`` of a group carries ``2k + 1``; messages show ``k`` in both
    modes, counting the group's collectives from 0.
    """
    from colls import env  # read when a message is written, as the groups read it

    return seq // 2 if env.get("COLLS_DEBUG") == "detail" else seq


def describe_tag(tag: int) -> str:
    """Return ``"all_reduce #5"``: the op and the (shown) number of a collective's tag."""
    return f"{_tag_op(tag)} #{shown_number(tag_sequence(tag))}"


def _tag_op(tag: int) -> str:
    code = ((-1 - tag) >> _HASH_BITS) & _OP_MASK
    return BY_WIRE_CODE.get(code, "an operation outside colls' list")


def describe_tag_conflict(
    expected: int, arrived: int, peer: int, *, holder: str = "this rank"
) -> str:
    """Explain why tag ``arrived`` from rank ``peer`` conflicts with ``expected`` of ``holder``.

    Used by transports that see two tags of the same collective number (or a peer that moved on
    to a later collective while a receive for ``expected`` is pending).
    """
    seq, other_seq = tag_sequence(expected), tag_sequence(arrived)
    mine, theirs = _tag_op(expected), _tag_op(arrived)
    later = sequence_after(other_seq, seq)
    seq, other_seq = shown_number(seq), shown_number(other_seq)
    if later:
        return (
            f"mismatched collectives: rank {peer} moved on to collective #{other_seq} "
            f"({theirs}) without sending what {holder} expects in collective #{seq} "
            f"({mine}); the ranks called different collectives or passed different sizes"
        )
    if mine != theirs:
        return (
            f"mismatched collectives: collective #{seq} is {mine} on {holder} but "
            f"{theirs} on rank {peer}"
        )
    return (
        f"mismatched collectives: collective #{seq} ({mine}) was called with a different "
        f"dtype, element count, root or reduce op on rank {peer} than on {holder}; set "
        "COLLS_DEBUG=detail on every rank to see which"
    )


# -- COLLS_DEBUG=detail --------------------------------------------------------------------------


def encode(text: str) -> np.ndarray:
    """Return ``text`` as a fixed-size uint8 array (long texts end with a digest of the rest)."""
    raw = text.encode("utf-8")
    if len(raw) > FINGERPRINT_BYTES:
        digest = hashlib.blake2b(raw, digest_size=_DIGEST_BYTES).hexdigest().encode("ascii")
        raw = raw[: FINGERPRINT_BYTES - len(digest) - 1] + b"#" + digest
    out = np.zeros(FINGERPRINT_BYTES, dtype=np.uint8)
    out[: len(raw)] = np.frombuffer(raw, dtype=np.uint8)
    return out


def decode(row: np.ndarray) -> str:
    """Return the text held by one fingerprint row."""
    return bytes(row).rstrip(b"\0").decode("utf-8", "replace")


def _fields(text: str) -> dict[str, str]:
    pairs = (part.partition("=") for part in text.split(";") if part)
    return {k: v for k, _, v in pairs}


def explain(texts: list[str], global_rank: Any = lambda r: r) -> str | None:
    """Return how the fingerprints of the ranks differ, or None when they all agree.

    The most common fingerprint (rank 0's on a tie) is the reference; every rank holding
    another one is named with the fields that differ.

    Args:
        texts: one fingerprint text per group rank.
        global_rank: maps a group rank to the world rank shown in the message.
    """
    counts = Counter(texts)
    if len(counts) == 1:
        return None
    top = max(counts.values())
    reference_text = next(t for t in texts if counts[t] == top)
    ref_rank = global_rank(texts.index(reference_text))
    reference = _fields(reference_text)
    lines = []
    for rank, text in enumerate(texts):
        if text == reference_text:
            continue
        fields = _fields(text)
        diffs = [
            f"{key}={fields.get(key, '?')} where rank {ref_rank} has {key}={value}"
            for key, value in reference.items()
            if fields.get(key) != value
        ]
        lines.append(f"rank {global_rank(rank)} differs: " + ", ".join(diffs))
    return "; ".join(lines)


def check_across_ranks(pg: ProcessGroup, record: CallRecord, seq: int, tag: int) -> None:
    """All-gather ``record``'s fingerprint over ``pg``'s backend; raise if any rank differs.

    Raises:
        CollectiveMismatchError: on every rank, naming the ranks that differ and how.
    """
    text = record.describe(seq, pg.name)
    mine = encode(text)
    gathered = np.empty(FINGERPRINT_BYTES * pg.size, dtype=np.uint8)
    pg.backend.all_gather(gathered, mine, tag)
    texts = [decode(row) for row in gathered.reshape(pg.size, FINGERPRINT_BYTES)]
    problem = explain(texts, pg.global_rank)
    if problem is not None:
        raise CollectiveMismatchError(
            f"COLLS_DEBUG=detail: collective #{shown_number(seq)} on group {pg.name!r} does not "
            f"match across ranks: {problem}"
        )


FINGERPRINT_RECORD = CallRecord(op="fingerprint")

__all__ = [
    "AGREED_ARG",
    "CallRecord",
    "CollectiveMismatchError",
    "check_across_ranks",
    "collective_tag",
    "describe_tag",
    "describe_tag_conflict",
    "explain",
    "sequence_after",
    "shown_number",
    "tag_sequence",
]
