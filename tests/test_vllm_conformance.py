"""vLLM serves an exported drafter as blockdraft verifies it (issue 41): same outputs, same acceptance.

A tiny random Llama target is saved to a folder; a 1-layer block drafter is fitted for a few steps to the
target's greedy continuations of the test prompts (so that it drafts some tokens right), exported in the
DFlash format (:func:`drafters.dflash.export_dflash`) and served by vLLM for CPU, which runs in its own
environment (``experiments/serving/install_vllm.sh``; path ``$BLOCKDRAFT_VLLM_ENV``, default
``.venv-vllm``) through :func:`experiments.serving.engine.run_engine`. At T=0:

* vLLM's outputs equal blockdraft's ``target_generate`` (and its ``speculative_generate``'s);
* vLLM's counters (drafts, accepted drafts, accepted per position) equal blockdraft's drafts verified
  on the same sequences, step for step as vLLM steps (:mod:`experiments.serving.compare`), and are not 0.

vLLM counts a step's accepted drafts before it cuts the output at ``max_tokens``, so the blocks are
verified on continuations K tokens longer than what vLLM returns.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from drafters import factory
from drafters.dflash import export_dflash
from drafters.tau import greedy_walk
from drafters.training.blocks import select_blocks
from drafters.training.datamodule import collate
from experiments.serving.compare import engine_walk, position_counts, sequence_leads
from experiments.serving.engine import ServingError, run_engine, vllm_python
from verify.generate import speculative_generate, target_generate

pytestmark = [pytest.mark.slow, pytest.mark.serving]

try:
    vllm_python()
except ServingError as missing:
    pytest.skip(f"vLLM environment absent: {missing} (CI creates it)", allow_module_level=True)

VOCAB, BLOCK, NEW = 256, 6, 40  # K = 5 drafts per step; NEW tokens per prompt
PROMPT_LENGTHS = (5, 9, 7, 12)


def tiny_llama(seed: int = 0):
    """A random 4-layer Llama whose greedy continuations have clear argmax margins (std 0.2 weights)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=512,
                         initializer_range=0.2, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(seed)
    return LlamaForCausalLM(config).to(torch.float32).eval()


def fit_drafter(drafter, target, rows: list[dict], steps: int = 60, lr: float = 3e-3):
    """A few teacher-forced CE steps on ``rows`` (``{"input_ids", "prompt_len"}``): a drafter that drafts."""
    batch = collate(rows)
    with torch.no_grad():
        states = target(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                        output_hidden_states=True).hidden_states
    optimizer = torch.optim.Adam(drafter.parameters(), lr=lr)
    generator = torch.Generator().manual_seed(0)
    drafter.train()
    for _ in range(steps):
        logits, labels, mask, _ = select_blocks(drafter, batch, states, None, 16, generator)
        loss = F.cross_entropy(logits[mask], labels[mask])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return drafter.eval()


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """Everything both sides produced: prompts, blockdraft's continuations and verifier, vLLM's result."""
    root = tmp_path_factory.mktemp("vllm")
    target = tiny_llama()
    target.save_pretrained(root / "target")
    generator = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, VOCAB, (n,), generator=generator).tolist() for n in PROMPT_LENGTHS]
    # K tokens past NEW: the blocks of vLLM's last step are verified on what the target would say next.
    longer = [target_generate(target, torch.tensor([p]), max_new_tokens=NEW + BLOCK - 1).new_tokens[0]
              for p in prompts]
    drafter = factory.from_target(target, block_size=BLOCK, num_layers=1, target_layer_ids=(1, 3))
    drafter = fit_drafter(drafter, target, [{"input_ids": p + c, "prompt_len": len(p)} for p, c in zip(prompts, longer)])
    export_dflash(drafter, root / "drafter")
    job = {"model": str(root / "target"), "max_model_len": 512, "max_num_seqs": 4,
           "speculative_config": {"method": "dflash", "model": str(root / "drafter"),
                                  "num_speculative_tokens": BLOCK - 1},
           "phases": [{"name": "batch1", "prompts": prompts, "max_tokens": NEW, "concurrency": 1, "ignore_eos": True}]}
    result = run_engine(job, start_timeout=600, run_timeout=600, threads=1, kv_cache_gb=1, threads_bind="nobind")
    return {"prompts": prompts, "longer": longer, "target": target, "drafter": drafter,
            "phase": result["phases"][0]}


def test_vllm_greedy_outputs_equal_blockdraft(served):
    target, drafter = served["target"], served["drafter"]
    for prompt, longer, output in zip(served["prompts"], served["longer"], served["phase"]["outputs"]):
        ids = torch.tensor([prompt])
        assert output == longer[:NEW]
        assert speculative_generate(target, drafter, ids, max_new_tokens=NEW).new_tokens[0] == longer[:NEW]


def test_vllm_accepts_what_blockdraft_accepts(served):
    target, drafter, spec = served["target"], served["drafter"], served["phase"]["spec"]
    steps = []
    for prompt, longer in zip(served["prompts"], served["longer"]):
        lead, mismatches = sequence_leads(drafter, target, prompt, longer)
        assert mismatches == 0
        steps += engine_walk(lead, len(prompt), len(prompt) + NEW)
        # blockdraft's own verifier drafts these same blocks (its steps start one column earlier)
        online = speculative_generate(target, drafter, torch.tensor([prompt]), max_new_tokens=NEW)
        assert online.accepted_counts[0] == greedy_walk(lead, len(prompt), len(prompt) + NEW)[0]
    assert sum(steps) > 0, "the fitted drafter accepted nothing: the comparison would prove little"
    assert spec["num_drafts"] == len(steps)
    assert spec["num_draft_tokens"] == len(steps) * (BLOCK - 1)
    assert spec["num_accepted_tokens"] == sum(steps)
    assert spec["accepted_per_pos"] == position_counts(steps, BLOCK - 1)


def test_missing_environment_names_the_step(tmp_path):
    with pytest.raises(ServingError, match=r"\[environment\] no vLLM environment at .*install_vllm.sh"):
        run_engine({"model": str(tmp_path)}, env_dir=tmp_path / "absent")
