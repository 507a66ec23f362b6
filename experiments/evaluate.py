"""Evaluate a drafter: ``python -m experiments.evaluate drafter.path=<dir> [suite=all] [drafter=prompt_lookup] [...]``.

Settings: ``conf/evaluate.yaml`` (decoding settings: ``conf/decoding/``); the work:
:func:`experiments.pipeline.evaluation.run_evaluation`, which writes ``<run dir>/results.json``.
"""

from __future__ import annotations

import os

import hydra
from omegaconf import DictConfig

import experiments  # noqa: F401  (registers the ${asset:...} resolver)
from experiments.pipeline.evaluation import run_evaluation
from experiments.pipeline.run_folder import job


@hydra.main(version_base="1.3", config_path="../conf", config_name="evaluate")
def main(cfg: DictConfig) -> None:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    with job():
        run_evaluation(cfg)


if __name__ == "__main__":
    main()
