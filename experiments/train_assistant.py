"""Train the ``ar_assistant`` baseline: ``python -m experiments.train_assistant [data=regen_greedy] [...]``.

A small causal LM with the target's vocabulary, trained on the response tokens of the drafters'
regenerated data and exported in Hugging Face format with the target's tokenizer and a model card
(see :mod:`experiments.pipeline.assistant`; settings in ``conf/train_assistant.yaml``). The run dir is
fixed per target, so the same command resumes from ``checkpoints/last.ckpt`` (refused, naming them, where the
model, data or optimiser settings differ from its ``run_settings.json``). Evaluate the result with
``python -m experiments.evaluate drafter=ar_assistant drafter.path=<export dir>``.
"""

from __future__ import annotations

import os

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

import experiments  # noqa: F401  (registers the ${asset:...}, ${settings_hash:...} and ${target_id:...} resolvers)
from experiments.pipeline.assistant import train_assistant
from experiments.pipeline.run_folder import job


@hydra.main(version_base="1.3", config_path="../conf", config_name="train_assistant")
def main(cfg: DictConfig) -> None:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    with job():
        train_assistant(cfg, list(HydraConfig.get().overrides.task))


if __name__ == "__main__":
    main()
