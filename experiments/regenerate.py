"""Regenerate drafter training data: ``python -m experiments.regenerate target=tiny [data=regen_greedy] [...]``.

Settings: ``conf/regenerate.yaml`` (how: ``conf/regeneration/``; what: ``conf/data/``); the work:
:func:`experiments.pipeline.regeneration.regenerate`, into ``data.data_dir`` (resumable, shared with
``experiments.train``), named in ``<run dir>/regenerate.json``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import hydra
from omegaconf import DictConfig

import experiments  # noqa: F401  (registers the ${asset:...}, ${settings_hash:...} and ${target_id:...} resolvers)
from experiments.pipeline.regeneration import regenerate
from experiments.pipeline.run_folder import job


@hydra.main(version_base="1.3", config_path="../conf", config_name="regenerate")
def main(cfg: DictConfig) -> None:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    with job():
        data_dir = regenerate(cfg)
        # where the data went, for the jobs that run this one (experiments.long)
        (Path(cfg.paths.run_dir) / "regenerate.json").write_text(json.dumps({"data_dir": str(data_dir)}) + "\n")


if __name__ == "__main__":
    main()
