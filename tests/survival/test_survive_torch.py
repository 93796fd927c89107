"""The torch face of surviving a dead rank: DDP over ``import colls_torch as dist`` at 4 ranks
under colls-run --on-failure, where rank 2 SIGKILLs itself as step 5's backward starts; the
survivors' DDP all_reduce fails, they shrink (``dist.shrink_group``), rebuild DDP over the new
world (which is torch's default group too) and go on; with replace, the replacement joins
through ``dist.grow_group()``. The final parameters equal, bit for bit, a single-process
reference run with the membership schedule the job printed (ddp_worker.py says why exactly).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch", reason="the torch face of survival needs torch")

HERE = Path(__file__).parent
WORKER = HERE / "ddp_worker.py"
sys.path.insert(0, str(HERE))
import ddp_worker  # noqa: E402

FINAL = re.compile(r"final slot=(\d+) rank=(\d+) schedule=([\d,]+) sha=([0-9a-f]+) "
                   r"colls_calls=(\d+)")
Final = tuple[int, int, list[int], str, int]


def run_job(policy: str, steps: int, **env: str) -> tuple[subprocess.CompletedProcess[str],
                                                          list[Final]]:
    """Run the DDP job on 4 ranks on loopback; return the result and each final line's fields."""
    environment = {**os.environ, "SURVIVE_STEPS": str(steps), "MASTER_ADDR": "127.0.0.1", **env}
    result = subprocess.run(
        [sys.executable, "-m", "colls.run", "--nproc-per-node", "4", "--master-addr",
         "127.0.0.1", "--on-failure", policy, str(WORKER)],
        env=environment, capture_output=True, text=True, timeout=240,
    )
    finals = [(int(a), int(b), [int(x) for x in c.split(",")], d, int(e))
              for a, b, c, d, e in FINAL.findall(result.stdout)]
    return result, finals


def check_against_reference(finals: list[Final], ranks_at_end: int) -> list[int]:
    """Every final line names the same schedule and digest, the reference's; return it."""
    assert len(finals) == ranks_at_end, finals
    schedules = {tuple(f[2]) for f in finals}
    assert len(schedules) == 1, schedules
    schedule = list(schedules.pop())
    expected = ddp_worker.digest(ddp_worker.reference(schedule, len(schedule)))
    assert {f[3] for f in finals} == {expected}
    assert sorted(f[1] for f in finals) == list(range(ranks_at_end))
    assert all(f[4] > 0 for f in finals)  # DDP's traffic in the last world went through colls
    return schedule


def survivors_said(stdout: str, slots: list[int], size: int) -> None:
    """Each survivor saw the failure in DDP's backward, and torch agrees on the new world."""
    for slot in slots:
        assert re.search(rf"slot {slot} saw RuntimeError at step 5: .*PeerFailedError", stdout)
        rank = slots.index(slot)
        assert (f"slot {slot} now rank {rank} of {size}; torch says {rank} of {size}"
                in stdout), stdout


@pytest.mark.timeout(300)
def test_ddp_survivors_shrink_and_go_on() -> None:
    result, finals = run_job("shrink", 12, SURVIVE_KILL="2:5")
    assert result.returncode == 0, result.stdout + result.stderr
    schedule = check_against_reference(finals, 3)
    assert schedule == [4] * 5 + [3] * 7
    assert sorted(f[0] for f in finals) == [0, 1, 3]
    survivors_said(result.stdout, [0, 1, 3], 3)


@pytest.mark.timeout(300)
def test_ddp_survivors_shrink_by_the_failed_ranks_of_the_error() -> None:
    # The exact dead list, from `except torch.distributed.DistBackendError as e: e.failed_ranks`
    result, finals = run_job("shrink", 9, SURVIVE_KILL="2:5", SURVIVE_EXPLICIT="1")
    assert result.returncode == 0, result.stdout + result.stderr
    assert check_against_reference(finals, 3) == [4] * 5 + [3] * 4
    assert result.stdout.count("PeerFailedError failed_ranks=[2]") == 3, result.stdout
    survivors_said(result.stdout, [0, 1, 3], 3)


@pytest.mark.timeout(300)
def test_ddp_replacement_joins_and_takes_the_state() -> None:
    # The survivors step on at 3 ranks (a step every PACE_S) until the replacement, which
    # imports torch first, is in; then at least 3 steps at 4.
    result, finals = run_job("replace", 12, SURVIVE_KILL="2:5", SURVIVE_MIN_SIZE="4")
    assert result.returncode == 0, result.stdout + result.stderr
    schedule = check_against_reference(finals, 4)
    joined_at = len(schedule) - schedule[::-1].index(3)
    assert schedule == [4] * 5 + [3] * (joined_at - 5) + [4] * (len(schedule) - joined_at)
    assert len(schedule) - joined_at >= 3
    assert f"joined as rank 3 of 4 at step {joined_at}" in result.stdout
    assert sorted(f[0] for f in finals) == [0, 1, 2, 3]  # slot 2's replacement is rank 3
    survivors_said(result.stdout, [0, 1, 3], 3)


def test_peer_failed_is_a_dist_backend_error_with_the_failed_ranks() -> None:
    import colls_torch as dist
    import torch
    import torch.distributed as T
    from colls_torch._work import Work

    import colls

    failed = colls.Work.failed(colls.PeerFailedError("world rank 2 died", frozenset({2, 5})))
    work = Work(failed, [torch.ones(1)])
    for wait in (work.wait, work.get_future().wait):
        with pytest.raises(T.DistBackendError, match="world rank 2 died") as info:
            wait()
        assert isinstance(info.value, dist.PeerFailedError)
        assert info.value.failed_ranks == (2, 5)
        assert isinstance(info.value.__cause__, colls.PeerFailedError)
    assert isinstance(work.exception(), dist.PeerFailedError)


API_SCRIPT = r'''
import os
import sys

import torch
import torch.distributed as T

import colls_torch as dist


def say(text):
    sys.stdout.write(f"rank {RANK}: {text}\n")


def outcome(call):
    try:
        call()
    except Exception as exc:  # noqa: BLE001 - the test reads the type and message
        kinds = ",".join(k.__name__ for k in (TypeError, ValueError, RuntimeError,
                                              NotImplementedError) if isinstance(exc, k))
        return f"{type(exc).__name__}[{kinds}] {str(exc)[:70]}"
    return "no error"


RANK = int(os.environ["RANK"])
if os.environ["INIT_FACE"] == "torch":
    T.init_process_group("colls")  # the same world, entered from torch's side
else:
    dist.init_process_group("gloo")
say(f"grow without joiners keeps the group: {dist.grow_group() is dist.group.WORLD}")
for name, args, kwargs in [
    ("tuple", ((1,),), {}), ("empty", ([],), {}), ("out of range", ([5],), {}),
    ("duplicate", ([1, 1],), {}), ("all", ([0, 1, 2],), {}), ("self", ([RANK],), {}),
    ("flags", ([2],), {"shrink_flags": 7}), ("pg_options", ([2],), {"pg_options": {}}),
]:
    say(f"{name}: {outcome(lambda: dist.shrink_group(*args, **kwargs))}")
say(f"torch's shrink_group: {outcome(lambda: T.shrink_group([2]))}")
sub = dist.new_group([1, 2])
if RANK == 1:  # sub's group rank 1 (world rank 2) is left out; only the survivor calls
    alone = dist.shrink_group([1], group=sub, shrink_flags=dist.SHRINK_ABORT)
    t = torch.ones(1)
    T.all_reduce(t, group=alone)
    say(f"shrunk subgroup: {type(alone).__name__} ranks={T.get_process_group_ranks(alone)} "
        f"sum={t.item()} old in torch={sub in T.distributed_c10d._world.pg_map}")
dist.barrier()
if RANK == 2:  # left out of the world: an excluded rank stops
    os._exit(0)
world = dist.shrink_group([2])
t = torch.full((1,), float(RANK + 1))
T.all_reduce(t)
say(f"shrunk world: {world is T.group.WORLD} torch {T.get_rank()}/{T.get_world_size()} "
    f"colls {dist.get_rank()}/{dist.get_world_size()} sum={t.item()} "
    f"torch groups={len(T.distributed_c10d._world.pg_map)} count={T.get_pg_count()} "
    f"backend={dist.get_backend()}")
dist.destroy_process_group()
'''


@pytest.mark.timeout(200)
@pytest.mark.parametrize("face, backend", [("colls_torch", "gloo"), ("torch", "colls")])
def test_shrink_group_checks_and_one_world(face: str, backend: str, tmp_path: Path) -> None:
    script = tmp_path / "api.py"
    script.write_text(API_SCRIPT)
    result = subprocess.run(
        [sys.executable, "-m", "colls.run", "--nproc-per-node", "3", "--master-addr",
         "127.0.0.1", str(script)],
        env={**os.environ, "MASTER_ADDR": "127.0.0.1", "INIT_FACE": face},
        capture_output=True, text=True, timeout=180,
    )
    out = result.stdout
    assert result.returncode == 0, out + result.stderr
    for rank in range(3):
        said = {line.split(": ", 1)[1].split(":", 1)[0]: line.split(": ", 2)[2]
                for line in out.splitlines() if line.startswith(f"rank {rank}: ")
                and line.count(": ") >= 2}
        assert said["grow without joiners keeps the group"] == "True"
        assert said["tuple"].startswith("TypeError[TypeError] ranks_to_exclude must be a list")
        assert said["empty"].startswith("ValueError[ValueError] ranks_to_exclude cannot be empty")
        assert said["out of range"].startswith("ValueError[ValueError] Rank 5 at index 0 is out")
        assert said["duplicate"].startswith("ValueError[ValueError] Duplicate rank 1")
        assert said["all"].startswith("ValueError[ValueError] Cannot exclude all 3 ranks")
        assert said["self"].startswith(
            f"InvalidRankError[ValueError,RuntimeError] Current rank {rank} is in the exclusion")
        assert said["flags"].startswith("ValueError[ValueError] Invalid shrink_flags value: 7")
        assert said["pg_options"].startswith("NotImplementedError[RuntimeError,NotImplementedError]"
                                             " shrink_group: pg_options must be None")
        # torch's own shrink_group asks the group for a C++ backend, which colls' has not
        assert said["torch's shrink_group"].startswith(
            "RuntimeError[RuntimeError] Cannot access device backend for process group")
    assert "rank 1: shrunk subgroup: ProcessGroupColls ranks=[1] sum=1.0 old in torch=False" in out
    for rank in (0, 1):
        assert (f"rank {rank}: shrunk world: True torch {rank}/2 colls {rank}/2 sum=3.0 "
                f"torch groups=1 count=1 backend={backend}") in out, out
