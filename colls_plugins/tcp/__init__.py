"""The tcp backend: point-to-point over one TCP connection per pair of ranks.

Needs only the standard library and NumPy. :mod:`~colls_plugins.tcp.plugin` declares it to colls
(entry point ``tcp``); :class:`~colls_plugins.tcp.backend.TcpBackend` is the backend,
:mod:`~colls_plugins.tcp.connections` builds the mesh through the group's store and
:mod:`~colls_plugins.tcp.engine` moves the bytes on one progress thread. See docs/tcp.md.
"""
