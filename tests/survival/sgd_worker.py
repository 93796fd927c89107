"""Data-parallel NumPy SGD that survives dead ranks: shrink on PeerFailedError, grow every step.

Run by tests/survival/test_survive.py as every rank of a job (and as replacements, with
COLLS_JOIN=1). Gradients are small integers, so their sums are exact in any order and the
final parameters can be compared bit for bit with a single-process reference
(:func:`reference`) fed the membership schedule the job printed.

After a shrink, the survivors take rank 0's state as a joiner does: a rank that died in the
middle of an all_reduce may have left some survivors with its result and others with an error,
so their step counters can differ by one; rank 0's state, schedule included, is the one that
goes on (docs/reliability.md's recipe).

Environment: SURVIVE_STEPS, SURVIVE_SIZE (parameters), SURVIVE_KILL ("slot:step,slot:step": the
first process of each slot SIGKILLs itself as that step's all_reduce starts, or, with
SURVIVE_KILL_AFTER_S, that many seconds into it, from a timer thread), SURVIVE_KILL_IN_SHRINK
(a slot that dies inside its first shrink_group instead).
"""

from __future__ import annotations

import hashlib
import os
import signal
import sys
import threading

import numpy as np

import colls

SIZE = int(os.environ.get("SURVIVE_SIZE", "257"))
LR = 1.0 / 1024


def gradient(w: np.ndarray, rank: int, step: int) -> np.ndarray:
    """Rank ``rank``'s gradient at ``step``: small integers, so every sum is exact."""
    return (np.floor(np.abs(w) * 8) % 5 + rank + step % 3).astype(np.float64)


def reference(schedule: list[int], steps: int, size: int = SIZE) -> np.ndarray:
    """The ``size`` parameters after ``steps`` steps where step s ran on ``schedule[s]`` ranks."""
    w = np.linspace(-1.0, 1.0, size)
    for step in range(steps):
        n = schedule[step]
        total = sum(gradient(w, r, step) for r in range(n))
        w = w - LR * total / n
    return w


def say(text: str) -> None:
    sys.stdout.write(text + "\n")  # one write per line: ranks share the launcher's stdout


def kills() -> dict[int, int]:
    spec = os.environ.get("SURVIVE_KILL", "")
    return {int(a): int(b) for a, b in (p.split(":") for p in spec.split(",") if p)}


def take_state_from_rank_0(w: np.ndarray, step: int, schedule: list[int]
                           ) -> tuple[np.ndarray, int, list[int]]:
    """Every rank of the group calls it: rank 0's parameters, step and schedule win."""
    state = np.array([step], np.int64)
    colls.broadcast(state, src=0)
    colls.broadcast(w, src=0)
    step = int(state[0])
    sched = np.zeros(step, np.int64)
    sched[:min(step, len(schedule))] = schedule[:step]
    colls.broadcast(sched, src=0)
    return w, step, sched.tolist()


def kill_myself(after_s: float) -> None:
    if after_s > 0:
        threading.Timer(after_s, os.kill, (os.getpid(), signal.SIGKILL)).start()
    else:
        os.kill(os.getpid(), signal.SIGKILL)


def main() -> None:
    slot = int(os.environ["RANK"])
    first_life = os.environ.get("COLLS_JOIN", "0") != "1"
    steps = int(os.environ.get("SURVIVE_STEPS", "12"))
    victim_step = kills().get(slot) if first_life else None
    die_in_shrink = first_life and os.environ.get("SURVIVE_KILL_IN_SHRINK") == str(slot)
    colls.init_process_group("tcp")
    kill_after_s = float(os.environ.get("SURVIVE_KILL_AFTER_S", "0"))
    w = np.linspace(-1.0, 1.0, SIZE)
    schedule: list[int] = []
    step = 0
    if not first_life:  # a joiner: take the state from rank 0, as the members send it
        w, step, schedule = take_state_from_rank_0(w, step, schedule)
        say(f"joined as rank {colls.get_rank()} of {colls.get_world_size()} at step {step}")
    generation = colls.group.WORLD.generation  # the world this process has the state of
    while step < steps:
        try:
            if victim_step == step:
                victim_step = None
                kill_myself(kill_after_s)
            grad = gradient(w, colls.get_rank(), step)
            colls.all_reduce(grad)
            w = w - LR * grad / colls.get_world_size()
            schedule.append(colls.get_world_size())
            step += 1
            # At the end of a step, where a joiner's init returns: its loop starts at the top
            # with everyone else's, so every member calls grow_group at the same point.
            grown = colls.grow_group()
            if grown.generation != generation:  # joiners came in: they take rank 0's state
                generation = grown.generation
                w, step, schedule = take_state_from_rank_0(w, step, schedule)
        except colls.PeerFailedError as exc:
            say(f"slot {slot} saw dead {list(exc.failed_ranks)} at step {step}")
            if die_in_shrink:
                os.kill(os.getpid(), signal.SIGKILL)
            generation = colls.shrink_group().generation
            shm = getattr(colls.group.WORLD.backend, "_shm", None) is not None  # tcp's host group
            say(f"slot {slot} now rank {colls.get_rank()} of {colls.get_world_size()} shm={shm}")
            w, step, schedule = take_state_from_rank_0(w, step, schedule)
    digest = hashlib.sha256(w.tobytes()).hexdigest()
    say(f"final slot={slot} rank={colls.get_rank()} schedule={','.join(map(str, schedule))} "
        f"sha={digest}")
    colls.destroy_process_group()


if __name__ == "__main__":
    main()
