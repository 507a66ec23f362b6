"""Block-diffusion drafters: the core DFlash drafter (drafters.model), its variants (drafters.variants), the
decoding policy (drafters.policy), and (in data/module) its training."""

from drafters.attention import build_block_attention_mask
from drafters.model import BlockDiffusionDrafter, DFlashDrafter, DrafterConfig
from drafters.policy import DraftingPolicy, PolicyDrafter

__all__ = ["BlockDiffusionDrafter", "DFlashDrafter", "DrafterConfig", "DraftingPolicy", "PolicyDrafter",
           "build_block_attention_mask"]

# Training side (data, LightningModule), imported lazily: it pulls in Lightning and datasets.
_TRAINING = {"RegenDataModule": "drafters.data", "collate": "drafters.data", "sample_anchors": "drafters.data",
             "DrafterLightningModule": "drafters.module", "teacher_forced_tau": "drafters.tau",
             "warmup_cosine": "drafters.optim"}
__all__ += ["DrafterLightningModule", "RegenDataModule", "collate", "sample_anchors", "teacher_forced_tau",
            "warmup_cosine"]


def __getattr__(name: str):
    if name in _TRAINING:
        import importlib

        return getattr(importlib.import_module(_TRAINING[name]), name)
    raise AttributeError(f"module 'drafters' has no attribute {name!r}")
