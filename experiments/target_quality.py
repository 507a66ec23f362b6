"""Measure a target's quality and write its model card: ``python -m experiments.target_quality [write_card=true]``.

Settings: ``conf/target_quality.yaml``; the work: :func:`experiments.pipeline.target_quality.measure_quality`.
"""

from __future__ import annotations

import hydra
from omegaconf import DictConfig, OmegaConf

import experiments  # noqa: F401  (registers the ${asset:...} resolver)
from experiments.pipeline.run_folder import job
from experiments.pipeline.target_quality import measure_quality


@hydra.main(version_base="1.3", config_path="../conf", config_name="target_quality")
def main(cfg: DictConfig) -> None:
    OmegaConf.resolve(cfg)
    with job():
        measure_quality(cfg)


if __name__ == "__main__":
    main()
