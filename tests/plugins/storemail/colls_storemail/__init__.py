"""colls-storemail: a third-party colls backend written against the public plugin contract only.

It implements nothing but point-to-point (``isend``/``irecv``/``close``), moving every message
through the group's store; every collective then comes from :mod:`colls.algorithms`. It exists to
show, and to test, that a transport found through an entry point gets the whole API.
"""

from colls_storemail.backend import StoreMailBackend

__all__ = ["StoreMailBackend"]
