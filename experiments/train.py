"""Train a block drafter: ``python -m experiments.train [loss=decay] [trainer=ddp_cpu] [experiment=smoke] [...]``.

Settings: ``conf/train.yaml``; the work: :func:`experiments.pipeline.training.train` (regenerates missing
data first, resumes from ``<run dir>/checkpoints/last.ckpt``, evaluates at the end with
``evaluate.enabled=true``).
"""

from __future__ import annotations

import os

import hydra
from omegaconf import DictConfig

import experiments  # noqa: F401  (registers the ${asset:...}, ${settings_hash:...} and ${target_id:...} resolvers)
from experiments.pipeline.run_folder import job
from experiments.pipeline.training import train


@hydra.main(version_base="1.3", config_path="../conf", config_name="train")
def main(cfg: DictConfig) -> None:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    with job():
        train(cfg)


if __name__ == "__main__":
    main()
