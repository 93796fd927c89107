"""Ray Train: TorchTrainer with TorchConfig(backend="colls") runs DDP over colls.

Ray Train hands the string to ``torch.distributed.init_process_group`` in each worker. The
``colls`` c10d backend is there without any set-up hook: torch imports colls' ``torch.backends``
entry point (colls_torch_autoload) at ``import torch`` in every process, Ray's workers included.
The gradients after one DDP step equal those of the same run on torch's gloo.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

ray = pytest.importorskip("ray", reason="needs ray (pip install -e '.[ray]')")
pytest.importorskip("torch", reason="needs torch")
import ray_actors  # noqa: E402

try:
    from ray.train import ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer
except ImportError as exc:  # ray without its [train] extra
    pytest.skip(f"needs ray[train] ({exc})", allow_module_level=True)


def train(backend: str, out: Path) -> list[dict[str, Any]]:
    """Run one DDP step on 2 workers over ``backend``; return each rank's report."""
    trainer = TorchTrainer(
        ray_actors.one_ddp_step,
        train_loop_config={"out": str(out / backend)},
        torch_config=TorchConfig(backend=backend),
        # 2 CPUs in the cluster: half of one each, so both start at once beside the controller.
        scaling_config=ScalingConfig(num_workers=2, use_gpu=False,
                                     resources_per_worker={"CPU": 0.5}),
    )
    trainer.fit()
    return [json.loads((out / f"{backend}.{rank}").read_text()) for rank in range(2)]


@pytest.mark.timeout(420)
def test_ddp_over_colls_has_gloos_gradients(ray_cluster: Any, tmp_path: Path) -> None:
    over_colls, over_gloo = train("colls", tmp_path), train("gloo", tmp_path)
    for rank in range(2):
        assert over_colls[rank]["backend"] == "colls" and over_gloo[rank]["backend"] == "gloo"
        assert over_colls[rank]["world"] == over_gloo[rank]["world"] == 2
        assert over_colls[rank]["grads"] == over_gloo[rank]["grads"] == over_gloo[0]["grads"]
