"""The README.md of an exported DFlash drafter (:func:`drafters.dflash.export_dflash`): what it is, how it
was trained, its τ, and the vLLM / SGLang commands that serve it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

from drafters.config import DrafterConfig

if TYPE_CHECKING:
    from drafters.model import DFlashDrafter


def reads_final_output(cfg: DrafterConfig) -> bool:
    """Whether the drafter reads ``hidden_states[L]`` (the target's final-norm output)."""
    return cfg.target_fingerprint["num_hidden_layers"] in cfg.target_layer_ids


def serving_commands(out_dir: str | Path, target: str = "<target model>", num_speculative_tokens: int = 15) -> dict:
    """vLLM and SGLang command lines serving ``target`` with the DFlash drafter in ``out_dir``."""
    spec = json.dumps({"method": "dflash", "model": str(out_dir), "num_speculative_tokens": num_speculative_tokens})
    return {
        "vllm": f"vllm serve {target} --speculative-config '{spec}'",
        "sglang": (f"python -m sglang.launch_server --model-path {target} --speculative-algorithm DFLASH "
                   f"--speculative-draft-model-path {out_dir}"),
    }


def model_card(drafter: DFlashDrafter, out_dir: str | Path, *, target: str | None = None,
               data: str | None = None, loss: str | None = None,
               tau: dict[str, dict[str, float]] | None = None, notes: str | None = None) -> str:
    """A short README.md: what the drafter is, how it was trained, its τ, how to serve it.

    ``tau``: ``{suite: {"T=0": τ, ...}}`` (e.g. from a results.json); missing items read "unknown".
    """
    cfg = drafter.config
    fp = cfg.target_fingerprint
    target_name = target or "<target model>"
    cmds = serving_commands(out_dir, target_name, cfg.block_size - 1)
    params = sum(p.numel() for p in drafter.parameters())
    lines = [
        "# Block-diffusion drafter (DFlash format)",
        "",
        (f"A {cfg.num_layers}-layer block drafter ({params:,} parameters) trained with blockdraft for speculative "
        f"decoding of **{target_name}** ({fp['model_type']}, {fp['num_hidden_layers']} layers, hidden "
        f"{fp['hidden_size']}, vocabulary {fp['vocab_size']}). It drafts {cfg.block_size - 1} tokens per step "
        f"(block size {cfg.block_size}, mask token {cfg.mask_token_id}) from the hidden states of target "
        f"layers {[i - 1 for i in cfg.target_layer_ids]} (DFlash layer ids, counted from 0)."),
        "",
        f"- Training data: {data or 'unknown'}",
        f"- Loss: {loss or 'unknown'}",
    ]
    if tau:
        temps = sorted({t for row in tau.values() for t in row})
        lines += ["", "τ (accepted tokens per verification step, bonus included; exact verification):", "",
                  "| suite | " + " | ".join(temps) + " |", "|---" * (len(temps) + 1) + "|"]
        for suite, row in tau.items():
            lines.append(f"| {suite} | " + " | ".join(f"{row[t]:.3f}" if t in row else "—" for t in temps) + " |")
    else:
        lines += ["- τ: not measured (no results.json next to the training run)"]
    if reads_final_output(cfg):
        lines += ["", (f"Caveat: this drafter reads the target's last hidden state (after its final norm, DFlash "
                       f"layer id {fp['num_hidden_layers'] - 1}). The `dflash` package provides it; vLLM captures "
                       "only the inputs of target layers and does not, so check it before serving with vLLM.")]
    if notes:
        lines += ["", notes]
    lines += [
        "",
        "## Serve",
        "",
        "vLLM:",
        "",
        "```bash",
        cmds["vllm"],
        "```",
        "",
        "SGLang:",
        "",
        "```bash",
        cmds["sglang"],
        "```",
        "",
        ("Serving engines need a GPU; blockdraft checked this checkpoint against the `dflash` reference "
         "package on CPU, not inside vLLM or SGLang."),
        "",
    ]
    return "\n".join(lines)
