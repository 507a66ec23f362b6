"""Export a trained drafter for serving: ``python -m experiments.export drafter.path=<dir> out=<dir> [dtype=bfloat16]``.

Settings: ``conf/export.yaml``; the work: :func:`experiments.pipeline.export.export_for_serving` (DFlash
format plus a model card).
"""

from __future__ import annotations

import os

import hydra
from omegaconf import DictConfig

import experiments  # noqa: F401  (registers the ${asset:...} resolver used by run configs)
from experiments.pipeline.export import export_for_serving
from experiments.pipeline.run_folder import job


@hydra.main(version_base="1.3", config_path="../conf", config_name="export")
def main(cfg: DictConfig) -> None:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    with job():
        export_for_serving(cfg)


if __name__ == "__main__":
    main()
