"""DDP's step time: colls through the drop-in face against torch's gloo, in one run.

A communication-heavy model (an MLP of about 33.6M float32 parameters, 134 MB of gradients per
step) with a small batch, one thread per process, trained with ``DistributedDataParallel(model)``
under torchrun. Three configurations per process count, run one after the other:

* ``gloo``: ``import torch.distributed as dist; dist.init_process_group("gloo")``;
* ``colls``: ``import colls_torch as dist; dist.init_process_group("gloo")`` (the drop-in face:
  torch's default group is colls' world, so DDP's all_reduces run over colls' tcp);
* ``alone``: the same forward, backward and optimizer step without DDP, every process computing
  at once: the floor a step with communication is compared against;
* ``nocomm``: DDP over colls with a communication hook that returns each gradient bucket as it
  is: DDP's own work (copying gradients into its buckets and back) without any communication,
  the floor of any backend under ``DistributedDataParallel(model)``.

Each configuration reports the median step time over ``--steps`` steps after ``--warmup``, and
the CPU time rank 0's process used per step (every thread: on a host where the processes fill
every core, CPU time is what a step costs, and it is less disturbed by other load than the wall
clock); the table gives the ratios (gloo / colls: how many times faster colls is; colls / alone:
what DDP and communication add; colls / nocomm: what communication adds to DDP's own work).

    python benchmarks/bench_ddp.py                      # 2 and 4 processes
    python benchmarks/bench_ddp.py --nproc 2 --steps 10
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

#: Hidden width and depth of the MLP: 4 layers of 2896 x 2896 (+ bias) = 33.6M parameters.
WIDTH, LAYERS, BATCH = 2896, 4, 4
CONFIGS = ("gloo", "colls", "alone", "nocomm")


def model():  # noqa: ANN201 - torch is imported only in the workers
    import torch

    torch.manual_seed(0)
    layers = []
    for _ in range(LAYERS):
        layers += [torch.nn.Linear(WIDTH, WIDTH), torch.nn.ReLU()]
    return torch.nn.Sequential(*layers[:-1])


def _no_communication(state: object, bucket):  # noqa: ANN001, ANN202 - a DDP comm hook
    """DDP's communication hook that communicates nothing: the bucket, as it is, at once."""
    import torch

    future = torch.futures.Future()
    future.set_result(bucket.buffer())
    return future


def worker(config: str, steps: int, warmup: int, out: str) -> None:
    """One rank: train ``warmup + steps`` steps; rank 0 writes the step times to ``out``."""
    import torch

    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    net = model()
    if config != "alone":
        dist = importlib.import_module("torch.distributed" if config == "gloo" else "colls_torch")
        dist.init_process_group("gloo")
        net = torch.nn.parallel.DistributedDataParallel(net)
    if config == "nocomm":
        net.register_comm_hook(None, _no_communication)
    opt = torch.optim.SGD(net.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(rank)
    x, y = torch.randn(BATCH, WIDTH, generator=gen), torch.randn(BATCH, WIDTH, generator=gen)
    times, cpu = [], []
    for step in range(warmup + steps):
        start, start_cpu = time.perf_counter(), time.process_time()
        loss = torch.nn.functional.mse_loss(net(x), y)
        opt.zero_grad(set_to_none=False)
        loss.backward()
        opt.step()
        if step >= warmup:
            times.append(time.perf_counter() - start)
            cpu.append(time.process_time() - start_cpu)
    if config != "alone":
        dist.destroy_process_group()
    if rank == 0:
        Path(out).write_text(json.dumps({"wall": times, "cpu": cpu}))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run(config: str, nproc: int, steps: int, warmup: int) -> tuple[float, float]:
    """Return the median step time and CPU time (seconds) of ``config`` on ``nproc`` processes."""
    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "times.json")
        command = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}",
                   "--master-addr=127.0.0.1", f"--master-port={free_port()}", __file__,
                   "--worker", config, "--steps", str(steps), "--warmup", str(warmup),
                   "--out", out]
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        subprocess.run(command, check=True, env=env, timeout=900, capture_output=True)
        figures = json.loads(Path(out).read_text())
        return statistics.median(figures["wall"]), statistics.median(figures["cpu"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--nproc", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--worker", choices=CONFIGS, help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--json", help="also write the figures to this file")
    args = parser.parse_args()
    if args.worker:
        worker(args.worker, args.steps, args.warmup, args.out)
        return
    params = LAYERS * (WIDTH * WIDTH + WIDTH)
    print(f"DDP step, MLP of {params / 1e6:.1f}M float32 parameters, batch {BATCH}, "
          f"1 thread per process; median of {args.steps} steps after {args.warmup}")
    print(f"{'procs':>5} {'':>6} {'gloo ms':>9} {'colls ms':>9} {'alone ms':>9} "
          f"{'nocomm ms':>10} {'gloo/colls':>11} {'colls/alone':>12} {'colls/nocomm':>13}")
    figures = []
    for nproc in args.nproc:
        measured = {config: run(config, nproc, args.steps, args.warmup) for config in CONFIGS}
        for index, kind in enumerate(("wall", "cpu")):
            ms = {config: 1e3 * measured[config][index] for config in CONFIGS}
            figures.append({"nproc": nproc, "kind": kind, **ms})
            print(f"{nproc:>5} {kind:>6} {ms['gloo']:>9.1f} {ms['colls']:>9.1f} "
                  f"{ms['alone']:>9.1f} {ms['nocomm']:>10.1f} {ms['gloo'] / ms['colls']:>10.2f}x "
                  f"{ms['colls'] / ms['alone']:>11.2f}x {ms['colls'] / ms['nocomm']:>12.2f}x",
                  flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=1))


if __name__ == "__main__":
    main()
