"""Serve a drafter in vLLM and check its acceptance: ``python -m experiments.serve_check drafter.path=<dir>``.

Settings: ``conf/serve_check.yaml``; the work: :func:`experiments.serving.check.run_serve_check`. A failure
names its step (environment, drafter, export, engine start, decoding, metrics) and exits with code 2.
"""

from __future__ import annotations

import os
import signal
import sys

import hydra
from omegaconf import DictConfig

import experiments  # noqa: F401  (registers the ${asset:...} resolver used by target configs)
from experiments.serving.engine import ServingError


@hydra.main(version_base="1.3", config_path="../conf", config_name="serve_check")
def main(cfg: DictConfig) -> None:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    # SIGTERM (a scheduler's stop, `kill`) unwinds like Ctrl-C, so the engines' process groups are stopped.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    from experiments.serving.check import run_serve_check

    try:
        run_serve_check(cfg)
    except ServingError as e:
        print(f"[serve_check] failed: {e}", file=sys.stderr, flush=True)
        sys.exit(2)


if __name__ == "__main__":
    main()
