"""Stable hashes (the same in every process, unlike ``hash``): seeds, hold-out splits, cache names."""

from __future__ import annotations

import hashlib
import json
from typing import Any

from omegaconf import OmegaConf


def stable_seed(*parts: Any) -> int:
    """A 32-bit number from the parts' string forms joined by ``/`` (sha1): generator seeds, id splits."""
    return int(hashlib.sha1("/".join(str(p) for p in parts).encode()).hexdigest()[:8], 16)


def settings_hash(*parts) -> str:
    """A short stable hash of config values (DictConfig/ListConfig/str/...), for cache folder names."""
    plain = [OmegaConf.to_container(p, resolve=True) if OmegaConf.is_config(p) else p for p in parts]
    return hashlib.sha1(json.dumps(plain, sort_keys=True, default=str).encode()).hexdigest()[:12]
