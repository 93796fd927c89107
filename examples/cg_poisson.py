"""Conjugate gradient on the 2-D Poisson equation, grid rows split across ranks.

Solves -laplace(u) = f on the unit square with u = 0 on the boundary, discretised with the
5-point stencil on an n x n interior grid (matrix-free: the matrix is never stored). Each rank
owns a block of consecutive rows (the split may be uneven). Every CG iteration exchanges the
boundary rows with the neighbouring ranks (the halo) and does two dot products, each one
all_reduce of a single float64: the communication pattern of most iterative solvers.

Rank 0 then solves the same system on one process and checks that the distributed run took the
same iterations (residual history) to the same answer.

Run with:  colls-run --nproc-per-node 4 examples/cg_poisson.py [--grid 256] [--tol 1e-8]

The numerical kernel (``cg``, ``laplacian``) only calls ``comm.halo_exchange`` and
``comm.allsum``; ``benchmarks/bench_cg.py`` runs it through mpi4py and torch.distributed too.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import numpy as np

import colls


def row_split(n: int, size: int) -> list[int]:
    """First row of each rank's block, and n at the end: rank r owns rows starts[r]:starts[r+1]."""
    counts = [n // size + (r < n % size) for r in range(size)]
    return [sum(counts[:r]) for r in range(size + 1)]


def right_hand_side(n: int, rows: slice) -> np.ndarray:
    """h^2 f on grid rows ``rows``, f = (1 + x) exp(y): smooth, but no symmetry to hide a bug."""
    h = 1.0 / (n + 1)
    y = h * np.arange(rows.start + 1, rows.stop + 1)[:, None]
    x = h * np.arange(1, n + 1)[None, :]
    return h * h * (1 + x) * np.exp(y)


def laplacian(p: np.ndarray, out: np.ndarray) -> None:
    """out = A p for the 5-point stencil (times h^2); p has one halo row above and below."""
    c = p[1:-1]
    np.multiply(c, 4.0, out=out)
    out -= p[:-2]
    out -= p[2:]
    out[:, 1:] -= c[:, :-1]  # left and right neighbours; outside the grid is the boundary, 0
    out[:, :-1] -= c[:, 1:]


def halo_neighbours(rank: int, size: int) -> list[tuple[int, int, int]]:
    """(peer, row to send, halo row to receive into) of a padded block, for each neighbour."""
    return [(peer, send, recv) for peer, send, recv in ((rank - 1, 1, 0), (rank + 1, -2, -1))
            if 0 <= peer < size]


def cg(comm, b: np.ndarray, tol: float, max_iters: int,
       callback: Callable[[int], None] | None = None) -> tuple[np.ndarray, list[float]]:
    """Solve A x = b by conjugate gradient, from x = 0.

    Args:
        comm: ``halo_exchange(p)`` fills the halo rows of the padded array ``p`` from the
            neighbours; ``allsum(v)`` returns the sum of the float ``v`` over the ranks.
        b: this rank's rows of the right-hand side.
        tol: stop when |r| <= tol |b|.
        max_iters: stop after this many iterations at the latest.
        callback: called with the iteration number after each iteration.

    Returns:
        This rank's rows of x, and |r| / |b| before each iteration and after the last.
    """
    x = np.zeros_like(b)
    r = b.copy()
    p = np.zeros((b.shape[0] + 2, b.shape[1]))  # the search direction, with halo rows
    p[1:-1] = r
    q = np.empty_like(b)
    rr = comm.allsum(np.vdot(r, r))
    b_norm = np.sqrt(rr)
    history = [1.0]
    for k in range(max_iters):
        if np.sqrt(rr) <= tol * b_norm:
            break
        comm.halo_exchange(p)
        laplacian(p, q)
        alpha = rr / comm.allsum(np.vdot(p[1:-1], q))
        x += alpha * p[1:-1]
        r -= alpha * q
        rr, rr_old = comm.allsum(np.vdot(r, r)), rr
        p[1:-1] *= rr / rr_old
        p[1:-1] += r
        history.append(np.sqrt(rr) / b_norm)
        if callback is not None:
            callback(k)
    return x, history


class CollsComm:
    """What ``cg`` needs from the other ranks, through colls."""

    def __init__(self) -> None:
        self.rank, self.size = colls.get_rank(), colls.get_world_size()
        self.neighbours = halo_neighbours(self.rank, self.size)
        self.value = np.zeros(1)

    def halo_exchange(self, p: np.ndarray) -> None:
        # Every send starts before any receive waits, so no rank waits for one that waits too.
        sends = [colls.isend(p[send], peer) for peer, send, _ in self.neighbours]
        for peer, _, recv in self.neighbours:
            colls.recv(p[recv], peer)
        for work in sends:
            work.wait()

    def allsum(self, value: float) -> float:
        self.value[0] = value
        colls.all_reduce(self.value)
        return float(self.value[0])


class SerialComm:
    """One process owns the whole grid: no halo to fill (it stays 0, the boundary), no sum."""

    def halo_exchange(self, p: np.ndarray) -> None:
        pass

    def allsum(self, value: float) -> float:
        return float(value)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--grid", type=int, default=256, help="interior points per side")
    parser.add_argument("--tol", type=float, default=1e-8, help="relative residual to reach")
    args = parser.parse_args()

    colls.init_process_group("tcp")
    comm = CollsComm()
    if args.grid < comm.size:
        parser.error(f"--grid {args.grid}: need at least one grid row per rank ({comm.size})")
    starts = row_split(args.grid, comm.size)
    rows = slice(starts[comm.rank], starts[comm.rank + 1])
    x, history = cg(comm, right_hand_side(args.grid, rows), args.tol, max_iters=10 * args.grid)

    blocks = [None] * comm.size if comm.rank == 0 else None
    colls.gather_object(x, blocks, dst=0)
    if comm.rank == 0:
        b = right_hand_side(args.grid, slice(0, args.grid))
        x_serial, history_serial = cg(SerialComm(), b, args.tol, max_iters=10 * args.grid)
        x_all = np.concatenate(blocks)
        error = np.max(np.abs(x_all - x_serial)) / np.max(np.abs(x_serial))
        ax = np.empty_like(b)
        laplacian(np.pad(x_all, ((1, 1), (0, 0))), ax)  # zero halo rows: the boundary
        residual = np.linalg.norm(b - ax) / np.linalg.norm(b)
        drift = np.max(np.abs(np.log(history[: len(history_serial)])
                              - np.log(history_serial[: len(history)])))
        print(f"cg on {comm.size} ranks, {args.grid}x{args.grid} grid: {len(history) - 1} "
              f"iterations (serial: {len(history_serial) - 1}), |b - Ax|/|b| = {residual:.2e}, "
              f"max |distributed - serial| / max |serial| = {error:.1e}, "
              f"residual history within {drift:.1e} (log)", flush=True)
        assert abs(len(history) - len(history_serial)) <= 1, "iteration counts differ"
        assert drift < 1e-6 and error < 1e-9 and residual < 10 * args.tol, (drift, error, residual)
    colls.destroy_process_group()


if __name__ == "__main__":
    main()
