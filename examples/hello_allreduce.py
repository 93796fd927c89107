"""Hello, colls: every rank contributes its rank number; everyone gets the sum.

Run with:  colls-run --nproc-per-node 4 examples/hello_allreduce.py
"""

import sys

import numpy as np

import colls


def main() -> None:
    colls.init_process_group("tcp")  # env:// rendezvous: colls-run sets RANK, WORLD_SIZE, ...
    rank, size = colls.get_rank(), colls.get_world_size()

    data = np.full(4, rank, dtype=np.float32)
    colls.all_reduce(data)  # in place, like torch.distributed.all_reduce

    expected = sum(range(size))
    assert np.all(data == expected), f"rank {rank}: got {data}, expected {expected}"
    # One write per line, so that lines of different ranks sharing a terminal never interleave.
    line = f"rank {rank}/{size}: all_reduce -> {data.tolist()} (expected {float(expected)})"
    sys.stdout.write(line + "\n")
    colls.destroy_process_group()


if __name__ == "__main__":
    main()
