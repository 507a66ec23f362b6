"""trainer.precision=auto: bfloat16 autocast where the CPU has bfloat16 instructions, float32 elsewhere; bfloat16
refused on a CPU without them; a feature cache of another precision computed again, never mixed; a tiny training
run under bf16-mixed (where this CPU has the instructions: skipped elsewhere).

conftest.py makes every test see a CPU without the flags (``BLOCKDRAFT_CPU_FLAGS`` empty); these tests set the
flags they need, so none depends on this machine's instruction set except the last, through its skip."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import tiny_target
from omegaconf import OmegaConf
from test_features import LAYERS, make_rows
from test_train import offline_env, run_main, save_target

from drafters.storage import read_checkpoint
from drafters.training.features import FeatureStore, compute_features, features_dir, read_features_meta
from experiments import regenerate, train
from experiments.pipeline import trainer as tr

NO_BF16 = frozenset({"fpu", "sse2", "avx2", "fma"})


@pytest.fixture
def flags(monkeypatch):
    """``flags(names)``: the flag reader returns these names (as /proc/cpuinfo would)."""
    def use(names):
        monkeypatch.setattr(tr, "cpu_flags", lambda: frozenset(names))
    return use


@pytest.mark.parametrize("names, want", [(NO_BF16, "32-true"), (NO_BF16 | {"avx512_bf16"}, "bf16-mixed"),
                                         (NO_BF16 | {"amx_bf16", "avx512_bf16"}, "bf16-mixed")])
def test_auto_is_bf16_only_where_the_cpu_has_the_instructions(flags, names, want):
    flags(names)
    assert tr.resolve_precision("auto", "cpu") == want
    assert tr.resolve_precision("32", "cpu") == "32"  # float32 on request, whatever the CPU
    cfg = OmegaConf.create({"trainer": {"accelerator": "cpu", "precision": "auto"}})
    record = tr.precision_record(cfg)
    assert record["requested"] == "auto" and record["resolved"] == want
    assert record["cpu_bf16_flags"] == [f for f in tr.BF16_FLAGS if f in names]


@pytest.mark.parametrize("value", ["bf16-mixed", "bf16-true"])
def test_bf16_on_a_cpu_without_the_instructions_is_refused_in_one_line(flags, value):
    flags(NO_BF16)
    with pytest.raises(ValueError) as error:
        tr.resolve_precision(value, "cpu")
    message = str(error.value)
    assert "\n" not in message and f"trainer.precision={value}" in message
    assert "avx512_bf16" in message and "amx_bf16" in message and "trainer.precision=auto" in message
    assert tr.resolve_precision(value, "gpu") == value  # a GPU's bfloat16 is not the CPU's business
    flags(NO_BF16 | {"avx512_bf16"})
    assert tr.resolve_precision(value, "cpu") == value


def test_the_flag_reader(tmp_path, monkeypatch):
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nmodel name\t: Some CPU\nflags\t\t: fpu avx2 avx512f avx512_bf16\n\n"
                    "processor\t: 1\nflags\t\t: fpu avx2 avx512f avx512_bf16\n")
    assert tr.cpuinfo_flags(info) == {"fpu", "avx2", "avx512f", "avx512_bf16"}
    assert tr.cpuinfo_flags(tmp_path / "absent") == frozenset()
    monkeypatch.setenv(tr.FLAGS_ENV, "avx2,amx_bf16 avx512_bf16")  # the override a user (or conftest) sets
    assert tr.bf16_flags() == ["amx_bf16", "avx512_bf16"] and tr.resolve_precision("auto") == "bf16-mixed"
    monkeypatch.setenv(tr.FLAGS_ENV, "")
    assert tr.bf16_flags() == [] and tr.resolve_precision("auto") == "32-true"


def test_a_feature_cache_of_another_precision_is_named_and_computed_again(tmp_path, capsys):
    """A float32 cache asked for in bfloat16 (and back) is recomputed whole, its meta says which; a cache written
    before precisions were recorded counts as float32. The pipeline's folders differ by precision anyway."""
    target = tiny_target("llama", vocab_size=64, hidden_size=64, init_range=0.2)
    rows = [r["input_ids"] for r in make_rows(5)]
    root = tmp_path / "f"
    compute_features(target, rows, root, target_layer_ids=LAYERS, dtype="float32", rows_per_part=2, progress=False)
    exact = FeatureStore(root)
    exact = [exact[i] for i in range(5)]
    meta = read_features_meta(root)
    assert meta["precision"] == "float32"
    (root / "meta.json").write_text(json.dumps({k: v for k, v in meta.items() if k != "precision"}))  # an old one
    stamps = {p.name: p.stat().st_mtime_ns for p in root.glob("part-*")}
    compute_features(target, rows, root, target_layer_ids=LAYERS, dtype="float32", rows_per_part=2, progress=False)
    assert {p.name: p.stat().st_mtime_ns for p in root.glob("part-*")} == stamps  # float32 already: kept
    capsys.readouterr()

    compute_features(target, rows, root, target_layer_ids=LAYERS, dtype="float32", rows_per_part=2, progress=False,
                     precision="bfloat16")
    assert f"{root} was computed in float32, this run's feature pass is bfloat16" in capsys.readouterr().out
    store = FeatureStore(root)
    assert store.meta["precision"] == "bfloat16" and store.meta["complete"]
    assert all(p.stat().st_mtime_ns != stamps[p.name] for p in root.glob("part-*"))  # every part, none kept
    rounded = [store[i] for i in range(5)]
    assert any(not torch.equal(a, b) for a, b in zip(rounded, exact))  # computed in bfloat16 ...
    for a, b in zip(rounded, exact):  # ... and close to float32 (bfloat16 keeps 8 significant bits)
        assert float((a - b).norm() / b.norm()) < 0.02

    compute_features(target, rows, root, target_layer_ids=LAYERS, dtype="float32", rows_per_part=2, progress=False)
    assert "was computed in bfloat16, this run's feature pass is float32" in capsys.readouterr().out
    store = FeatureStore(root)
    assert store.meta["precision"] == "float32" and all(torch.equal(store[i], exact[i]) for i in range(5))
    assert features_dir(tmp_path, LAYERS, "float16", 512, "bfloat16").name == "layers-1-2_float16_len512_bf16"
    assert features_dir(tmp_path, LAYERS, "float16", 512).name == "layers-1-2_float16_len512"
    with pytest.raises(ValueError, match="precision"):
        features_dir(tmp_path, LAYERS, "float16", 512, "float16")


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    root = tmp_path_factory.mktemp("precision")
    with pytest.MonkeyPatch.context() as mp:
        offline_env(mp, root)
        target = save_target(root / "target")
        base = ["target=hf", f"target.path={target}", "experiment=smoke", "train.max_steps=3", "train.val_every=3"]
        run_main(regenerate, [*base, "suite=[humaneval,gsm_symbolic]", "shard_size=5"])
        yield {"root": root, "base": base}


def _summary(env, name: str) -> dict:
    return json.loads((env["root"] / "runs" / "train" / name / "train_summary.json").read_text())


@pytest.mark.slow
@pytest.mark.e2e
def test_auto_trains_in_float32_without_the_flags_and_bf16_is_refused_first(env, monkeypatch, capsys):
    run_main(train, [*env["base"], "name=auto32"])
    precision = _summary(env, "auto32")["precision"]
    assert precision["requested"] == "auto" and precision["resolved"] == "32-true"
    assert precision["cpu_bf16_flags"] == [] and precision["feature_pass"] == "float32"
    with pytest.raises(ValueError, match="trainer.precision=bf16-mixed: this CPU has neither amx_bf16 nor avx512_bf16"):
        run_main(train, [*env["base"], "name=refused", "trainer.precision=bf16-mixed"])
    assert not (env["root"] / "runs" / "train" / "refused" / "checkpoints").exists()


@pytest.mark.slow
@pytest.mark.e2e
@pytest.mark.skipif(not set(tr.BF16_FLAGS) & tr.cpuinfo_flags(),
                    reason="this CPU has neither amx_bf16 nor avx512_bf16: bfloat16 would be emulated")
def test_a_tiny_training_run_under_bf16_mixed(env, monkeypatch):
    """Where this CPU has the instructions: auto trains under bf16 autocast, its features computed in bfloat16 into
    their own folder, and the drafter's weights stay float32; the run resumes."""
    monkeypatch.setenv(tr.FLAGS_ENV, " ".join(tr.cpuinfo_flags()))
    run_main(train, [*env["base"], "name=bf16"])
    summary = _summary(env, "bf16")
    assert summary["precision"]["resolved"] == "bf16-mixed" and summary["precision"]["feature_pass"] == "bfloat16"
    assert summary["steps"] == 3 and 1.0 <= summary["val"]["val/tau_greedy"]
    assert all(torch.isfinite(torch.tensor(v)) for v in summary["val"].values())
    caches = {p.name: read_features_meta(p)["precision"] for p in (env["root"] / "cache").glob("regen/*/*/features/*")}
    assert caches and all(v == ("bfloat16" if k.endswith("_bf16") else "float32") for k, v in caches.items())
    assert any(k.endswith("_bf16") for k in caches)
    weights = read_checkpoint(env["root"] / "runs" / "train" / "bf16" / "checkpoints" / "last.ckpt")["state_dict"]
    assert all(v.dtype == torch.float32 for k, v in weights.items() if k.startswith("drafter.") and v.is_floating_point())
    run_main(train, [*env["base"], "name=bf16", "train.max_steps=4"])
    assert _summary(env, "bf16")["steps"] == 4


def test_a_run_resumes_only_in_the_precision_it_trained_in(tmp_path, flags):
    """run_settings.json records the arithmetic a run trained in; resumed where trainer.precision resolves to the
    other (auto on another CPU) it is refused, naming both and the setting that resumes it; a record from before the
    key resumes as it did."""
    from experiments.pipeline import run_settings
    from experiments.pipeline.trainer import arithmetic
    from experiments.pipeline.training import RESUME_KEYS

    def check():
        run_settings.check(tmp_path, cfg, RESUME_KEYS, arithmetic(cfg))

    cfg = OmegaConf.create({"trainer": {"accelerator": "cpu", "precision": "auto"}})
    (tmp_path / run_settings.FINGERPRINT).write_text(json.dumps({"choices": {}, "settings": {},
                                                                  "precision": "bfloat16"}))
    flags(NO_BF16 | {"avx512_bf16"})
    check()
    flags(NO_BF16)
    with pytest.raises(ValueError, match=r"trained in bfloat16 and would resume in float32 \(trainer.precision=auto "
                                         r"on this CPU;.* trainer.precision=bf16-mixed"):
        check()
    (tmp_path / run_settings.FINGERPRINT).write_text(json.dumps({"choices": {}, "settings": {}}))
    check()
    run_settings.write(tmp_path, cfg, RESUME_KEYS, arithmetic(cfg), resumed=True)  # what it trained in is not known
    assert "precision" not in json.loads((tmp_path / run_settings.FINGERPRINT).read_text())
    cfg.trainer.precision = "16-mixed"  # float16 is not float32: a switch either way is refused
    run_settings.write(tmp_path, cfg, RESUME_KEYS, arithmetic(cfg), resumed=False)
    cfg.trainer.precision = "32-true"
    with pytest.raises(ValueError, match=r"trained in float16 and would resume in float32.* trainer.precision=16-mixed"):
        check()


def test_a_shipped_cards_training_names_its_precision(tmp_path):
    from test_ship import RECORD, _long_run

    from experiments.pipeline.ship import ship_drafter

    run, evaluation, _ = _long_run(tmp_path)
    summary = json.loads((run / "train_summary.json").read_text())
    precision = {"requested": "auto", "resolved": "bf16-mixed", "cpu_bf16_flags": ["avx512_bf16"], "isa": "AVX512",
                 "feature_pass": "bfloat16"}
    (run / "train_summary.json").write_text(json.dumps({**summary, "precision": precision}))
    out = ship_drafter(run / "drafter", evaluation, tmp_path / "card", RECORD, name="bf16", command="train")
    assert json.loads((out / "card.json").read_text())["training"]["precision"] == precision
    assert "precision bf16-mixed from trainer.precision=auto, CPU: avx512_bf16" in (out / "README.md").read_text()
