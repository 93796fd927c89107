"""The tcp engine's receive matching, which is colls' own: :mod:`colls.matching`.

The queues were written here first and moved to the core so that every backend can use them
(:class:`colls.backend.Matcher`); this name stays for the tests that import it from tcp.
"""

from __future__ import annotations

from colls.matching import MatchTable as MatchTable
from colls.matching import Message as Message
from colls.matching import RecvOp as RecvOp
