"""colls_torch has torch.distributed's names, with the same signatures (names, order, defaults).

Annotations are not compared (torch's mention its own ProcessGroup type); parameter names,
kinds, order and default values are.
"""

from __future__ import annotations

import datetime
import inspect

import pytest

torch = pytest.importorskip("torch")
import colls_torch as C  # noqa: E402
import torch.distributed as T  # noqa: E402

import colls  # noqa: E402

#: Every function the issue lists, plus the torch 2.x extras colls_torch covers.
FUNCTIONS = """
init_process_group destroy_process_group is_initialized is_available get_rank get_world_size
get_backend new_group new_subgroups new_subgroups_by_enumeration get_global_rank get_group_rank
get_process_group_ranks all_reduce broadcast reduce all_gather all_gather_into_tensor
all_gather_single gather scatter reduce_scatter reduce_scatter_tensor reduce_scatter_single
all_to_all all_to_all_single barrier monitored_barrier send recv isend irecv batch_isend_irecv
all_gather_object broadcast_object_list gather_object scatter_object_list send_object_list
recv_object_list is_mpi_available is_nccl_available is_gloo_available is_backend_available
is_ucc_available is_xccl_available is_torchelastic_launched get_node_local_rank
all_reduce_coalesced all_gather_coalesced register_rendezvous_handler get_backend_config
get_pg_count get_default_backend_for_device supports_complex
""".split()
CLASSES_AND_OBJECTS = """
P2POp ReduceOp reduce_op Backend group GroupMember Work Store TCPStore FileStore HashStore
PrefixStore DistError DistBackendError DistNetworkError DistStoreError default_pg_timeout
""".split()
#: The torch 1.x *_multigpu signatures (gone from torch 2.x), which colls keeps.
MULTIGPU = {
    "all_reduce_multigpu": "(tensor_list, op=<RedOpType.SUM: 0>, group=None, async_op=False)",
    "broadcast_multigpu": "(tensor_list, src, group=None, async_op=False, src_tensor=0)",
    "reduce_multigpu": "(tensor_list, dst, op=<RedOpType.SUM: 0>, group=None, async_op=False, "
                       "dst_tensor=0)",
    "all_gather_multigpu": "(output_tensor_lists, input_tensor_list, group=None, async_op=False)",
    "reduce_scatter_multigpu": "(output_tensor_list, input_tensor_lists, op=<RedOpType.SUM: 0>, "
                               "group=None, async_op=False)",
}


def _shape(func: object) -> list[tuple[str, object, object]]:
    return [(p.name, p.kind, p.default) for p in inspect.signature(func).parameters.values()]


@pytest.mark.parametrize("name", FUNCTIONS)
def test_function_signature_matches_torch(name):
    assert name in C.__all__
    assert _shape(getattr(C, name)) == _shape(getattr(T, name)), (
        f"{name}: colls_torch{inspect.signature(getattr(C, name))} != "
        f"torch{inspect.signature(getattr(T, name))}")


def test_p2pop_constructor_matches_torch():
    assert _shape(C.P2POp.__init__) == _shape(T.P2POp.__init__)


#: Exported objects that are torch's own, so that isinstance checks and except clauses written
#: against either module hold for both.
TORCH_OWN = "ReduceOp reduce_op DistError DistBackendError DistNetworkError DistStoreError".split()
#: colls' stores (DESIGN.md: torch's Store API); each method name is also torch's.
STORES = "Store TCPStore FileStore HashStore PrefixStore".split()
STORE_API = "set get add compare_set wait check delete_key num_keys set_timeout timeout".split()
#: torch's backend names, which colls_torch's Backend spells the same.
BACKEND_NAMES = "UNDEFINED GLOO NCCL UCC MPI XCCL".split()
#: Each name of CLASSES_AND_OBJECTS and the test below that checks what it is.
CHECKED_BY = {
    **dict.fromkeys(TORCH_OWN, "test_torch_own_objects_are_shared"),
    **dict.fromkeys(STORES, "test_stores_have_torchs_store_api"),
    "Backend": "test_backend_spells_torchs_names",
    "group": "test_group_sentinels_are_colls_own",
    "GroupMember": "test_group_sentinels_are_colls_own",
    "P2POp": "test_p2pop_constructor_matches_torch",
    "Work": "test_work_is_a_torch_work",
    "default_pg_timeout": "test_default_pg_timeout_is_torchs",
}


@pytest.mark.parametrize("name", CLASSES_AND_OBJECTS)
def test_name_is_exported_and_checked(name):
    assert name in C.__all__
    assert CHECKED_BY[name] in globals(), f"{name}: no test checks what it is"


@pytest.mark.parametrize("name", TORCH_OWN)
def test_torch_own_objects_are_shared(name):
    assert getattr(C, name) is getattr(T, name)


@pytest.mark.parametrize("name", STORES)
def test_stores_have_torchs_store_api(name):
    store = getattr(C, name)
    assert issubclass(store, C.Store) and issubclass(store, colls.Store)
    missing = [m for m in STORE_API if not callable(getattr(store, m, None))
               and not isinstance(getattr(store, m, None), property)]
    assert not missing, f"colls_torch.{name} lacks {missing}"
    assert all(hasattr(getattr(T, name), m) for m in STORE_API)  # the names are torch's


def test_backend_spells_torchs_names():
    assert [getattr(C.Backend, n) for n in BACKEND_NAMES] == [
        getattr(T.Backend, n) for n in BACKEND_NAMES]
    assert C.Backend("GLOO") == T.Backend("GLOO") == "gloo"


def test_group_sentinels_are_colls_own():
    assert C.group.WORLD is C.GroupMember.WORLD is colls.group.WORLD
    assert C.GroupMember.NON_GROUP_MEMBER is colls.GroupMember.NON_GROUP_MEMBER
    assert C.GroupMember.NON_GROUP_MEMBER is not C.GroupMember.WORLD


def test_default_pg_timeout_is_torchs():
    assert C.default_pg_timeout == T.default_pg_timeout == datetime.timedelta(minutes=30)


def test_work_is_a_torch_work():
    assert issubclass(C.Work, T.Work)


@pytest.mark.parametrize("name", sorted(MULTIGPU))
def test_multigpu_signatures_are_torch_1x(name):
    signature = inspect.signature(getattr(C, name))
    plain = signature.replace(parameters=[p.replace(annotation=inspect.Parameter.empty)
                                          for p in signature.parameters.values()],
                              return_annotation=inspect.Signature.empty)
    assert str(plain) == MULTIGPU[name]


def test_all_names_resolve():
    missing = [n for n in C.__all__ if not hasattr(C, n)]
    assert not missing
