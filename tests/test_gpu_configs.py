"""The GPU experiments (``experiment=qwen3_gpu``, ``experiment=llama3_gpu``) run on CPU through the path
the real run takes: ``python -m experiments.train experiment=<gpu experiment>`` with only the target's
path, the sizes and the trainer's hardware overridden, a tiny random Qwen3 / Llama of the same family
standing in for the 8B target. It regenerates its data, trains three optimizer steps with the
experiment's drafter (block 16, 5 layers), loss settings, optimiser and scheduler, validates and
exports the drafter. Gradient checkpointing of the drafter is switched on, as a GPU user would for
memory, and shown to leave the gradients unchanged."""

from __future__ import annotations

import functools
import json
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf
from test_train import offline_env, run_main, save_target

from drafters import factory
from experiments import train

pytestmark = [pytest.mark.slow, pytest.mark.e2e]

CONF = Path(__file__).resolve().parents[1] / "conf"
# The real run's hardware and sizes, swapped for what this machine can run: nothing else changes.
CPU = ["trainer.accelerator=cpu", "trainer.precision=32-true", "trainer.devices=1",
       "trainer.enable_progress_bar=false", "trainer.log_every_n_steps=1"]
SIZES = ["suite=[humaneval,gsm_symbolic]", "data.generation.prompts.per_source=3", "data.generation.max_new_tokens=24",
         "data.generation.max_prompt_tokens=256", "data.datamodule.batch_size=2", "data.datamodule.max_length=160",
         "data.datamodule.val_fraction=0.25", "data.datamodule.max_val_samples=2", "module.num_anchors=8",
         "train.max_steps=3", "train.val_every=3", "train.checkpoint_every=3", "scheduler.warmup_steps=1"]


save_qwen3 = functools.partial(save_target, arch="qwen3")  # q/k norms, GQA


@pytest.mark.parametrize("experiment, save", [("qwen3_gpu", save_qwen3), ("llama3_gpu", save_target)])
def test_gpu_experiment_trains_three_steps_on_cpu(tmp_path, experiment, save):
    with pytest.MonkeyPatch.context() as mp:
        offline_env(mp, tmp_path)
        target = save(tmp_path / "target")
        run_main(train, [f"experiment={experiment}", f"target.path={target}", *CPU, *SIZES,
                         "drafter.gradient_checkpointing=true", "name=gpu"])
    run_dir = tmp_path / "runs" / "train" / "gpu"
    summary = json.loads((run_dir / "train_summary.json").read_text())
    assert summary["steps"] == 3 and summary["train_rows"] > 0 and "val/tau_greedy" in summary["val"]
    saved = OmegaConf.load(run_dir / ".hydra" / "config.yaml")
    assert saved.trainer.accelerator == "cpu" and "strategy" not in saved.trainer and saved.loss.gamma == 7.0 and saved.module.num_anchors == 8
    assert saved.data.features.enabled is False  # the GPU experiments run the target every step
    from experiments.data.target import load_target

    drafter = factory.load(run_dir / "drafter", target=load_target(str(target))[0])
    assert drafter.config.block_size == 16 and drafter.config.num_layers == 5


def test_gradient_checkpointing_keeps_the_gradients():
    from conftest import tiny_target

    target = tiny_target("qwen2", vocab_size=64)
    grads = []
    for checkpointing in (False, True):
        torch.manual_seed(0)
        drafter = factory.from_target(target, block_size=4, num_layers=2,
                                                    gradient_checkpointing=checkpointing)
        assert all(layer.gradient_checkpointing is checkpointing for layer in drafter.layers)
        ids = torch.randint(3, 64, (2, 12), generator=torch.Generator().manual_seed(1))
        with torch.no_grad():
            states = target(input_ids=ids, output_hidden_states=True).hidden_states
        anchors = torch.tensor([[2, 5], [3, 7]])
        drafter.forward_train(states, ids, None, anchors).square().mean().backward()
        grads.append({n: p.grad for n, p in drafter.named_parameters()})
    for name, grad in grads[0].items():
        torch.testing.assert_close(grads[1][name], grad, msg=name)
    assert "gradient_checkpointing" not in drafter.config.to_dict()  # a training setting, never saved


@pytest.mark.parametrize("experiment", ["qwen3_gpu", "llama3_gpu"])
def test_gpu_experiments_compose_for_every_stage(experiment):
    """regenerate and train meet in one data folder; trainer=fsdp swaps the strategy whole."""
    from hydra import compose, initialize_config_dir

    import experiments  # noqa: F401  (registers the ${settings_hash:...} resolver)

    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        regen = compose(config_name="regenerate", overrides=[f"experiment={experiment}"])
        ddp = compose(config_name="train", overrides=[f"experiment={experiment}"])
        fsdp = compose(config_name="train", overrides=[f"experiment={experiment}", "trainer=fsdp"])
    assert regen.data.data_dir == ddp.data.data_dir and regen.data.generation.max_new_tokens == 2048
    assert (ddp.trainer.accelerator, ddp.trainer.precision, ddp.trainer.devices) == ("gpu", "bf16-mixed", -1)
    assert "strategy" not in ddp.trainer  # Lightning's auto: DDP on several GPUs
    assert fsdp.trainer.strategy._target_.endswith("FSDPStrategy") and fsdp.trainer.precision == "bf16-mixed"
    assert ddp.drafter.gradient_checkpointing is False and ddp.data.datamodule.batch_size % 8 == 0
