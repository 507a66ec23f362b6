"""Block-diffusion drafters: the DFlash drafter (:mod:`drafters.model`, its layers :mod:`drafters.layers`), its
research variants (:mod:`drafters.variants`), making and loading drafters (:mod:`drafters.factory`), the DFlash
serving format (:mod:`drafters.dflash`), the decoding policy (:mod:`drafters.policy`), and their training
(:mod:`drafters.training`)."""

from drafters.config import DrafterConfig
from drafters.factory import build, from_target, load
from drafters.layers import build_block_attention_mask
from drafters.model import DFlashDrafter
from drafters.policy import DraftingPolicy, PolicyDrafter

__all__ = ["DFlashDrafter", "DrafterConfig", "DraftingPolicy", "PolicyDrafter", "build", "build_block_attention_mask",
           "from_target", "load"]
