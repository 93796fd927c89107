"""1-D heat equation, domain split across ranks, halos exchanged with send/recv.

Solves u_t = alpha * u_xx on [0, 1] with u = 0 at both ends, explicit Euler, and checks the
distributed answer against a serial run of the same scheme on rank 0.

Run with:  colls-run --nproc-per-node 4 examples/heat_equation.py
"""

import numpy as np

import colls

POINTS = 1000  # interior grid points (split across ranks)
STEPS = 2000
ALPHA = 1.0


def initial(x: np.ndarray) -> np.ndarray:
    return np.sin(np.pi * x) + 0.5 * np.sin(3 * np.pi * x)


def step(u: np.ndarray, left: float, right: float, r: float) -> np.ndarray:
    padded = np.concatenate(([left], u, [right]))
    return u + r * (padded[2:] - 2 * u + padded[:-2])


def serial(x: np.ndarray, r: float) -> np.ndarray:
    u = initial(x)
    for _ in range(STEPS):
        u = step(u, 0.0, 0.0, r)
    return u


def main() -> None:
    colls.init_process_group("tcp")
    rank, size = colls.get_rank(), colls.get_world_size()
    dx = 1.0 / (POINTS + 1)
    r = ALPHA * (0.4 * dx * dx) / (dx * dx)  # dt = 0.4 dx^2 / alpha: stable
    x = np.linspace(dx, 1 - dx, POINTS)
    counts = [POINTS // size + (i < POINTS % size) for i in range(size)]
    start = sum(counts[:rank])
    u = initial(x[start : start + counts[rank]])

    halo_left, halo_right = np.zeros(1), np.zeros(1)
    for _ in range(STEPS):
        works = []
        if rank > 0:
            works += [colls.isend(u[:1].copy(), dst=rank - 1), colls.irecv(halo_left, src=rank - 1)]
        if rank < size - 1:
            works += [colls.isend(u[-1:].copy(), dst=rank + 1),
                      colls.irecv(halo_right, src=rank + 1)]
        for w in works:
            w.wait()
        u = step(u, halo_left[0] if rank > 0 else 0.0, halo_right[0] if rank < size - 1 else 0.0, r)

    gathered = [None] * size
    colls.all_gather_object(gathered, u)
    if rank == 0:
        full = np.concatenate(gathered)
        error = np.max(np.abs(full - serial(x, r)))
        print(f"heat equation on {size} ranks: max |distributed - serial| = {error:.3e}")
        assert error < 1e-12, error
    colls.destroy_process_group()


if __name__ == "__main__":
    main()
