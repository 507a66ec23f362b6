"""The main job: ``python -m experiments.main`` (the README's first command).

Installs the recorded answers, trains the short-budget drafters (one per loss in ``losses``), evaluates them beside
the long-trained drafters shipped in ``experiments/assets`` and the baselines, and writes the report; every stage
runs as its own entry point (settings: ``conf/main_sharegpt.yaml`` over ``conf/main.yaml``; ``--config-name main``
runs the earlier job on 738 answers without the shipped drafters; the work:
:func:`experiments.jobs.main_job.run_main_job`).
"""

from __future__ import annotations

import hydra
from omegaconf import DictConfig

from experiments.jobs.main_job import run_main_job
from experiments.pipeline.run_folder import job


@hydra.main(version_base="1.3", config_path="../conf", config_name="main_sharegpt")
def main(cfg: DictConfig) -> None:
    with job():
        run_main_job(cfg)


if __name__ == "__main__":
    main()
