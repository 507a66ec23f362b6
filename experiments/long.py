"""The long job: ``python -m experiments.long`` (issue 50's data, curves and long-trained drafters; hours, resumable).

Settings: ``conf/long.yaml``; the work: :class:`experiments.jobs.long_job.LongJob`.
"""

from __future__ import annotations

import hydra
from omegaconf import DictConfig

from experiments.jobs.long_job import run_long_job
from experiments.pipeline.run_folder import job


@hydra.main(version_base="1.3", config_path="../conf", config_name="long")
def main(cfg: DictConfig) -> None:
    with job():
        run_long_job(cfg)


if __name__ == "__main__":
    main()
