"""The Store contract, run against every store kind (Hash, File, TCP and Prefix stores)."""

from __future__ import annotations

import datetime
import threading
import time

import pytest

from colls.errors import StoreError, StoreTimeoutError
from colls.store import PrefixStore, Store

pytestmark = pytest.mark.timeout(60)


def test_set_get_bytes_and_str(store: Store) -> None:
    store.set("a", b"\x00\xffraw")
    store.set("b", "héllo")
    assert store.get("a") == b"\x00\xffraw"
    assert store.get("b") == "héllo".encode()
    store.set("a", b"")
    assert store.get("a") == b""


def test_add_counts_as_decimal_ascii(store: Store) -> None:
    assert store.add("n", 5) == 5
    assert store.add("n", -7) == -2
    assert store.add("n", 0) == -2
    assert store.get("n") == b"-2"
    store.set("m", "40")
    assert store.add("m", 2) == 42


def test_add_on_non_integer_value_raises_store_error(store: Store) -> None:
    store.set("x", b"not a number")
    with pytest.raises(StoreError, match="x'.*not a decimal integer"):
        store.add("x", 1)


def test_compare_set_follows_torch(store: Store) -> None:
    # Missing key, empty expected: set.
    assert store.compare_set("k", b"", b"v1") == b"v1"
    assert store.get("k") == b"v1"
    # Present key, wrong expected: unchanged, current value returned.
    assert store.compare_set("k", b"zz", b"v2") == b"v1"
    assert store.get("k") == b"v1"
    # Present key, right expected: swapped.
    assert store.compare_set("k", "v1", "v2") == b"v2"
    assert store.get("k") == b"v2"
    # Missing key, non-empty expected: nothing stored, expected returned (torch).
    assert store.compare_set("missing", b"e", b"d") == b"e"
    assert not store.check(["missing"])


def test_check_wait_delete_num_keys(store: Store) -> None:
    assert store.num_keys() == 0
    assert not store.check(["a"])
    store.set("a", b"1")
    store.add("b", 1)
    assert store.check(["a", "b"])
    assert not store.check(["a", "c"])
    store.wait(["a", "b"])
    assert store.num_keys() == 2
    assert store.delete_key("a") is True
    assert store.delete_key("a") is False
    assert store.num_keys() == 1
    assert not store.check(["a"])


def test_multi_set_and_multi_get(store: Store) -> None:
    store.multi_set(["x", "y", "z"], [b"1", "2", b""])
    assert store.multi_get(["z", "x", "y"]) == [b"", b"1", b"2"]
    assert store.multi_get([]) == []
    with pytest.raises(ValueError, match="2 keys and 1 values"):
        store.multi_set(["p", "q"], [b"1"])


def test_get_blocks_until_another_thread_sets(store: Store) -> None:
    setter = threading.Timer(0.3, store.set, args=("late", b"here"))
    setter.start()
    start = time.monotonic()
    try:
        assert store.get("late") == b"here"
    finally:
        setter.join(10)
    assert time.monotonic() - start >= 0.25


def test_wait_blocks_until_all_keys(store: Store) -> None:
    def set_both() -> None:
        store.set("w1", b"1")
        time.sleep(0.1)
        store.set("w2", b"2")

    setter = threading.Timer(0.1, set_both)
    setter.start()
    try:
        store.wait(["w1", "w2"], timeout=10)
    finally:
        setter.join(10)
    assert store.check(["w1", "w2"])


def test_wait_needs_every_key_present_when_it_returns(store: Store) -> None:
    """A key present when the wait began but deleted before the last one came is waited for."""
    store.set("d1", b"1")

    def delete_then_set() -> None:
        store.delete_key("d1")
        store.set("d2", b"2")
        time.sleep(0.3)
        store.set("d1", b"again")

    setter = threading.Timer(0.1, delete_then_set)
    setter.start()
    start = time.monotonic()
    try:
        store.wait(["d1", "d2"], timeout=10)
    finally:
        setter.join(10)
    assert time.monotonic() - start >= 0.35  # not answered when d2 came: d1 was gone then
    assert store.get("d1") == b"again"


def test_many_waiters_for_many_keys_are_all_answered(store: Store) -> None:
    """Every key written answers exactly the waits that then have all their keys."""
    keys = [f"m{i}" for i in range(40)]
    done: list[int] = []

    def wait_for(count: int) -> None:
        store.wait(keys[:count], timeout=10)
        done.append(count)

    waiters = [threading.Thread(target=wait_for, args=(c,)) for c in (10, 20, 40)]
    for waiter in waiters:
        waiter.start()
    time.sleep(0.1)
    for key in keys[:20]:
        store.set(key, b"x")
    deadline = time.monotonic() + 10
    while len(done) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert sorted(done) == [10, 20]  # the wait for 40 keys still waits
    for key in keys[20:]:
        store.set(key, b"x")
    for waiter in waiters:
        waiter.join(10)
    assert sorted(done) == [10, 20, 40]


def test_get_timeout_names_key_and_elapsed(store: Store) -> None:
    store.set_timeout(0.3)
    assert store.timeout == datetime.timedelta(seconds=0.3)
    start = time.monotonic()
    with pytest.raises(StoreTimeoutError) as info:
        store.get("never")
    assert time.monotonic() - start >= 0.29
    message = str(info.value)
    assert "get(" in message and "never" in message
    assert "timed out after 0.3 s (timeout 0.3 s)" in message
    assert message.startswith(store.description)


def test_multi_get_waits_for_every_key_within_its_own_timeout(store: Store) -> None:
    store.set("mg1", b"1")
    setter = threading.Timer(0.2, store.set, args=("mg2", b"2"))
    setter.start()
    try:
        assert store.multi_get(["mg1", "mg2"], timeout=10) == [b"1", b"2"]
    finally:
        setter.join(10)
    start = time.monotonic()
    with pytest.raises(StoreTimeoutError) as info:
        store.multi_get(["mg1", "never"], timeout=0.3)  # not the store's timeout (300 s)
    assert 0.29 <= time.monotonic() - start < 30
    assert "never" in str(info.value)


@pytest.mark.parametrize("timeout", [0.2, datetime.timedelta(milliseconds=200)])
def test_wait_timeout_accepts_float_and_timedelta(store: Store, timeout: object) -> None:
    store.set("present", b"1")
    with pytest.raises(StoreTimeoutError, match=r"wait\(\[.*'(pre/)?absent'\]\) timed out after"):
        store.wait(["present", "absent"], timeout=timeout)  # type: ignore[arg-type]


def test_timeout_error_is_a_timeout_error(store: Store) -> None:
    with pytest.raises(TimeoutError):
        store.wait(["nothing"], timeout=0)


def test_type_mistakes_name_the_argument(store: Store) -> None:
    with pytest.raises(TypeError, match="key must be a str, got int"):
        store.set(3, b"x")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="value must be bytes or str, got int"):
        store.set("k", 3)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="amount must be an int, got float"):
        store.add("k", 1.5)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"keys\[1\] must be a str"):
        store.wait(["a", 2])  # type: ignore[list-item]
    with pytest.raises(TypeError, match="keys must be a list of str"):
        store.check("abc")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="timeout must be a float of seconds or a datetime"):
        store.set_timeout("5")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="timeout must be a number of seconds >= 0"):
        store.wait(["a"], timeout=-1)


def test_closed_store_raises_and_context_manager_closes(store: Store) -> None:
    with store as same:
        assert same is store
        store.set("k", b"v")
    with pytest.raises(StoreError, match="closed"):
        store.get("k")
    store.close()  # idempotent


def test_prefix_store_namespaces_keys(make_store) -> None:  # type: ignore[no-untyped-def]
    base = make_store("hash")
    one, two = PrefixStore("one", base), PrefixStore("two", base)
    one.set("k", b"1")
    two.set("k", b"2")
    assert base.get("one/k") == b"1" and base.get("two/k") == b"2"
    assert one.underlying_store is base
    assert one.add("c", 3) == 3 and base.get("one/c") == b"3"
    nested = PrefixStore("inner", one)
    nested.set("x", b"y")
    assert base.get("one/inner/x") == b"y"
    one.set_timeout(0.1)
    assert base.timeout == datetime.timedelta(seconds=20)
    with pytest.raises(StoreTimeoutError, match="one/missing"):
        one.get("missing")
    one.close()
    assert base.get("one/k") == b"1"  # closing the prefix view leaves the base open
    with pytest.raises(TypeError, match="store must be a colls.store.Store"):
        PrefixStore("p", object())  # type: ignore[arg-type]


def test_delete_keys_deletes_each_and_counts_those_that_existed(store: Store) -> None:
    store.set("a", b"1")
    store.set("b", b"2")
    store.set("c", b"3")
    assert store.delete_keys(["a", "c", "missing"]) == 2
    assert not store.check(["a"]) and not store.check(["c"])
    assert store.get("b") == b"2"
    assert store.delete_keys([]) == 0
    assert store.num_keys() == 1
