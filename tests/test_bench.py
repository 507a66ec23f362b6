"""Smoke runs of the benchmarks in experiments/bench/ that no other test runs: each one's ``main`` at tiny
settings writes its record. (``draft_cost``, ``suite_steps``, ``interleave`` and ``interleave_plot`` run in
tests/test_evaluate.py, the step clock of :mod:`experiments.bench.profiling` in tests/test_fast_verify.py.)"""

from __future__ import annotations

import json

import torch


def test_train_bench_times_each_loss_with_and_without_cached_features(tmp_path):
    from experiments.bench import train

    out = tmp_path / "train.json"
    report = train.main(["--losses", "uniform", "soft_all", "--batch-size", "2", "--seq-len", "24", "--prompt-len", "8",
                         "--num-anchors", "4", "--block-size", "4", "--steps", "1", "--warmup", "0",
                         "--device", "cpu", "--out", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(report))
    runs = {(r["loss"], r["features"]) for r in report["losses"]}
    # a soft loss needs the target's logits: it runs the target in both modes
    assert runs == {("uniform", "on_the_fly"), ("uniform", "cached"), ("soft_all", "on_the_fly")}
    assert all(r["blocks_per_s"] > 0 and r["peak_rss_mb"] > 0 for r in report["losses"])
    assert report["validation_batch"]["anchors_per_s"] > 0
    ref = report["reference"]  # the machine's yardstick, measured in the same process
    assert ref["matmul_shape"] == [2 * 24, 256, 768] and ref["matmul_gflops"] > 0
    assert _is_share(ref["feature_pass_share_of_matmul"], ref["feature_pass_gflops"], ref["matmul_gflops"])
    assert all(_is_share(r["train_share_of_matmul"], r["train_gflops"], ref["matmul_gflops"]) for r in report["losses"])


def test_train_bench_interleaves_anchor_counts_and_keeps_each_ones_median_round(tmp_path):
    from experiments.bench import train

    report = train.main(["--losses", "uniform", "--features", "cached", "--batch-size", "2", "--seq-len", "24",
                         "--prompt-len", "8", "--num-anchors", "2", "6", "--rounds", "3", "--block-size", "4",
                         "--steps", "1", "--warmup", "0", "--device", "cpu", "--out", str(tmp_path / "train.json")])
    runs = report["losses"]
    assert [(r["num_anchors"], r["features"]) for r in runs] == [(2, "cached"), (6, "cached")]
    assert report["target"] == "experiments/assets/tiny_target"  # the embedded target, as committed records name it
    for r in runs:
        assert len(r["s_per_step_rounds"]) == 3
        assert round(r["s_per_step"], 4) == sorted(r["s_per_step_rounds"])[1]
    assert runs[1]["blocks_per_step"] == 3 * runs[0]["blocks_per_step"]  # 16 response tokens: room for every anchor


def _is_share(share: float, gflops: float, of: float) -> bool:
    """``share`` (3 decimals) is ``gflops / of`` where both were rounded to 1 decimal: the ratio of the rounded
    values may differ from the share of the unrounded ones by the rounding of each, so it is a range."""
    low, high = max(gflops - 0.05, 0) / (of + 0.05), (gflops + 0.05) / max(of - 0.05, 1e-9)
    return low - 5e-4 <= share <= high + 5e-4


def test_losses_bench_times_every_config_against_torch_cross_entropy(tmp_path):
    from experiments.bench import losses

    out = tmp_path / "losses.json"
    result = losses.main(["--blocks", "4", "--slots", "3", "--vocab", "32", "--hidden", "8", "--repeats", "2",
                          "--configs", "l2r_all", "soft_all", "--out", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(result))
    table = result["results"]["32"]
    assert set(table) == {"torch_ce", "torch_soft_ce", "uniform", "l2r_all", "soft_all"}
    assert table["uniform"]["loss_wall_vs_uniform"] == 1.0 and table["l2r_all"]["step_cpu_ms"] >= 0


def test_scale_bench_measures_each_phase_at_a_given_shape(tmp_path, monkeypatch):
    from experiments.bench import scale

    tiny = dict(scale.SHAPES["qwen3-0.6b"], hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                num_attention_heads=2, num_key_value_heads=1, head_dim=16, vocab_size=64, max_position_embeddings=128)
    monkeypatch.setitem(scale.SHAPES, "tiny", tiny)  # the real shapes are Qwen3's: 0.6B parameters and up
    out = tmp_path / "scale.json"
    report = scale.main(["--shape", "tiny", "--seq-len", "32", "--prompt-len", "8", "--new-tokens", "4",
                         "--block-size", "4", "--drafter-layers", "1", "--num-anchors", "4", "--train-steps", "1",
                         "--repeats", "1", "--out", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(report))
    assert report["command"].endswith("--out " + str(out)) and report["target_config"] == tiny
    assert report["regeneration"]["tokens_per_s"] > 0 and report["prefill"]["tokens"] == 32
    assert report["verification"]["context"] == 32 and report["verification"]["verify_step_s"] > 0
    assert report["train_cached"]["features"] == "cached" and report["train_on_the_fly"]["steps"] == 1


def test_verify_bench_compares_with_assisted_generation_at_each_batch_size(tmp_path):
    from experiments.bench import verify

    out = tmp_path / "verify.json"
    results = verify.main(["--vocab-size", "64", "--hidden-size", "32", "--num-layers", "2", "--num-heads", "2",
                           "--K", "2", "--num-prompts", "2", "--prompt-len", "8", "--max-new-tokens", "6",
                           "--batch-sizes", "1", "2", "--repeats", "1", "--threads", str(torch.get_num_threads()),
                           "--out", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(results))
    assert set(results["batch"]) == {"1", "2"} and results["new_tokens"] == 12
    assert results["identical_to_hf_assisted"] == 2  # greedy: the same tokens as transformers' assisted generation


def test_precision_bench_interleaves_float32_and_bfloat16(tmp_path):
    """Every round times both precisions (and the AdamW variants asked for); medians of the rounds, a profile of the
    bfloat16 step and the CPU's flags in the record. bfloat16 runs anywhere (emulated without the instructions)."""
    from experiments.bench import precision

    out = tmp_path / "bench_precision_bf16.json"
    report = precision.main(["--target", "experiments/assets/tiny_target", "--batch-size", "2", "--seq-len", "24",
                             "--prompt-len", "8", "--num-anchors", "2", "--block-size", "4", "--train-vocab-size", "64",
                             "--train-vocab-negatives", "16", "--rounds", "3", "--steps", "1", "--feature-reps", "1",
                             "--profile-steps", "1", "--optimizers", "fused", "--out", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(report))
    assert set(report["results"]) == {"float32", "bfloat16", "bfloat16+fused"}
    for name, r in report["results"].items():
        assert len(r["rounds"]["blocks_per_s"]) == 3 and r["blocks_per_s"] == round(sorted(r["rounds"]["blocks_per_s"])[1], 4)
        assert r["matmul_gflops"] > 0 and ("feature_pass_tokens_per_s" in r) == (name != "bfloat16+fused")
    assert set(report["bf16_over_fp32"]) == {"matmul_gflops", "blocks_per_s", "feature_pass_tokens_per_s"}
    assert report["profile_bf16_step"] and report["machine"]["cpu"] and "bf16_flags" in report["machine"]
