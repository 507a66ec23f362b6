"""Train the embedded tiny target LM: ``python -m experiments.train_target target=tiny [export_dir=...]``.

Settings: ``conf/train_target.yaml`` (the recipe: ``conf/target/tiny.yaml``); the work:
:func:`experiments.pipeline.target_training.train_target` (resumable; exports in Hugging Face format).
"""

from __future__ import annotations

import os

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

import experiments  # noqa: F401  (registers the ${asset:...} resolver)
from experiments.pipeline.run_folder import job
from experiments.pipeline.target_training import train_target


@hydra.main(version_base="1.3", config_path="../conf", config_name="train_target")
def main(cfg: DictConfig) -> None:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    with job():
        train_target(cfg, list(HydraConfig.get().overrides.task))


if __name__ == "__main__":
    main()
