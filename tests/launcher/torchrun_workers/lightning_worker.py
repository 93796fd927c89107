"""A torchrun worker: Lightning's DDPStrategy with the backend named by configuration only.

Usage: ``lightning_worker.py BACKEND OUT_DIR``. The script never imports colls: with BACKEND
``colls``, Lightning's ``init_process_group("colls")`` finds the backend through torch's
``torch.backends`` entry point (colls_torch_autoload). Three optimizer steps of a small model on
each rank's shard; each rank writes OUT_DIR/BACKEND.rank<R>.json with its parameters, the backend
torch reports, and how many calls torch's default group ran through colls.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import lightning as L
import torch
import torch.distributed as T
from lightning.pytorch.strategies import DDPStrategy
from torch.utils.data import DataLoader, TensorDataset


class Regression(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(),
                                       torch.nn.Linear(32, 4))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], _index: int) -> torch.Tensor:
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def main() -> None:
    backend, out = sys.argv[1], Path(sys.argv[2])
    gen = torch.Generator().manual_seed(7)
    data = TensorDataset(torch.randn(48, 16, generator=gen), torch.randn(48, 4, generator=gen))
    model = Regression()
    trainer = L.Trainer(accelerator="cpu", devices=2, max_steps=3, logger=False,
                        strategy=DDPStrategy(process_group_backend=backend),
                        enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False)
    trainer.fit(model, DataLoader(data, batch_size=8))
    world = T.group.WORLD
    report = {
        "rank": T.get_rank(), "backend": T.get_backend(),
        "params": torch.cat([p.detach().flatten() for p in model.parameters()]).tolist(),
        "calls": getattr(world, "calls_run", None),
    }
    (out / f"{backend}.rank{T.get_rank()}.json").write_text(json.dumps(report))
    T.destroy_process_group()


if __name__ == "__main__":
    main()
