"""The main job: ``python -m experiments.main`` (the README's first command).

Regenerates the data, trains one drafter per loss in ``losses``, evaluates each and the baselines,
and writes the report; every stage runs as its own entry point (settings: ``conf/main.yaml``; the
work: :func:`experiments.pipeline.main_job.run_main_job`).
"""

from __future__ import annotations

import hydra
from omegaconf import DictConfig

from experiments.pipeline.main_job import run_main_job
from experiments.pipeline.run_folder import job


@hydra.main(version_base="1.3", config_path="../conf", config_name="main")
def main(cfg: DictConfig) -> None:
    with job():
        run_main_job(cfg)


if __name__ == "__main__":
    main()
