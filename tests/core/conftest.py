"""Tests of the core (the colls package): its units, its collectives on real ranks, and how it
fails (dead peers, timeouts, mismatches, shutdown), at scale and under load.

Their rank functions live in ``*_workers.py`` beside them, importable by name in spawned ranks.
"""
