"""FileStore specifics: sharing one file, the error's path, deletion by the last of world_size."""

from __future__ import annotations

import os
import stat
import threading
from pathlib import Path

import pytest
from store_testutil import TEST_TIMEOUT_S

from colls.errors import StoreError, StoreTimeoutError
from colls.store import FileStore

pytestmark = pytest.mark.timeout(60)


def test_two_instances_share_the_file(tmp_path: Path) -> None:
    path = str(tmp_path / "shared")
    with FileStore(path, timeout=TEST_TIMEOUT_S) as one, FileStore(path) as two:
        one.set("a", b"1")
        assert two.get("a") == b"1"
        assert two.add("n", 2) == 2 and one.add("n", 3) == 5
        assert two.delete_key("a") and not one.check(["a"])
        two.multi_set(["x", "y"], [b"X", b"Y"])
        assert one.multi_get(["y", "x"]) == [b"Y", b"X"]
        assert one.num_keys() == two.num_keys() == 3  # n, x, y; refcounts are internal


def test_timeout_message_names_the_path(tmp_path: Path) -> None:
    path = str(tmp_path / "timeouts")
    with FileStore(path, timeout=0.3) as store:
        with pytest.raises(StoreTimeoutError) as info:
            store.get("missing")
    assert str(info.value) == (
        f"FileStore {path}: get('missing') timed out after 0.3 s (timeout 0.3 s)"
    )


def test_last_of_world_size_deletes_the_file(tmp_path: Path) -> None:
    path = tmp_path / "cleanup"
    first, second = FileStore(str(path), world_size=2), FileStore(str(path), world_size=2)
    first.set("k", b"v")
    first.close()
    assert path.exists()
    second.close()
    assert not path.exists()


def test_unknown_world_size_keeps_the_file(tmp_path: Path) -> None:
    path = tmp_path / "kept"
    FileStore(str(path)).close()
    assert path.exists()


def test_deleted_file_is_recreated_from_scratch(tmp_path: Path) -> None:
    path = tmp_path / "recreated"
    with FileStore(str(path)) as store:
        store.set("old", b"1")
        path.unlink()
        store.set("new", b"2")
        assert not store.check(["old"]) and store.get("new") == b"2"


def test_concurrent_adds_from_threads_are_atomic(tmp_path: Path) -> None:
    path = str(tmp_path / "adds")
    stores = [FileStore(path, timeout=TEST_TIMEOUT_S) for _ in range(4)]

    def hammer(store: FileStore) -> None:
        for _ in range(50):
            store.add("count", 1)

    threads = [threading.Thread(target=hammer, args=(s,)) for s in stores]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(TEST_TIMEOUT_S)
    assert stores[0].get("count") == b"200"
    for store in stores:
        store.close()


def test_argument_errors(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="world_size must be >= 1 or -1 .*got 0"):
        FileStore(str(tmp_path / "x"), world_size=0)
    with pytest.raises(TypeError, match="file_name must be a str, got int"):
        FileStore(3)  # type: ignore[arg-type]


def test_the_file_is_created_for_its_owner_only(tmp_path: Path) -> None:
    path = tmp_path / "store"
    old = os.umask(0)  # the mode must not depend on a permissive umask
    try:
        store = FileStore(str(path), world_size=-1)
    finally:
        os.umask(old)
    store.set("k", b"v")
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert path.stat().st_uid == os.geteuid()
    store.close()


def test_a_symbolic_link_is_refused_and_its_target_untouched(tmp_path: Path) -> None:
    target = tmp_path / "precious"
    target.write_bytes(b"not a store")
    link = tmp_path / "store"
    link.symlink_to(target)
    with pytest.raises(StoreError, match=r"FileStore .*store: the path is a symbolic link; "
                       r"refusing to follow it"):
        FileStore(str(link), world_size=1)
    assert target.read_bytes() == b"not a store"


def test_a_file_of_another_user_is_refused(tmp_path: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root to give a file to another user")
    path = tmp_path / "store"
    path.write_bytes(b"")
    os.chown(path, 54321, 54321)
    with pytest.raises(StoreError, match=r"FileStore .*store: the file belongs to user id 54321, "
                       r"not to this process's 0; refusing to use it"):
        FileStore(str(path), world_size=1)
    assert path.read_bytes() == b""
