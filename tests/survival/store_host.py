"""The job's TCPStore for tests/survival/test_partition.py, served from its own process (run
inside an emulated host's namespace), so that it outlives the ranks as colls-run's store does.

``python store_host.py ADDRESS`` binds ADDRESS on a free port (token: COLLS_AUTH_TOKEN), prints
``port N``, then answers each line of stdin, a key, with ``key {"key": K, "value": V}`` (V the
value as text, or null when the key is not set), until stdin ends.
"""

from __future__ import annotations

import json
import sys

from colls.store import TCPStore


def main() -> None:
    store = TCPStore(sys.argv[1], 0, is_master=True, wait_for_workers=False, timeout=60.0)
    sys.stdout.write(f"port {store.port}\n")
    sys.stdout.flush()
    for line in sys.stdin:
        key = line.strip()
        value = store.get(key).decode() if store.check([key]) else None
        sys.stdout.write(f"key {json.dumps({'key': key, 'value': value})}\n")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
