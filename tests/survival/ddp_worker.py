"""DDP over ``import colls_torch as dist`` that survives dead ranks: shrink on the failure,
rebuild DDP over the new world, grow at every step.

Run by tests/survival/test_survive_torch.py as every rank of a colls-run job (and as
replacements, with COLLS_JOIN=1). The model is a ``torch.nn.Linear`` in float64 trained with a
hinge loss on integer inputs and ±1 labels, so each rank's gradient is an integer tensor.
DDP averages: it multiplies each rank's gradient by ``1/world_size`` and all-reduces the sum.
The loss is scaled by the world size, so what each rank contributes is its integer gradient
again, exactly (``n*g*fl(1/n)`` rounds back to ``g`` for n = 1..4; for 3, ``3*fl(1/3)`` is
``1 - 2**-54``), and the all_reduce sums integers: exact in any order. With a learning rate
that is a power of two the update ``w - lr*sum`` rounds the same way in :func:`reference`, a
single process fed the membership schedule the job printed, so the final parameters are
compared bit for bit.

A rank killed at step s SIGKILLs itself as that step's backward starts (a hook on the loss):
the survivors' DDP all_reduce then fails, and ``loss.backward()`` raises. The survivors shrink
(``dist.shrink_group(None)``: the ranks they agree are dead; with SURVIVE_EXPLICIT=1 the group
ranks named by the ``failed_ranks`` of the ``DistBackendError`` a barrier raises), take rank 0's
state (DDP's constructor broadcasts rank 0's parameters; step and schedule are broadcast), and
go on. A joiner starts with COLLS_JOIN=1: ``init_process_group`` waits until the members'
``dist.grow_group()`` lets it in, then both build DDP and take rank 0's state.

Environment: SURVIVE_STEPS (at least that many steps, and 3 after the last change of the
world), SURVIVE_KILL ("slot:step,..."), SURVIVE_EXPLICIT, SURVIVE_MIN_SIZE (go on, a step every
PACE_S, until the world is back to that size: a replacement imports torch for seconds, and the
members must still be there to let it in).
"""

from __future__ import annotations

import hashlib
import os
import signal
import sys
import time

import colls_torch as dist
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

IN, OUT, BATCH = 8, 4, 6
LR = 1.0 / 64
#: Seconds a step takes at least while the world is smaller than SURVIVE_MIN_SIZE.
PACE_S = 0.05


def say(text: str) -> None:
    sys.stdout.write(text + "\n")  # one write per line: ranks share the launcher's stdout


def new_model() -> torch.nn.Linear:
    torch.manual_seed(0)
    return torch.nn.Linear(IN, OUT, dtype=torch.float64)


def batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s inputs (small integers) and ±1 labels at ``step``."""
    gen = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randint(-3, 4, (BATCH, IN), generator=gen).to(torch.float64)
    y = torch.randint(0, 2, (BATCH, OUT), generator=gen).to(torch.float64) * 2 - 1
    return x, y


def hinge(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Its gradient is a sum of ±x rows: integers."""
    return torch.clamp(1 - y * out, min=0).sum()


def reference(schedule: list[int], steps: int) -> torch.nn.Linear:
    """The model after ``steps`` steps where step s ran on ``schedule[s]`` ranks."""
    model = new_model()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    for step in range(steps):
        totals = [torch.zeros_like(p) for p in model.parameters()]
        for rank in range(schedule[step]):
            model.zero_grad()
            hinge(model(batch(rank, step)[0]), batch(rank, step)[1]).backward()
            for total, p in zip(totals, model.parameters(), strict=True):
                total += p.grad
        for total, p in zip(totals, model.parameters(), strict=True):
            p.grad = total
        opt.step()
    return model


def digest(model: torch.nn.Module) -> str:
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().numpy().tobytes())
    return h.hexdigest()


def kills() -> dict[int, int]:
    spec = os.environ.get("SURVIVE_KILL", "")
    return {int(a): int(b) for a, b in (p.split(":") for p in spec.split(",") if p)}


def rebuild(model: torch.nn.Linear) -> tuple[torch.nn.Linear, DDP, torch.optim.SGD]:
    """A fresh model with ``model``'s weights, in a DDP over the current world.

    Fresh, so that no hook of the old DDP (over the old world) stays on the parameters; DDP's
    constructor broadcasts rank 0's parameters, so every rank starts from rank 0's.
    """
    fresh = new_model()
    fresh.load_state_dict(model.state_dict())
    return fresh, DDP(fresh), torch.optim.SGD(fresh.parameters(), lr=LR)


def take_state_from_rank_0(step: int, schedule: list[int]) -> tuple[int, list[int]]:
    """Every rank of the world calls it: rank 0's step and schedule win."""
    state = torch.tensor([step], dtype=torch.int64)
    dist.broadcast(state, src=0)
    step = int(state[0])
    sched = torch.zeros(step, dtype=torch.int64)
    sched[:min(step, len(schedule))] = torch.tensor(schedule[:step], dtype=torch.int64)
    dist.broadcast(sched, src=0)
    return step, sched.tolist()


def dead_group_ranks() -> list[int]:
    """The ranks of the broken world this rank knows dead, from torch's error family."""
    try:
        dist.barrier()
    except dist.DistBackendError as exc:  # colls' PeerFailedError: the dead, as world ranks
        say(f"{type(exc).__name__} failed_ranks={list(exc.failed_ranks)}")
        return list(exc.failed_ranks)  # the world is the group: world ranks are group ranks
    raise AssertionError("the barrier of a broken world succeeded")


def main() -> None:
    slot = int(os.environ["RANK"])
    first_life = os.environ.get("COLLS_JOIN", "0") != "1"
    steps = int(os.environ.get("SURVIVE_STEPS", "12"))
    explicit = os.environ.get("SURVIVE_EXPLICIT") == "1"
    min_size = int(os.environ.get("SURVIVE_MIN_SIZE", "0"))
    victim_step = kills().get(slot) if first_life else None
    dist.init_process_group("gloo")
    model, ddp, opt = rebuild(new_model())
    step, schedule = 0, []
    if not first_life:  # a joiner: the members send rank 0's state as they rebuild
        step, schedule = take_state_from_rank_0(step, schedule)
        say(f"joined as rank {dist.get_rank()} of {dist.get_world_size()} at step {step}")
    world = dist.group.WORLD
    just_joined = not first_life  # a joiner starts where the members' grow_group left them
    changed_at = step  # the step at which the world last changed: 3 more are run after it
    while True:
        try:
            if not just_joined and dist.grow_group() is not world:
                world = dist.group.WORLD  # joiners came in: rebuild, take rank 0's state
                model, ddp, opt = rebuild(model)
                step, schedule = take_state_from_rank_0(step, schedule)
                changed_at = step
            just_joined = False
            n = dist.get_world_size()
            if step >= max(steps, changed_at + 3) and n >= min_size:
                break
            if n < min_size:
                time.sleep(PACE_S)
            x, y = batch(dist.get_rank(), step)
            loss = n * hinge(ddp(x), y)
            if victim_step == step:
                loss.register_hook(lambda _g: os.kill(os.getpid(), signal.SIGKILL))
            opt.zero_grad()
            loss.backward()
            opt.step()
            schedule.append(n)
            step += 1
        except RuntimeError as exc:  # DDP's backward rethrows the DistBackendError's message
            say(f"slot {slot} saw {type(exc).__name__} at step {step}: {str(exc)[:160]!r}")
            world = dist.shrink_group(dead_group_ranks() if explicit else None)
            assert world is dist.group.WORLD is torch.distributed.group.WORLD
            say(f"slot {slot} now rank {dist.get_rank()} of {dist.get_world_size()}; torch says "
                f"{torch.distributed.get_rank()} of {torch.distributed.get_world_size()}")
            model, ddp, opt = rebuild(model)
            step, schedule = take_state_from_rank_0(step, schedule)
            changed_at = step
    say(f"final slot={slot} rank={dist.get_rank()} schedule={','.join(map(str, schedule))} "
        f"sha={digest(model)} colls_calls={world.calls_run}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
