"""The one table of collectives (colls.collective_table) reaches every place that needs it.

Each test takes one use of a collective's facts and fails when a collective of the table is
missing from it, or when the use disagrees with the table, so a collective added to the table
alone, or added everywhere but the table, fails here and not on a GPU or a wire.
"""

from __future__ import annotations

import importlib
import inspect

import pytest

import colls
from colls import algorithms, fingerprint, staging
from colls.algorithms import select
from colls.backend import Backend
from colls.collective_table import (
    BACKEND_COLLECTIVES,
    BY_WIRE_CODE,
    COLLECTIVES,
    PUBLIC_COLLECTIVES,
)

#: The wire codes as released: tags carry them, so they never change (append only).
RELEASED_WIRE_CODES = {
    "all_reduce": 1, "broadcast": 2, "reduce": 3, "all_gather": 4, "all_gather_into_tensor": 5,
    "gather": 6, "scatter": 7, "reduce_scatter": 8, "reduce_scatter_tensor": 9,
    "all_to_all": 10, "all_to_all_single": 11, "barrier": 12, "monitored_barrier": 13,
    "fingerprint": 14,
}


def test_wire_codes_are_unique_and_never_change() -> None:
    codes = {name: c.wire_code for name, c in COLLECTIVES.items()}
    assert {k: codes[k] for k in RELEASED_WIRE_CODES} == RELEASED_WIRE_CODES
    assert len(set(codes.values())) == len(codes)
    assert all(0 < code < fingerprint.UNKNOWN_OP_CODE for code in codes.values())
    assert dict(BY_WIRE_CODE) == {code: name for name, code in codes.items()}


@pytest.mark.parametrize("name", list(COLLECTIVES))
def test_every_collective_is_readable_back_from_its_tag(name: str) -> None:
    record = fingerprint.CallRecord(name, dtype="float32", shape=(4,))
    tag = fingerprint.collective_tag(7, record.signature())
    assert fingerprint.describe_tag(tag) == f"{name} #7"


@pytest.mark.parametrize("name", list(COLLECTIVES))
def test_the_agreed_argument_is_a_parameter_of_the_public_function(name: str) -> None:
    collective = COLLECTIVES[name]
    assert fingerprint.AGREED_ARG.get(name) == collective.agreed_arg
    if collective.agreed_arg is not None and collective.module is not None:
        function = getattr(importlib.import_module(collective.module), name)
        assert collective.agreed_arg in inspect.signature(function).parameters


@pytest.mark.parametrize("name", list(PUBLIC_COLLECTIVES))
def test_every_public_collective_is_exported_by_colls(name: str) -> None:
    module = importlib.import_module(PUBLIC_COLLECTIVES[name].module)
    assert name in colls.__all__
    assert getattr(colls, name) is getattr(module, name)


def test_every_public_function_of_the_collectives_module_is_in_the_table() -> None:
    collectives = importlib.import_module("colls.collectives")
    public = {name for name, value in vars(collectives).items()
              if inspect.isfunction(value) and value.__module__ == collectives.__name__
              and not name.startswith("_")}
    assert public == {n for n, c in PUBLIC_COLLECTIVES.items() if c.module == "colls.collectives"}


@pytest.mark.parametrize("name", list(BACKEND_COLLECTIVES))
def test_the_array_roles_name_array_parameters_of_the_backend_method(name: str) -> None:
    collective = BACKEND_COLLECTIVES[name]
    parameters = list(inspect.signature(getattr(Backend, name)).parameters)[1:]
    arrays = [parameters[i] for i in collective.arrays]
    assert all(p in ("array", "output", "input") for p in arrays), arrays
    assert ("op" in parameters) == collective.reduces
    assert ("root" in parameters) == collective.rooted


def test_the_backend_collectives_are_exactly_the_backend_methods_that_take_a_tag() -> None:
    with_tag = {name for name, value in vars(Backend).items()
                if inspect.isfunction(value) and "tag" in inspect.signature(value).parameters
                and name not in ("isend", "irecv", "send", "recv")}
    assert with_tag == set(BACKEND_COLLECTIVES)


def test_every_public_collective_runs_as_a_backend_collective_or_on_point_to_point() -> None:
    for collective in COLLECTIVES.values():
        assert collective.runs_as is None or BACKEND_COLLECTIVES[collective.runs_as.name] is (
            collective.runs_as)
    assert {c.runs_as.name for c in PUBLIC_COLLECTIVES.values() if c.runs_as} == set(
        BACKEND_COLLECTIVES)


def test_algorithms_are_selectable_and_implemented_for_every_backend_collective() -> None:
    expected = {name: c.algorithms for name, c in BACKEND_COLLECTIVES.items()}
    assert dict(select.ALGORITHMS) == expected
    assert {k: tuple(v) for k, v in algorithms.IMPLEMENTATIONS.items()} == expected


class _HostBackend(Backend):
    """A backend class with every collective, to see what staging wraps."""


def test_cuda_staging_wraps_every_backend_collective_with_arrays() -> None:
    staged = staging.stage_cuda(type("Staged", (_HostBackend,), {}))
    for name, collective in BACKEND_COLLECTIVES.items():
        wrapped = getattr(staged, name) is not getattr(Backend, name)
        assert wrapped == bool(collective.arrays), name
    assert {c.name for c in staging.WHOLE_BUFFER} == {
        n for n, c in BACKEND_COLLECTIVES.items() if c.arrays and not c.staged_in_segments
    }


def test_the_mpi_backend_stages_each_collective_with_the_table_roles() -> None:
    pytest.importorskip("mpi4py", reason="the mpi backend needs mpi4py (pip install -e '.[mpi]')")
    from colls_plugins.mpi import backend as mpi_backend

    for name, collective in BACKEND_COLLECTIVES.items():
        method = getattr(mpi_backend.MpiBackend, name)
        if collective.arrays:
            # host_staged wraps the method (functools.wraps keeps the original as __wrapped__)
            assert hasattr(method, "__wrapped__"), f"MpiBackend.{name} is not host-staged"
