"""Key-value stores for rendezvous, as torch.distributed's stores.

:class:`Store` is the contract; :class:`TCPStore` (multi-host, a binary protocol served by one event
loop), :class:`FileStore` (processes sharing a file), :class:`HashStore` (threads of one process)
and :class:`PrefixStore` (a namespace in another store) implement it. See docs/stores.md.
"""

from __future__ import annotations

from colls.store.base import DEFAULT_TIMEOUT, Store
from colls.store.file import FileStore
from colls.store.hash import HashStore
from colls.store.prefix import PrefixStore
from colls.store.tcp import TCPStore

__all__ = ["DEFAULT_TIMEOUT", "FileStore", "HashStore", "PrefixStore", "Store", "TCPStore"]
