"""Time several drafters at T=0 against one timing of the target alone, in one process:
``python -m experiments.speed target=<t> +drafter@drafters.<name>=<choice> drafters.<name>.<key>=... [...]``
(one ``+drafter@drafters.<name>`` per drafter; ``<choice>``: block, prompt_lookup, ar_assistant of ``conf/eval/drafter/``).

Settings: ``conf/evaluate.yaml`` (its ``drafter`` is not used; batch 1 for speeds: ``batch_size=1``); the work:
:func:`experiments.pipeline.speed.run_speed`, which writes ``<run dir>/<name>/results.json`` per drafter.
"""

from __future__ import annotations

import os

import hydra
from omegaconf import DictConfig

import experiments  # noqa: F401  (registers the ${asset:...} resolver)
from experiments.pipeline.run_folder import job
from experiments.pipeline.speed import run_speed


@hydra.main(version_base="1.3", config_path="../conf", config_name="evaluate")
def main(cfg: DictConfig) -> None:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    with job():
        run_speed(cfg)


if __name__ == "__main__":
    main()
