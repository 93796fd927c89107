"""The scenario that matters: data-parallel SGD at 4 ranks under colls-run --on-failure, where
ranks are SIGKILLed mid-all_reduce (and inside shrink_group itself); the survivors shrink and go
on, replacements grow the group back, and the final parameters equal, bit for bit, a
single-process reference run with the membership schedule the job printed.
"""

from __future__ import annotations

import hashlib
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).parent
WORKER = HERE / "sgd_worker.py"
sys.path.insert(0, str(HERE))
import sgd_worker  # noqa: E402

FINAL = re.compile(r"final slot=(\d+) rank=(\d+) schedule=([\d,]+) sha=([0-9a-f]+)")


def run_job(policy: str, steps: int, **env: str) -> tuple[subprocess.CompletedProcess[str],
                                                          list[tuple[int, int, list[int], str]]]:
    """Run the SGD job on 4 ranks; return the result and each final line's fields."""
    environment = {**os.environ, "SURVIVE_STEPS": str(steps), **env}
    result = subprocess.run(
        [sys.executable, "-m", "colls.run", "--nproc-per-node", "4", "--on-failure", policy,
         str(WORKER)],
        env=environment, capture_output=True, text=True, timeout=150,
    )
    finals = [(int(a), int(b), [int(x) for x in c.split(",")], d)
              for a, b, c, d in FINAL.findall(result.stdout)]
    return result, finals


def check_against_reference(finals: list[tuple[int, int, list[int], str]], steps: int,
                            ranks_at_end: int, size: int = sgd_worker.SIZE) -> list[int]:
    """Every final line names the same schedule and digest, the reference's; return it."""
    assert len(finals) == ranks_at_end, finals
    schedules = {tuple(f[2]) for f in finals}
    assert len(schedules) == 1, schedules
    schedule = list(schedules.pop())
    assert len(schedule) == steps
    expected = hashlib.sha256(sgd_worker.reference(schedule, steps, size).tobytes()).hexdigest()
    assert {f[3] for f in finals} == {expected}
    assert sorted(f[1] for f in finals) == list(range(ranks_at_end))
    return schedule


@pytest.mark.timeout(180)
@pytest.mark.parametrize("kill, survivors", [
    ("2:5", [0, 1, 3]),           # a middle rank
    ("0:5", [1, 2, 3]),           # rank 0
    ("1:5,2:5", [0, 3]),          # two at once
])
def test_survivors_shrink_and_go_on(kill: str, survivors: list[int]) -> None:
    result, finals = run_job("shrink", 12, SURVIVE_KILL=kill)
    assert result.returncode == 0, result.stdout + result.stderr
    schedule = check_against_reference(finals, 12, len(survivors))
    assert schedule == [4] * 5 + [len(survivors)] * 7
    assert sorted(f[0] for f in finals) == survivors
    for slot in survivors:
        assert f"slot {slot} saw dead" in result.stdout
        # the shrunk group's ranks still share memory on this host
        assert re.search(rf"slot {slot} now rank \d+ of {len(survivors)} shm=True", result.stdout)


@pytest.mark.timeout(180)
def test_a_rank_killed_in_the_middle_of_a_large_all_reduce() -> None:
    # 8 MiB of parameters: the ring all_reduce is under way when the timer thread kills rank 2.
    # Survivors may disagree on whether that step completed; rank 0's state settles it.
    result, finals = run_job("shrink", 8, SURVIVE_KILL="2:3", SURVIVE_SIZE=str(1 << 20),
                             SURVIVE_KILL_AFTER_S="0.003")
    assert result.returncode == 0, result.stdout + result.stderr
    schedule = check_against_reference(finals, 8, 3, size=1 << 20)
    assert schedule[:3] == [4] * 3 and schedule[-1] == 3
    assert sorted(f[0] for f in finals) == [0, 1, 3]


@pytest.mark.timeout(180)
def test_a_rank_killed_inside_shrink_is_folded_in() -> None:
    result, finals = run_job("shrink", 12, SURVIVE_KILL="2:5", SURVIVE_KILL_IN_SHRINK="1")
    assert result.returncode == 0, result.stdout + result.stderr
    schedule = check_against_reference(finals, 12, 2)
    assert schedule == [4] * 5 + [2] * 7
    assert sorted(f[0] for f in finals) == [0, 3]


@pytest.mark.timeout(180)
def test_a_replacement_joins_and_takes_the_state() -> None:
    result, finals = run_job("replace", 40, SURVIVE_KILL="2:5")
    assert result.returncode == 0, result.stdout + result.stderr
    schedule = check_against_reference(finals, 40, 4)
    # 3 ranks from step 5 until the replacement is in (at once, when it starts fast enough)
    joined_at = len(schedule) - schedule[::-1].index(3) if 3 in schedule else 5
    assert schedule == [4] * 5 + [3] * (joined_at - 5) + [4] * (40 - joined_at)
    assert "joined as rank 3 of 4" in result.stdout
    assert sorted(f[0] for f in finals) == [0, 1, 2, 3]  # slot 2's replacement is rank 3
