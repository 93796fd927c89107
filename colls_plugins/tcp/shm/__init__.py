"""Shared memory among the ranks of a tcp group that run on one host.

* :mod:`.segment`: one rank's segment (its layout, creating it, mapping a peer's);
* :mod:`.group`: :class:`~.group.ShmGroup`, the host's segments with phase posts and waits;
* :mod:`.setup`: the host map and the store exchange that maps the segments (all or none);
* :mod:`.collectives` and :mod:`.tiny`: the collectives over the segments' slots and control
  page; :mod:`.level`: them as the local level of the two-level algorithms;
* :mod:`.p2p` and :mod:`.remote`: point-to-point rings between host peers, and large messages
  read from the sender's memory;
* :mod:`.native`: picks the optional compiled hot loop (``_native.c``) or the Python path.
"""
