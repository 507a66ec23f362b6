"""Config groups that only experiments.evaluate searches (hydra.searchpath in conf/evaluate.yaml)."""
