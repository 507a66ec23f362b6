"""Hydra entry points and data loaders of blockdraft (run as ``python -m experiments.<name>``)."""

from omegaconf import OmegaConf

from experiments.target import asset_path

# ${asset:tiny_target} -> absolute path of a file shipped with the package (works installed too).
if not OmegaConf.has_resolver("asset"):
    OmegaConf.register_new_resolver("asset", asset_path)
