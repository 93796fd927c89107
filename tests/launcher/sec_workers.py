"""Rank functions of the COLLS_AUTH_TOKEN job tests (importable by spawned children)."""

from __future__ import annotations

import os
from typing import Any

import numpy as np

import colls
from colls.errors import CollsError


def join_with_token(rank: int, world_size: int, tokens: list[str]) -> dict[str, Any]:
    """Set this rank's COLLS_AUTH_TOKEN, try to join the job and all_reduce; report the outcome."""
    os.environ["COLLS_AUTH_TOKEN"] = tokens[rank]
    try:
        colls.init_process_group("tcp", timeout=4.0)
    except CollsError as exc:
        return {"joined": False, "error": f"{type(exc).__name__}: {exc}"}
    try:
        data = np.full(4, rank + 1.0)
        colls.all_reduce(data)
        objs: list[Any] = [None] * world_size
        colls.all_gather_object(objs, {"rank": rank})
        return {"joined": True, "sum": float(data[0]), "objs": [o["rank"] for o in objs]}
    finally:
        colls.destroy_process_group()
