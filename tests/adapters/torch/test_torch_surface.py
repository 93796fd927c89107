"""Every public callable of torch.distributed 2.13, against colls_torch and against the core.

colls_torch must have each one, with the same signature (parameter names, kinds, order and
default values; annotations are not compared), and the core ``colls`` must match the signature
of each name it shares with torch.distributed, unless the difference is intended. The intended
differences are the data below, and nowhere else in the tests; docs/torch.md's section "Where
colls_torch differs from torch.distributed" states the same, and a test holds the two equal.

Classes compare their constructors: ``inspect.signature`` for Python classes, the signature
pybind11 writes into ``__init__.__doc__`` for torch's C++ ones. Reduce-op defaults are the same
when they name the same op (``op=ReduceOp.SUM`` is torch's object in colls_torch and colls' own
in the core).
"""

from __future__ import annotations

import inspect
import re
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
import colls_torch as C  # noqa: E402
import torch.distributed as T  # noqa: E402

import colls  # noqa: E402

_DEBUG = ("`TORCH_DISTRIBUTED_DEBUG`'s switches for torch's own groups; colls reads "
          "`COLLS_DEBUG` (docs/env.md)")
_SPLIT = ("experimental in torch 2.13 and NCCL only (communicator split and shrink); "
          "new_group and new_subgroups_by_enumeration make the same groups")
_STORE_TIMEOUT = "also takes `timeout` (torch's sets it with `set_timeout()` only)"
_MADE_BY_COLLS = "made by colls, not by users: a group by init_process_group and new_group"
_WORK = "made by colls around a running operation, not by users"

#: Public callables of torch.distributed that colls_torch does not provide, and why.
NOT_IN_COLLS_TORCH: dict[str, str] = {
    "BackendConfig": "torch's parser of backend strings; `get_backend_config()` returns its text",
    "DebugLevel": _DEBUG,
    "get_debug_level": _DEBUG,
    "set_debug_level": _DEBUG,
    "set_debug_level_from_env": _DEBUG,
    "GroupName": "a typing alias of torch's group names (colls names groups itself)",
    "ProcessGroupGloo": "torch's gloo backend class; colls_torch's `\"gloo\"` is colls' tcp",
    "QueueEmptyError": "raised by the queue methods of torch's stores, which colls' stores lack",
    "record_comm": "names collectives in torch's profiler, which colls' collectives bypass",
    "rendezvous": ("torch's init_method iterator; `init_process_group` takes the same URLs and "
                   "`register_rendezvous_handler` takes colls' handlers (docs/stores.md)"),
    "split_group": _SPLIT,
}

#: (face, name) -> why the signature differs from torch.distributed's. Face "colls_torch" is
#: the drop-in, "colls" the core.
SIGNATURE_DIFFERENCES: dict[tuple[str, str], str] = {
    ("colls_torch", "FileStore"): _STORE_TIMEOUT,
    ("colls_torch", "HashStore"): _STORE_TIMEOUT,
    ("colls_torch", "Store"): _STORE_TIMEOUT,
    ("colls_torch", "ProcessGroup"): _MADE_BY_COLLS,
    ("colls_torch", "Work"): _WORK,
    ("colls", "FileStore"): _STORE_TIMEOUT,
    ("colls", "HashStore"): _STORE_TIMEOUT,
    ("colls", "Store"): _STORE_TIMEOUT,
    ("colls", "ProcessGroup"): _MADE_BY_COLLS,
    ("colls", "Work"): _WORK,
    ("colls", "TCPStore"): ("`auth_token` instead of `multi_tenant`, `master_listen_fd` and "
                            "`use_libuv` (colls_torch's TCPStore takes torch's)"),
    ("colls", "ReduceOp"): "a namespace of ops, not constructed; torch's `ReduceOp(op)` wraps one",
    ("colls", "init_process_group"): "no `_ranks`, an argument private to torch",
    ("colls", "shrink_group"): ("`ranks_to_exclude` defaults to None (the dead ranks the "
                                "survivors agree on); no `shrink_flags` (colls always aborts) "
                                "or `pg_options` (the group keeps its parent's)"),
    ("colls", "rendezvous"): ("the module of init methods; its `rendezvous(url, rank, "
                              "world_size, timeout)` returns `(store, rank, world_size)`"),
}

FACES = {"colls_torch": C, "colls": colls}
DOC = Path(__file__).resolve().parents[3] / "docs" / "torch.md"
DOC_SECTION = "Where colls_torch differs from torch.distributed"

Shape = list[tuple[str, Any, str]]


def torch_callables() -> list[str]:
    return sorted(n for n in dir(T) if not n.startswith("_") and callable(getattr(T, n)))


def _default(value: Any) -> str:
    if value is inspect.Parameter.empty:
        return "<none>"
    if type(value).__name__ == "RedOpType":  # torch's ReduceOp.SUM or colls' own
        return f"ReduceOp.{value.name}"
    return repr(value)


def _from_pybind(cls: type) -> Shape | None:
    """The constructor's parameters as pybind11 documents them (one overload only)."""
    doc = (getattr(cls.__init__, "__doc__", None) or "").strip()
    found = re.match(r"__init__\(self: [^,)]+(?:, (.*))?\) -> None$", doc.splitlines()[0]
                     if doc else "")
    if found is None:
        return None
    params, depth, current = [], 0, ""
    for char in found.group(1) or "":
        depth += char in "([{"
        depth -= char in ")]}"
        if char == "," and depth == 0:
            params.append(current.strip())
            current = ""
        else:
            current += char
    if current.strip():
        params.append(current.strip())
    shape = []
    for param in params:
        name, _, rest = param.partition(":")
        default = rest.partition(" = ")[2] or "<none>"
        shape.append((name.strip(), inspect.Parameter.POSITIONAL_OR_KEYWORD, default))
    return shape


def shape(obj: Any) -> Shape | None:
    """Parameter (name, kind, default) of a function or of a class's constructor."""
    try:
        signature = inspect.signature(obj)
    except (TypeError, ValueError):
        return _from_pybind(obj) if inspect.isclass(obj) else None
    return [(p.name, p.kind, _default(p.default)) for p in signature.parameters.values()]


def differences(face: str) -> dict[str, tuple[Any, Any]]:
    """Names whose signature differs from torch's on ``face``: name -> (torch's, the face's)."""
    module = FACES[face]
    found = {}
    for name in torch_callables():
        if not hasattr(module, name) or getattr(module, name) is getattr(T, name):
            continue
        ours, theirs = shape(getattr(module, name)), shape(getattr(T, name))
        if ours != theirs:
            found[name] = (theirs, ours)
    return found


def test_colls_torch_has_every_public_callable_of_torch_distributed():
    missing = {n for n in torch_callables() if not callable(getattr(C, n, None))}
    assert missing == set(NOT_IN_COLLS_TORCH), (
        f"not listed: {sorted(missing - set(NOT_IN_COLLS_TORCH))}; "
        f"listed but provided now (or gone from torch): "
        f"{sorted(set(NOT_IN_COLLS_TORCH) - missing)}")


@pytest.mark.parametrize("face", sorted(FACES))
def test_signatures_match_torch_unless_listed(face):
    found = differences(face)
    listed = {name for f, name in SIGNATURE_DIFFERENCES if f == face}
    unlisted = {n: found[n] for n in sorted(set(found) - listed)}
    assert not unlisted, "\n".join(f"{face}.{n}: torch {t} != {o}" for n, (t, o) in
                                   unlisted.items())
    assert not listed - set(found), f"listed but now the same as torch: {listed - set(found)}"


def test_the_comparison_sees_names_kinds_order_and_defaults():
    def f(a, b=1, *, c=None): ...
    def renamed(a, x=1, *, c=None): ...
    def reordered(b=1, a=None, *, c=None): ...
    def other_default(a, b=2, *, c=None): ...
    def other_kind(a, b=1, c=None): ...
    assert len({str(shape(g)) for g in (f, renamed, reordered, other_default, other_kind)}) == 5
    assert shape(T.TCPStore)[:2] == [
        ("host_name", inspect.Parameter.POSITIONAL_OR_KEYWORD, "<none>"),
        ("port", inspect.Parameter.POSITIONAL_OR_KEYWORD, "<none>")]
    assert shape(T.all_reduce) == shape(C.all_reduce) == shape(colls.all_reduce)


def _doc_section() -> str:
    text = DOC.read_text()
    start = text.index(f"## {DOC_SECTION}\n")
    end = text.find("\n## ", start + 1)
    return text[start:] if end < 0 else text[start:end]


def _table(section: str, heading: str) -> dict[str, str]:
    """The two-column table under ``heading``: each backticked name of the first cell -> the
    second cell."""
    block = section[section.index(heading):]
    rows = {}
    for line in block.splitlines()[1:]:
        if line.startswith("#"):
            break
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 2:  # not a table row
            continue
        for name in re.findall(r"`([^`]+)`", cells[0]):  # none in the header and the rule
            rows[name] = " ".join(cells[1].split())
    return rows


def test_the_doc_states_the_same_differences():
    section = _doc_section()
    names = _table(section, "### Names colls_torch does not have")
    assert names == {n: " ".join(r.split()) for n, r in NOT_IN_COLLS_TORCH.items()}
    signatures = _table(section, "### Signatures that differ")
    assert signatures == {f"{face}.{name}": " ".join(r.split())
                          for (face, name), r in SIGNATURE_DIFFERENCES.items()}
