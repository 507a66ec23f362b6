"""Exact speculative decoding: rejection-sampling verifier, decoding loops, drafter protocol, metrics."""

from verify.drafter import AssistantDrafter, Drafter, truncated_copy
from verify.generate import SpeculativeOutput, TargetOutput, speculative_generate, target_generate
from verify.hf import max_positions, new_kv_cache, output_vocab_size
from verify.lookup import CorpusLookupDrafter, NgramStore, PromptLookupDrafter
from verify.metrics import (
    accept_histogram,
    accepted_by_source,
    bootstrap_ci,
    position_acceptance,
    summarize,
    tau_macro,
    tau_micro,
)
from verify.rejection import sample_tokens, verify_block, verify_greedy, warp_probs

__all__ = [
    "AssistantDrafter",
    "CorpusLookupDrafter",
    "Drafter",
    "NgramStore",
    "PromptLookupDrafter",
    "SpeculativeOutput",
    "TargetOutput",
    "accept_histogram",
    "accepted_by_source",
    "bootstrap_ci",
    "max_positions",
    "new_kv_cache",
    "output_vocab_size",
    "position_acceptance",
    "sample_tokens",
    "speculative_generate",
    "summarize",
    "target_generate",
    "tau_macro",
    "tau_micro",
    "truncated_copy",
    "verify_block",
    "verify_greedy",
    "warp_probs",
]
