"""Hydra entry points and data loaders of blockdraft (run as ``python -m experiments.<name>``)."""

import hashlib
import json

from omegaconf import OmegaConf

from experiments.target import asset_path


def settings_hash(*parts) -> str:
    """A short stable hash of config values (DictConfig/ListConfig/str/...), for cache folder names."""
    plain = [OmegaConf.to_container(p, resolve=True) if OmegaConf.is_config(p) else p for p in parts]
    return hashlib.sha1(json.dumps(plain, sort_keys=True, default=str).encode()).hexdigest()[:12]


# ${asset:tiny_target} -> absolute path of a file shipped with the package (works installed too);
# ${settings_hash:${target.path},${data.generation}} names the regenerated-data cache folder.
for _name, _fn in (("asset", asset_path), ("settings_hash", settings_hash)):
    if not OmegaConf.has_resolver(_name):
        OmegaConf.register_new_resolver(_name, _fn)
