"""The serving check's parts that need no vLLM: the acceptance replay, the engine driver's failures, refusals.

The engine driver is run against stand-in environments whose ``bin/python`` is a shell script (one that
never signals readiness, one that dies while loading): each failure names its step, and the worker's
process group is gone afterwards. The vLLM side itself is tested in ``test_vllm_conformance.py``.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import torch
from conftest import fake_vllm_env, tiny_target
from omegaconf import OmegaConf

from drafters import DraftingPolicy, PolicyDrafter, factory
from drafters.tau import greedy_walk
from experiments.serving.check import load_drafter, served_width, step_costs
from experiments.serving.compare import (
    engine_walk,
    position_counts,
    sequence_acceptance,
    summary,
)
from experiments.serving.engine import ServingError, run_engine, run_engines, turn_order, vllm_python
from experiments.serving.report import step_cost_table
from verify.generate import speculative_generate

pytestmark = pytest.mark.serving


def test_engine_walk_anchors_at_the_first_new_token_and_counts_the_last_step_whole():
    lead = [0, 0, 0, 2, 0, 5, 1, 3, 0, 0]
    # prompt of 3: the engine's first block is anchored at column 3 (the first new token), then 3+2+1 = 6, 6+1+1 = 8
    assert engine_walk(lead, 3, 10) == [2, 1, 0]
    assert greedy_walk(lead, 3, 10)[0] == [0, 2, 1, 0]  # blockdraft's verifier starts one column earlier
    assert engine_walk([0, 0, 4, 0, 0], 2, 4) == [4]  # not cut at the sequence's end, as vLLM counts it


def test_position_counts_and_summary():
    assert position_counts([0, 3, 1, 2], 3) == [3, 2, 1]
    s = summary([0, 3, 1, 2], 3)
    assert s["num_drafts"] == 4 and s["num_accepted_tokens"] == 6 and s["acceptance_length"] == 2.5
    assert s["position_acceptance"] == [0.75, 0.5, 0.25]
    assert summary([], 3)["acceptance_length"] is None


def test_replay_on_greedy_sequences_equals_blockdraft_online_verifier():
    target = tiny_target("llama", vocab_size=48, num_layers=3, init_range=0.3)
    torch.manual_seed(0)
    drafter = factory.from_target(target, block_size=4, num_layers=1, target_layer_ids=(1, 2)).eval()
    prompts = [[5, 9, 11, 20], [7, 8, 30, 31, 12, 40]]
    online = [speculative_generate(target, drafter, torch.tensor([p]), max_new_tokens=20) for p in prompts]
    replay = sequence_acceptance(drafter, target, prompts, [o.new_tokens[0] for o in online])
    assert replay["mismatches"] == 0
    assert replay["blockdraft"]["num_drafts"] == sum(o.num_target_forwards for o in online)
    assert replay["blockdraft"]["tau"] == pytest.approx(40 / replay["blockdraft"]["num_drafts"])
    counts = [n for o in online for n in o.accepted_counts[0]]
    assert replay["blockdraft"]["accepted_per_pos"] == position_counts(counts, 3)
    # the engine's steps: one fewer token each (the first comes from the prefill), so at most as many steps
    assert replay["engine_steps"]["num_drafts"] <= replay["blockdraft"]["num_drafts"]


def test_replay_of_a_narrower_served_block_equals_the_online_verifier_drafting_it():
    """served with W < K speculative tokens, vLLM drafts blocks of W + 1 columns: the replay (width=W) equals
    blockdraft's own verifier drafting those blocks (own_draft_tokens = max_draft_tokens = W), step by step."""
    target = tiny_target("llama", vocab_size=16, num_layers=3, init_range=0.3)  # few tokens: drafts get accepted
    torch.manual_seed(0)
    drafter = factory.from_target(target, block_size=4, num_layers=1, target_layer_ids=(1, 2)).eval()
    narrow = PolicyDrafter(drafter, DraftingPolicy(max_draft_tokens=2, own_draft_tokens=2))
    prompts = [[5, 6, 2, 3], [7, 1, 3, 4, 2, 5]]
    online = [speculative_generate(target, narrow, torch.tensor([p]), max_new_tokens=20) for p in prompts]
    replay = sequence_acceptance(drafter, target, prompts, [o.new_tokens[0] for o in online], width=2)
    counts = [n for o in online for n in o.accepted_counts[0]]
    assert replay["mismatches"] == 0 and max(counts) <= 2 and sum(counts) > 0
    assert replay["blockdraft"]["num_drafts"] == sum(o.num_target_forwards for o in online)
    assert replay["blockdraft"]["accepted_per_pos"] == position_counts(counts, 2)


def test_the_served_width_is_the_whole_block_unless_set_and_in_range():
    target = tiny_target("llama", vocab_size=16, num_layers=3, init_range=0.3)
    drafter = factory.from_target(target, block_size=4, num_layers=1, target_layer_ids=(1, 2))
    assert served_width(OmegaConf.create({"num_speculative_tokens": None}), drafter) == 3
    assert served_width(OmegaConf.create({"num_speculative_tokens": 2}), drafter) == 2
    with pytest.raises(ValueError, match="num_speculative_tokens=4: must be in 1..3"):
        served_width(OmegaConf.create({"num_speculative_tokens": 4}), drafter)


def _gone(pid_file) -> bool:
    """The process is gone or a zombie (killed, not yet reaped: a container whose PID 1 does not reap orphans
    keeps a killed orphan's entry in the process table)."""
    pid = int(pid_file.read_text())
    for _ in range(20):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        try:
            if Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] in ("Z", "X"):
                return True
        except (FileNotFoundError, IndexError):
            return True
        time.sleep(0.1)
    return False


def test_engine_that_never_starts_is_stopped_and_named(tmp_path):
    pid_file = tmp_path / "pid"
    env = fake_vllm_env(tmp_path / "env", f"sleep 300 & echo $! > {pid_file}; echo loading the model; wait")
    with pytest.raises(ServingError, match=r"(?s)\[engine start\] timed out .*limit 1 s.*loading the model"):
        run_engine({"model": "m"}, env_dir=env, start_timeout=1)
    assert _gone(pid_file), "the worker's child outlived the failed start"


def test_engine_that_dies_while_loading_is_named(tmp_path):
    env = fake_vllm_env(tmp_path / "env", "echo 'ValueError: no model at m' >&2; exit 3")
    with pytest.raises(ServingError, match=r"(?s)\[engine start\] the vLLM worker exited with code 3 .*no model at m"):
        run_engine({"model": "m"}, env_dir=env, start_timeout=30)


def test_environment_without_vllm_is_named(tmp_path, monkeypatch):
    (tmp_path / "env" / "bin").mkdir(parents=True)
    (tmp_path / "env" / "bin" / "python").write_text("")
    with pytest.raises(ServingError, match=r"\[environment\] .* has no vllm package"):
        vllm_python(tmp_path / "env")
    monkeypatch.setenv("BLOCKDRAFT_VLLM_ENV", str(tmp_path / "elsewhere"))
    with pytest.raises(ServingError, match=r"\[environment\] no vLLM environment at .*elsewhere"):
        vllm_python()


def test_drafter_for_another_target_is_refused(tmp_path):
    small = tiny_target("llama", vocab_size=48, num_layers=3)
    factory.from_target(small, block_size=4, target_layer_ids=(1,)).save_pretrained(tmp_path / "d")
    other = tiny_target("llama", vocab_size=64, num_layers=3)
    with pytest.raises(ServingError, match=r"\[drafter\] drafter.path=.* cannot draft for this target: .*vocab_size"):
        load_drafter(str(tmp_path / "d"), other)


STAND_IN_WORKER = '''
import importlib.util, json, sys, time
from pathlib import Path

spec = importlib.util.spec_from_file_location("vllm_worker", sys.argv[1])
worker = importlib.util.module_from_spec(spec)
spec.loader.exec_module(worker)
job = json.loads(Path(sys.argv[2]).read_text())
trace = Path(job["trace"])


def run_phase(llm, phase, stop_token_ids):
    with trace.open("a") as f:
        f.write(f"start {job['engine']} {phase['name']}\\n")
    time.sleep(job["sleep"])
    with trace.open("a") as f:
        f.write(f"end {job['engine']} {phase['name']}\\n")
    return {"name": phase["name"]}


worker.build_engine = lambda job: None
worker.run_phase = run_phase
worker.engine_version = lambda: "stand-in"
worker.main(sys.argv[2])
'''


@pytest.mark.slow
def test_engines_take_turns_phase_by_phase_with_a_rotating_first(tmp_path):
    import sys

    (tmp_path / "stand_in.py").write_text(STAND_IN_WORKER)
    env = fake_vllm_env(tmp_path / "env", f'exec {sys.executable} {tmp_path / "stand_in.py"} "$@"')
    trace = tmp_path / "trace"
    phases = [{"name": f"p{i}"} for i in range(3)]
    jobs = {name: {"model": "m", "engine": name, "trace": str(trace), "phases": phases, "sleep": 1.0} for name in "abc"}
    # run_timeout bounds each engine's own phases (3 x ~1.5 s), not all engines' together (~13 s)
    results = run_engines(jobs, env_dir=env, start_timeout=60, run_timeout=9)
    assert [[p["name"] for p in results[n]["phases"]] for n in "abc"] == [["p0", "p1", "p2"]] * 3
    lines = trace.read_text().split()
    events = list(zip(lines[0::3], lines[1::3], lines[2::3], strict=True))
    starts = [(engine, phase) for kind, engine, phase in events if kind == "start"]
    assert starts == [(e, f"p{i}") for i in range(3) for e in turn_order(["a", "b", "c"], i)]
    # one engine decodes at a time: every start is followed by its own end
    assert all(events[2 * i][1:] == events[2 * i + 1][1:] and events[2 * i + 1][0] == "end" for i in range(9))
    assert turn_order(["a", "b", "c"], 1) == ["b", "c", "a"]


def test_lookahead_verifies_the_last_step_past_the_cut_as_the_engine_counts_it():
    target = tiny_target("llama", vocab_size=48, num_layers=3, init_range=0.3)
    drafter = factory.from_target(target, block_size=4, num_layers=1, target_layer_ids=(1, 2)).eval()
    with torch.no_grad():  # all logits 0 on both sides: greedy token 0 everywhere, every draft accepted
        target.model.norm.weight.zero_()
        drafter.norm.weight.zero_()
    prompts = [[5, 9, 11, 20], [7, 8, 30, 31, 12, 40]]
    cut = [[0] * 11, [0] * 11]
    # the engine's steps are anchored at new tokens 1, 5 and 9 (of 11); the last block has two tokens before
    # the cut, but the engine counts all 3 of its accepted drafts
    with_lookahead = sequence_acceptance(drafter, target, prompts, cut, lookahead=3)
    assert with_lookahead["engine_steps_accepted"] == [3, 3, 3] * 2
    assert with_lookahead["mismatches"] == 0
    without = sequence_acceptance(drafter, target, prompts, cut)
    assert without["engine_steps_accepted"] == [3, 3, 2] * 2  # only 2 columns of the block exist past col 9
    assert without["blockdraft"] == with_lookahead["blockdraft"]  # blockdraft's own walk stops at the cut


def test_step_cost_is_the_drafter_engines_ms_per_step_over_the_targets_ms_per_token():
    def phase(name, c, wall, tokens, drafts=0, accepted=0):
        spec = {"num_drafts": drafts, "num_accepted_tokens": accepted} if drafts else {}
        return {"name": f"{name}/c{c}", "concurrency": c, "wall_s": wall, "num_tokens": tokens, "spec": spec}

    results = {"target": {"phases": [phase("a", 1, 2.0, 100), phase("a", 8, 1.0, 100), phase("b", 1, 1.0, 50)]},
               "drafter": {"phases": [phase("a", 1, 1.5, 100, drafts=60, accepted=40), phase("a", 8, 1.0, 100, 60, 40),
                                      phase("b", 1, 1.0, 50)]}}  # b: no drafts counted, no cost
    costs = step_costs(results)
    assert list(costs) == ["a"]
    assert costs["a"]["target_ms_per_token"] == pytest.approx(20.0)
    assert costs["a"]["drafter_ms_per_step"] == pytest.approx(25.0)
    assert costs["a"]["step_cost"] == pytest.approx(1.25)
    assert costs["a"]["acceptance_length"] == pytest.approx(100 / 60)
    assert step_costs({"target": results["target"]}) == {}
    lines = step_cost_table({"step_cost": costs})
    assert lines[2] == "| a | 20.0 | 25.0 | 1.25 | 1.667 |"
    assert step_cost_table({}) == []
