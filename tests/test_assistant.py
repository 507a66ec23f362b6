"""experiments.train_assistant / experiments.pipeline.assistant: the ar_assistant baseline's training code path on a
tiny random target (a few CPU steps), resume, export, and its use through verify.AssistantDrafter."""

from __future__ import annotations

import json

import pytest
import torch
from test_train import run_main, save_target

from drafters.training.datamodule import write_meta, write_shard
from experiments import train_assistant
from experiments.pipeline import assistant as asst
from verify import AssistantDrafter, speculative_generate, target_generate

pytestmark = [pytest.mark.slow, pytest.mark.e2e]

PROMPT_LENGTHS = [5, 9, 3, 7, 4, 6, 8, 5, 6, 4, 7, 3]
NEW = 24
K = 4
SMALL_MODEL = ["model.hidden_size=32", "model.intermediate_size=64", "model.num_hidden_layers=1",
               "model.num_attention_heads=2", "model.num_key_value_heads=2", "model.max_position_embeddings=512"]


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    """A random target and 'regenerated' data: its own greedy answers to random prompts."""
    from experiments.data.target import load_target

    root = tmp_path_factory.mktemp("assistant")
    save_target(root / "target")
    target, tok = load_target(str(root / "target"))
    generator = torch.Generator().manual_seed(0)
    rows = []
    for i, n in enumerate(PROMPT_LENGTHS):
        prompt = torch.randint(3, len(tok), (1, n), generator=generator)
        answer = target_generate(target, prompt, max_new_tokens=NEW).new_tokens[0]
        rows.append({"id": f"row{i}", "domain": "code", "input_ids": prompt[0].tolist() + answer, "prompt_len": n})
    data_dir = root / "data"
    write_shard(rows, data_dir)
    write_meta(data_dir, {"complete": True})
    return {"root": root, "target": target, "data_dir": data_dir, "rows": rows}


def _args(env, run_dir, steps):
    return ["target=hf", f"target.path={env['root'] / 'target'}", f"data.data_dir={env['data_dir']}",
            "data.datamodule.batch_size=2", "data.datamodule.val_fraction=0.3", *SMALL_MODEL,
            f"train.max_steps={steps}", "train.val_every=2", "train.checkpoint_every=2", "scheduler.warmup_steps=1",
            "trainer.enable_progress_bar=false", f"num_draft_tokens={K}", f"hydra.run.dir={run_dir}"]


def test_train_export_resume(env, monkeypatch):
    from transformers import AutoModelForCausalLM

    monkeypatch.setenv("BLOCKDRAFT_RUNS", str(env["root"] / "runs"))
    run_dir = env["root"] / "runs" / "a"
    run_main(train_assistant, _args(env, run_dir, 4))
    export = run_dir / "export"
    meta = json.loads((export / "training.json").read_text())
    assert meta["steps"] == 4 and meta["resumed_from_step"] is None
    assert set(meta["val"]) == {"val/ce", "val/acc", "val/tau_greedy"} and 1.0 <= meta["val"]["val/tau_greedy"] <= K + 1
    assert meta["val_at_start"]["val/ce"] > 0 and meta["train_rows"] + meta["val_rows"] == len(PROMPT_LENGTHS)
    assert meta["command"].startswith("python -m experiments.train_assistant target=hf")
    assert {"model.safetensors", "config.json", "tokenizer.json", "README.md"} <= {p.name for p in export.iterdir()}
    assert "| cross-entropy (nats/token) |" in (export / "README.md").read_text()
    model = AutoModelForCausalLM.from_pretrained(export)
    assert next(model.parameters()).dtype == torch.float16 and model.config.num_hidden_layers == 1
    assert model.config.vocab_size == env["target"].config.vocab_size

    with pytest.raises(ValueError, match=r"trained with other settings.*optimizer\.lr: 0\.001 -> 0\.002"):
        run_main(train_assistant, [*_args(env, run_dir, 6), "optimizer.lr=2e-3"])  # refused before anything changes
    assert json.loads((run_dir / "run_settings.json").read_text())["settings"]["optimizer.lr"] == 1e-3
    run_main(train_assistant, _args(env, run_dir, 6))  # the same command with a larger budget resumes
    meta = json.loads((export / "training.json").read_text())
    assert meta["steps"] == 6 and meta["resumed_from_step"] == 4
    assert (run_dir / "logs" / "metrics.before-step-4.csv").is_file()

    # The exported assistant drafts through the exact verifier: identical to greedy target decoding.
    target = env["target"]
    drafter = AssistantDrafter(AutoModelForCausalLM.from_pretrained(export, dtype=torch.float32).eval(), K)
    prompt = torch.tensor([env["rows"][0]["input_ids"][: PROMPT_LENGTHS[0]]])
    out = speculative_generate(target, drafter, prompt, max_new_tokens=NEW)
    assert out.new_tokens == target_generate(target, prompt, max_new_tokens=NEW).new_tokens

    # Continued in a new run (init_from: the export): it starts where the export ended, and says so.
    later = env["root"] / "runs" / "assistant_continued"
    run_main(train_assistant, [*_args(env, later, 2)[:-1], f"init_from={export}", f"hydra.run.dir={later}"])
    continued = json.loads((later / "export" / "training.json").read_text())
    assert continued["init"].startswith("continued from `export` (6 steps")
    assert continued["total_steps"] == 6 + 2
    assert continued["total_wall_time_s"] == pytest.approx(meta["wall_time_s"] + continued["wall_time_s"], abs=0.1)
    assert "in all, with the runs it continued: 8 steps" in (later / "export" / "README.md").read_text()
    assert continued["val_at_start"]["val/ce"] == pytest.approx(meta["val"]["val/ce"], abs=1e-2)  # float16 export


def test_init_from_target_and_errors(env):
    target = env["target"]
    small = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2,
             "num_key_value_heads": 2, "max_position_embeddings": 512}
    model = asst.build_assistant(target, small)
    for name, weight in model.state_dict().items():
        assert torch.equal(weight, target.state_dict()[name]), name
    assert model.config.eos_token_id == target.config.eos_token_id
    assert not torch.equal(asst.build_assistant(target, small, init_from_target=False).model.embed_tokens.weight,
                           target.model.embed_tokens.weight)
    with pytest.raises(ValueError, match="init_from_target"):
        asst.build_assistant(target, {**small, "hidden_size": 48, "intermediate_size": 96})
    partial = asst.build_assistant(target, small, init_from_target="embeddings").state_dict()
    for name, weight in partial.items():  # shared weights copied, the layers' projections random
        if ".layers." not in name or name.endswith("proj.weight"):
            assert torch.equal(weight, target.state_dict()[name]) == (".layers." not in name), name
    with pytest.raises(ValueError, match="'layers'"):
        asst.build_assistant(target, small, init_from_target="layers")
    model.save_pretrained(env["root"] / "saved_small")
    with pytest.raises(ValueError, match=r"init_from=.*saved_small: another architecture than model: \(num_hidden_layers: "
                                         r"1 \(saved\) != 2 \(model.num_hidden_layers\)\)"):
        asst.continue_from(asst.build_assistant(target, {**small, "num_hidden_layers": 2}), env["root"] / "saved_small")
    with pytest.raises(FileNotFoundError, match="init_from=.*nowhere: no saved assistant there"):
        asst.continue_from(model, env["root"] / "nowhere")


def test_response_labels_and_leading_correct():
    batch = {"input_ids": torch.tensor([[1, 2, 3, 4, 5], [6, 7, 8, 0, 0]]), "prompt_len": torch.tensor([2, 1]),
             "length": torch.tensor([5, 3])}
    labels, mask = asst.response_labels(batch)
    assert labels.tolist() == [[2, 3, 4, 5], [7, 8, 0, 0]]
    assert mask.tolist() == [[False, True, True, True], [True, True, False, False]]
    assert asst.leading_correct([True, True, False, True, True, True], limit=2) == [2, 1, 0, 2, 2, 1, 0]


def test_replayed_tau_is_the_online_tau(env):
    """On the target's greedy answers, val/tau_greedy equals speculative_generate's τ at T=0, row by row."""
    from drafters.tau import greedy_walk
    from drafters.training.datamodule import collate

    target = env["target"]
    small = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2,
             "num_key_value_heads": 2, "max_position_embeddings": 512}
    torch.manual_seed(0)
    model = asst.build_assistant(target, small).eval()  # the target's first layer: often right, often wrong
    module = asst.AssistantLM(model, optimizer=None, num_draft_tokens=K)
    module.on_validation_epoch_start()
    batch = collate(env["rows"], pad_token_id=0)
    with torch.no_grad():
        module.validation_step(batch, 0)
    online_kept = online_steps = 0
    for row in env["rows"]:
        prompt = torch.tensor([row["input_ids"][: row["prompt_len"]]])
        out = speculative_generate(target, AssistantDrafter(model, K), prompt, max_new_tokens=NEW)
        assert out.new_tokens[0] == row["input_ids"][row["prompt_len"]:]
        labels, _ = asst.response_labels(collate([row]))
        correct = (model(input_ids=collate([row])["input_ids"]).logits[:, :-1].argmax(-1) == labels)[0].tolist()
        accepted, _ = greedy_walk(asst.leading_correct(correct, K), row["prompt_len"], len(row["input_ids"]))
        assert accepted == out.accepted_counts[0]
        online_kept += out.num_new_tokens
        online_steps += out.num_target_forwards
    assert module._val["kept"] == online_kept and module._val["steps"] == online_steps
    assert 1.0 < online_kept / online_steps < K + 1


def test_damaged_checkpoint_is_named(env, monkeypatch):
    from drafters.storage import DamagedFileError

    monkeypatch.setenv("BLOCKDRAFT_RUNS", str(env["root"] / "runs"))
    run_dir = env["root"] / "runs" / "damaged"
    last = run_dir / "checkpoints" / "last.ckpt"
    last.parent.mkdir(parents=True)
    last.write_bytes(b"garbage, not a checkpoint")
    with pytest.raises(DamagedFileError, match=f"checkpoint {last} cannot be read") as info:
        run_main(train_assistant, _args(env, run_dir, 2))
    assert "weights_only" not in str(info.value) and not (run_dir / "logs").exists()  # nothing touched


def test_a_second_job_into_a_busy_run_folder_refuses(env, monkeypatch):
    from test_run_safety import start_holder

    from drafters.locks import FolderBusyError

    monkeypatch.setenv("BLOCKDRAFT_RUNS", str(env["root"] / "runs"))
    run_dir = env["root"] / "runs" / "busy"
    child = start_holder(run_dir, 30.0)
    try:
        with pytest.raises(FolderBusyError, match=f"run folder .*busy is in use by pid {child.pid} on host "):
            run_main(train_assistant, _args(env, run_dir, 2))
    finally:
        child.kill()
        child.wait()
    assert not (run_dir / "logs").exists() and not (run_dir / "checkpoints").exists()  # nothing written


def test_a_time_budget_stops_the_assistant_and_validation_can_wait_for_the_end(env, monkeypatch):
    """The long job times the assistant without validation inside the fit (val_every past the budget), then gives it
    the drafter's training time as a cap (callbacks.train_clock.duration)."""
    monkeypatch.setenv("BLOCKDRAFT_RUNS", str(env["root"] / "runs"))
    args = [a for a in _args(env, env["root"] / "runs" / "timed", 5) if not a.startswith("train.val_every=")]
    run_main(train_assistant, [*args, "train.val_every=1000000000"])
    meta = json.loads((env["root"] / "runs" / "timed" / "train_summary.json").read_text())
    assert meta["steps"] == 5 and meta["wall_time_s"] > 0 and "val/tau_greedy" in meta["val"]  # validated at the end
    capped = [a.replace("/timed", "/capped") for a in args]
    run_main(train_assistant, [*capped, "callbacks.train_clock.duration={seconds:0}"])
    assert json.loads((env["root"] / "runs" / "capped" / "train_summary.json").read_text())["steps"] < 5  # stopped


def test_continued_totals_chain():
    """A continuation of a continuation counts every run before it; an export that was not continued counts itself."""
    first = asst.continued_record("a", {"steps": 10, "wall_time_s": 100.0, "init": "from the target"})
    assert first["init"] == "continued from `a` (10 steps, 100.0 s; from the target)"
    second = asst.with_totals({"steps": 5, "wall_time_s": 50.0}, first)
    assert (second["total_steps"], second["total_wall_time_s"]) == (15, 150.0)
    third = asst.continued_record("b", {"steps": 5, "wall_time_s": 50.0, **second})
    assert (third["total_steps"], third["total_wall_time_s"]) == (15, 150.0)
    assert asst.with_totals({"steps": 1, "wall_time_s": 1.0}, third)["total_steps"] == 16
