"""Regenerate drafter training data: ``python -m experiments.regenerate target=tiny [data=regen_greedy] [...]``.

Settings: ``conf/regenerate.yaml`` (how: ``conf/regeneration/``; what: ``conf/data/``); the work:
:func:`experiments.pipeline.regeneration.regenerate`, into ``data.data_dir`` (resumable, shared with
``experiments.train``).
"""

from __future__ import annotations

import os

import hydra
from omegaconf import DictConfig

import experiments  # noqa: F401  (registers the ${asset:...}, ${settings_hash:...} and ${target_id:...} resolvers)
from experiments.pipeline.regeneration import regenerate
from experiments.pipeline.run_folder import job


@hydra.main(version_base="1.3", config_path="../conf", config_name="regenerate")
def main(cfg: DictConfig) -> None:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    with job():
        regenerate(cfg)


if __name__ == "__main__":
    main()
