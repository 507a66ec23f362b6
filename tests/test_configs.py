"""Every primary config and every experiment composes; the README and CI agree; conf/ ships."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from hydra.errors import ConfigCompositionException
from hydra.utils import instantiate
from omegaconf import OmegaConf

import experiments  # noqa: F401  (registers the ${asset:...} resolver)

ROOT = Path(__file__).resolve().parents[1]
CONF = ROOT / "conf"
PRIMARY = ["train", "evaluate", "regenerate", "train_target", "target_quality", "main", "long", "export",
           "train_assistant"]
EXPERIMENTS = sorted(p.stem for p in (CONF / "experiment").glob("*.yaml"))


def _compose(name: str, overrides: list[str] | None = None):
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose(config_name=name, overrides=overrides or [], return_hydra_config=True)


@pytest.mark.parametrize("name", PRIMARY)
def test_primary_configs_compose(name):
    cfg = _compose(name)
    assert "hydra" in cfg and cfg.hydra.run.dir


@pytest.mark.parametrize("experiment", EXPERIMENTS)
def test_every_experiment_composes(experiment):
    cfg = _compose("train", [f"experiment={experiment}"])
    assert cfg.loss._target_ == "losses.AcceptanceAlignedLoss"
    assert cfg.drafter.block_size >= 2


@pytest.mark.parametrize("loss", sorted(p.stem for p in (CONF / "loss").glob("*.yaml")))
def test_every_loss_config_instantiates(loss):
    cfg = _compose("train", [f"loss={loss}"])
    module = instantiate(cfg.loss)
    assert module.__class__.__name__ == "AcceptanceAlignedLoss"


@pytest.mark.parametrize("choice", sorted(p.stem for p in (CONF / "eval" / "drafter").glob("*.yaml")))
def test_evaluation_drafters_compose(choice):
    """``experiments.evaluate drafter=<choice>``: every evaluation drafter names a builder; the baselines
    need no path (ar_assistant defaults to the shipped assistant) and name their report row."""
    cfg = _compose("evaluate", [f"drafter={choice}"])
    builder = {"block": "block_drafter", "tree": "tree_drafter", "hybrid": "tree_drafter"}.get(choice, choice)
    assert cfg.drafter._target_ == f"experiments.pipeline.eval_drafters.{builder}"
    if choice in ("block", "tree", "hybrid"):  # a trained block drafter, named by path
        assert OmegaConf.is_missing(cfg.drafter, "path") and cfg.drafter.name == (None if choice != "hybrid" else choice)
    else:
        assert cfg.drafter.name == choice and cfg.drafter.num_draft_tokens == 15
    if choice == "ar_assistant":
        assert Path(cfg.drafter.path) == ROOT / "experiments" / "assets" / "ar_assistant"
        assert (Path(cfg.drafter.path) / "model.safetensors").is_file()
    assert list(_compose("main_tiny").baselines) == ["prompt_lookup", "ar_assistant", "corpus_lookup"]
    assert set(_compose("main").baselines) == {"prompt_lookup", "ar_assistant"}


def test_unknown_group_option_is_a_clear_error():
    with pytest.raises(ConfigCompositionException, match="loss"):
        _compose("train", ["loss=does_not_exist"])


def test_tiny_target_path_points_into_the_package():
    cfg = _compose("train")
    assert Path(cfg.target.path) == ROOT / "experiments" / "assets" / "tiny_target"


def test_data_cache_folder_names_the_target_files_not_their_place(tmp_path):
    """A copy of the target elsewhere (a re-clone, a worktree) finds the same regenerated-data folder and passes
    the signature check; changed weights or config name another folder."""
    import shutil

    from experiments.data.target import target_signature

    src = ROOT / "experiments" / "assets" / "tiny_target"
    copy = tmp_path / "elsewhere" / "tiny_target"
    shutil.copytree(src, copy)

    def data_dir(path):
        return _compose("regenerate", [f"target.path={path}"]).data.data_dir

    assert data_dir(copy) == data_dir(src) and target_signature(copy) == target_signature(src)
    assert str(tmp_path) not in data_dir(copy)
    weights = copy / "model.safetensors"
    raw = bytearray(weights.read_bytes())
    raw[-1] ^= 0xFF  # the last weight's last byte
    weights.write_bytes(bytes(raw))
    assert data_dir(copy) != data_dir(src) and target_signature(copy) != target_signature(src)
    shutil.copy(src / "model.safetensors", weights)
    (copy / "config.json").write_text((src / "config.json").read_text().replace("}", ', "extra": 1}', 1))
    assert data_dir(copy) != data_dir(src)


def test_signatures_recorded_with_the_folder_still_match(tmp_path):
    """Data regenerated before signatures left out the folder recorded its path, weight sizes and mtimes: it still
    matches the same files (wherever they are now) on config.json and weight sizes, and not other files."""
    import hashlib

    from experiments.data.target import signature_matches, target_signature

    src = ROOT / "experiments" / "assets" / "tiny_target"
    legacy = {"path": "/elsewhere/tiny_target",
              "config_sha1": hashlib.sha1((src / "config.json").read_bytes()).hexdigest(),
              "weights": {"model.safetensors": [(src / "model.safetensors").stat().st_size, 12345]}}
    assert signature_matches(legacy, str(src)) and signature_matches(target_signature(str(src)), str(src))
    assert not signature_matches({**legacy, "config_sha1": "0" * 40}, str(src))
    assert not signature_matches({**legacy, "weights": {"model.safetensors": [1, 12345]}}, str(src))
    assert not signature_matches({}, str(src)) and json.dumps(target_signature(str(src))).find("tiny_target") == -1


def test_readme_gives_two_setup_commands_and_ci_runs_the_test_one():
    readme = (ROOT / "README.md").read_text()
    setup = readme.split("## Set-up", 1)[1].split("\n## ", 1)[0]
    commands = re.findall(r"```bash\n(.+?)\n```", setup, flags=re.DOTALL)
    assert len(commands) == 2, commands
    main_cmd, test_cmd = commands
    assert "experiments.main" in main_cmd and "pytest" in test_cmd
    ci = [line for line in (ROOT / ".ci" / "run").read_text().splitlines() if line and not line.startswith(("#", "set ", "cd "))]
    assert ci[-1] == test_cmd  # what a newcomer types, run last
    setup_lines = "\n".join(ci[:-1])  # before it: a new, empty temporary folder and cache, as on a new machine
    assert 'fresh="$(mktemp -d' in setup_lines and 'export TMPDIR="$fresh/tmp" BLOCKDRAFT_CACHE="$fresh/cache"' in setup_lines


def test_conf_is_installed_as_package_data():
    text = (ROOT / "pyproject.toml").read_text()
    assert '"conf*"' in text and '"conf" = ["*.yaml", "**/*.yaml"]' in text
    assert (CONF / "__init__.py").exists()


def test_the_wheel_ships_assets_not_results():
    """Package data is the configs and the shipped models only (no setuptools guess from an old egg-info)."""
    text = (ROOT / "pyproject.toml").read_text()
    package_data = text.split("[tool.setuptools.package-data]", 1)[1].split("\n[", 1)[0]
    assert '"experiments" = ["assets/**/*"]' in package_data and "results" not in package_data
    assert re.search(r"^include-package-data = false", text, flags=re.MULTILINE)


@pytest.mark.parametrize("package", ["transformers", "torch"])
def test_the_installed_versions_lie_in_the_stated_range(package):
    """pyproject.toml bounds transformers and torch on both sides, and the versions the tests run on lie inside."""
    from importlib.metadata import version

    from packaging.requirements import Requirement
    from packaging.version import Version

    text = (ROOT / "pyproject.toml").read_text()
    (spec,) = re.findall(rf'^    "({package}[^"]*)",$', text, flags=re.MULTILINE)
    requirement = Requirement(spec)
    assert {s.operator for s in requirement.specifier} == {">=", "<"}, spec
    assert Version(Version(version(package)).base_version) in requirement.specifier, (version(package), spec)


def _sweep_jobs(experiment: str, arguments: list[str]) -> list[dict[str, str]]:
    """The jobs Hydra's basic sweeper launches for ``experiment`` plus command-line ``arguments``."""
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.override_parser.overrides_parser import OverridesParser

    cfg = _compose("train", [f"experiment={experiment}"])
    params = [f"{k}={v}" for k, v in cfg.hydra.sweeper.params.items()]
    overrides = OverridesParser.create().parse_overrides(params + arguments)
    (batch,) = BasicSweeper.split_arguments(overrides, None)
    return [dict(o.split("=", 1) for o in job) for job in batch]


def test_ablation_sweeps_every_loss_and_command_line_seeds():
    jobs = _sweep_jobs("l2r_ablation_tiny", [])
    losses = [j["loss"] for j in jobs]
    assert losses == ["uniform", "decay", "focal", "chain", "decay_focal", "l2r_all", "dpace", "soft_all"]
    assert {j["seed"] for j in jobs} == {"0"}
    assert all((CONF / "loss" / f"{loss}.yaml").is_file() for loss in losses)
    # the README / config comment: `seed=0,1,2` on the command line repeats every loss per seed
    jobs = _sweep_jobs("l2r_ablation_tiny", ["seed=0,1,2", "loss=uniform,l2r_all"])
    assert sorted((j["loss"], j["seed"]) for j in jobs) == sorted(
        (loss, s) for loss in ("uniform", "l2r_all") for s in "012")
    cfg = _compose("train", ["experiment=l2r_ablation_tiny"])
    subdir = OmegaConf.to_container(cfg.hydra.sweep, resolve=False)["subdir"]
    assert subdir == "${hydra:runtime.choices.loss}-s${seed}"  # one dir per (loss, seed)


SWEEPS = [("l2r_sweep_chain", "chain", "loss.chain_weight"), ("l2r_sweep_focal", "focal", "loss.focal_gamma"),
          ("l2r_sweep_gamma", "decay", "loss.gamma")]


@pytest.mark.parametrize("experiment,loss,key", SWEEPS)
def test_sweeps_vary_their_loss_key(experiment, loss, key):
    """Each loss sweep trains values other than its loss's default (the ablation's own run), each at 2 seeds."""
    jobs = _sweep_jobs(experiment, [])
    values = {j[key] for j in jobs}
    default = OmegaConf.select(_compose("train", ["experiment=l2r_ablation", f"loss={loss}"]), key)
    assert len(values) >= 2 and all(float(v) != float(default) for v in values)
    assert sorted((j[key], j["seed"]) for j in jobs) == sorted((v, s) for v in values for s in ("0", "1"))
    job = jobs[0]
    cfg = _compose("train", [f"experiment={experiment}", f"{key}={job[key]}", f"seed={job['seed']}"])
    assert str(OmegaConf.select(cfg, key)) == job[key]
    leaf = key.split(".")[-1]
    assert cfg.name == f"{experiment}-{leaf}{job[key]}-s{job['seed']}"


REGIME_KEYS = ["data", "train.max_steps", "optimizer", "scheduler", "suite", "evaluate.enabled"]


def _regime(cfg) -> dict:
    values = {k: OmegaConf.select(cfg, k) for k in REGIME_KEYS}
    return {k: OmegaConf.to_container(v) if OmegaConf.is_config(v) else v for k, v in values.items()}


@pytest.mark.parametrize("experiment", ["layerwise", "hinted", "hinted_store"])
def test_sweeps_share_the_ablations_regime(experiment):
    ablation = _regime(_compose("train", ["experiment=l2r_ablation_tiny"]))
    assert _regime(_compose("train", [f"experiment={experiment}"])) == ablation


@pytest.mark.parametrize("experiment,loss,key", SWEEPS)
def test_sweeps_run_at_the_smollm2_ablations_regime(experiment, loss, key):
    """The three loss sweeps are experiment=l2r_ablation's training (the main job's drafter, data, budget) with one
    loss, whose key they vary, into their own run folders; the queue names the run dirs as the sweep does."""
    sweep = _compose("train", [f"experiment={experiment}"])
    ablation = _compose("train", ["experiment=l2r_ablation", f"loss={loss}"])
    assert _regime(sweep) == _regime(ablation)
    for part in ("target", "drafter", "module", "loss"):
        assert OmegaConf.to_container(OmegaConf.select(sweep, part), resolve=True) == \
            OmegaConf.to_container(OmegaConf.select(ablation, part), resolve=True), part
    assert {j["loss"] for j in _sweep_jobs(experiment, [])} == {loss}
    leaf = key.split(".")[-1]
    assert OmegaConf.to_container(sweep.hydra.sweep, resolve=False)["subdir"] == f"{leaf}${{{key}}}-s${{seed}}"
    assert sweep.hydra.sweep.dir.endswith(f"multirun/{experiment}")
    from experiments.ablation_report import SWEEPS as REPORTED

    assert REPORTED[experiment.removeprefix("l2r_sweep_")] == (loss, leaf)  # the report reads the same runs
    script = (ROOT / "experiments" / "ablation_queue.sh").read_text()
    (line,) = re.findall(rf"sweep {experiment.rsplit('_', 1)[1]} {leaf} \"\$seed\" ([\d. ]+)", script)
    assert sorted(line.split()) == sorted({j[key] for j in _sweep_jobs(experiment, [])})


def test_the_tiny_main_jobs_drafters_are_evaluated_as_deep_frozen_evaluates_at_the_end_of_training():
    """conf/main_tiny.yaml's trained_evaluate_overrides (experiments.evaluate's drafter.<key>=...) and
    experiment=deep_frozen's evaluate.drafter (the training run's own evaluation) are the same settings."""
    main = _compose("main_tiny")
    overrides = dict(o.split("=", 1) for o in main.trained_evaluate_overrides)
    settings = OmegaConf.to_container(_compose("train", ["experiment=deep_frozen"]).evaluate.drafter)
    assert {f"drafter.{k}": str(v) for k, v in settings.items()} == overrides


def test_the_main_jobs_drafters_are_core_dflash_drafters():
    """conf/main.yaml's experiment trains small core DFlash drafters: no hints, store, copied layers or anchor
    variants (so each exports to the DFlash format), on the recorded answers, with a candidate training vocabulary."""
    main = _compose("main")
    trained = _compose("train", [f"experiment={main.train_experiment}"])
    drafter = trained.drafter
    assert drafter._target_ == "drafters.factory.from_target" and drafter.num_layers <= 2
    assert not any(drafter.get(k) for k in ("lookup_hints", "store_hints", "causal_anchor", "frozen_anchor",
                                            "refine_passes", "init_from"))
    assert trained.data.backend._target_.endswith("RecordedBackend") and trained.module.train_vocab_size == 8192
    assert trained.target.name == "smollm2"
    data = _compose("regenerate", [f"experiment={main.train_experiment}"])  # the main job's data stage
    assert data.data.generation == trained.data.generation and data.batch_size == trained.regenerate.batch_size


@pytest.mark.parametrize("experiment", ["l2r_ablation_tiny", "l2r_long", "layerwise", "hinted", "hinted_store"])
def test_regime_experiments_end_in_a_report_with_the_baseline_rows(experiment):
    """conf/regime/ablation.yaml makes each of its experiments a multirun whose report carries the untrained
    baselines."""
    hydra_cfg = _compose("train", [f"experiment={experiment}"]).hydra
    report = hydra_cfg.callbacks.report
    assert str(hydra_cfg.mode) == "RunMode.MULTIRUN"
    assert report._target_ == "experiments.reporting.callback.MultirunReport"
    assert list(report.baselines) == ["prompt_lookup", "ar_assistant", "corpus_lookup"]
    assert report.baseline == "uniform" and not report.get("name_by_dir", False)


def test_the_deep_drafter_is_hinted_store_with_every_target_layer():
    """experiment=deep_store: hinted_store's drafter, data and suites, with drafter.num_layers the target's
    depth (resolved from its config.json, 6 for the embedded target), the causal anchor and its own budget (lr 1e-4,
    300 steps); experiment=deep_frozen: the same with the anchor frozen."""
    deep = _compose("train", ["experiment=deep_store"])
    store = _compose("train", ["experiment=hinted_store"])
    depth = json.loads((Path(OmegaConf.select(deep, "target.path")) / "config.json").read_text())["num_hidden_layers"]
    assert deep.drafter.num_layers == depth == 6
    deep_drafter = OmegaConf.to_container(deep.drafter, resolve=True)
    assert deep_drafter["variants"].pop("anchor") == {"frozen": False}
    assert {**deep_drafter, "num_layers": 2} == OmegaConf.to_container(store.drafter, resolve=True)
    assert set(store.drafter.variants) == {"layerwise", "hints", "store_hints"}
    for key in ("data", "suite", "evaluate.enabled"):
        assert _regime(deep)[key] == _regime(store)[key], key
    assert (deep.train.max_steps, deep.optimizer.lr) == (300, 1.0e-4)
    frozen = _compose("train", ["experiment=deep_frozen"])
    frozen_drafter = OmegaConf.to_container(frozen.drafter, resolve=True)
    assert frozen_drafter["variants"].pop("anchor") == {"frozen": True}
    assert frozen_drafter == deep_drafter
    for key in ("data", "suite", "train.max_steps", "optimizer", "scheduler"):
        assert _regime(frozen)[key] == _regime(deep)[key], key


def test_target_depth_reads_the_config_or_names_the_path(tmp_path):
    from experiments.data.target import target_depth

    (tmp_path / "config.json").write_text(json.dumps({"num_hidden_layers": 5}))
    assert target_depth(str(tmp_path)) == 5
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(ValueError, match=re.escape(f"target.path={tmp_path}")):
        target_depth(str(tmp_path))


def test_the_long_run_lengthens_the_regime():
    ablation = _regime(_compose("train", ["experiment=l2r_ablation_tiny"]))
    long = _regime(_compose("train", ["experiment=l2r_long"]))
    assert long["suite"] == ablation["suite"] and long["data"]["backend"] == ablation["data"]["backend"]
    assert long["train.max_steps"] > ablation["train.max_steps"]
    assert long["data"]["generation"]["prompts"]["per_source"] > ablation["data"]["generation"]["prompts"]["per_source"]


VARIANTS = sorted(p.stem for p in (CONF / "drafter" / "variant").glob("*.yaml"))
# The registered variants (drafters.variants.REGISTRY) each config composes: its own and those it needs.
VARIANT_NAMES = {"layerwise": {"layerwise"}, "hints": {"hints"}, "store_hints": {"hints", "store_hints"},
                 "causal_anchor": {"anchor"}, "frozen_anchor": {"anchor", "layerwise"}, "refine": {"refine"}}


def _built(cfg, num_layers: int = 3):
    from conftest import tiny_target

    torch.manual_seed(0)
    return instantiate(cfg.drafter)(tiny_target(num_layers=num_layers))


@pytest.mark.parametrize("variant", VARIANTS)
def test_every_drafter_variant_config_composes_over_the_core_by_name(variant):
    """``drafter=dflash +drafter/variant=<name>``: the config adds its variants' options (and those of the variants
    it needs) under ``drafter.variants``, and the drafter built is the core composed with exactly those."""
    from drafters.variants import REGISTRY

    cfg = _compose("train", ["drafter=dflash", f"+drafter/variant={variant}", "drafter.block_size=4"])
    assert set(cfg.drafter.variants) == VARIANT_NAMES[variant]
    assert _compose("train", ["drafter.block_size=4"]).drafter.variants == {}  # the core names none
    drafter = _built(cfg)
    assert set(drafter.variant_names) == VARIANT_NAMES[variant]
    assert all(isinstance(drafter.variants[n], REGISTRY[n]) for n in VARIANT_NAMES[variant])
    assert drafter.config.block_size == 4 and drafter.config.num_layers == 1


def test_variant_configs_compose_as_a_list_with_their_options_and_over_an_experiment():
    """``+drafter/variant=[layerwise,refine]`` composes both, an option is one more override, and an
    experiment's variants keep theirs when the command line adds one."""
    cfg = _compose("train", ["+drafter/variant=[layerwise,refine]", "drafter.variants.refine.passes=2",
                             "drafter.num_layers=2", "drafter.block_size=4"])
    drafter = _built(cfg)
    assert drafter.variant_names == ("refine", "layerwise")
    assert drafter.variants["refine"].passes == 2 and drafter.variants["layerwise"].shifted
    assert drafter.config.target_layer_ids == (0, 1) and drafter.config.qk_norm is False
    store = _compose("train", ["experiment=hinted_store", "+drafter/variant=refine"])
    assert set(store.drafter.variants) == {"layerwise", "hints", "store_hints", "refine"}
    assert store.drafter.num_layers == 2 and store.drafter.init_layers_from_target


def test_the_flat_switches_of_older_configs_are_refused_naming_the_variant():
    """One spelling: a config that spells a variant as an older flat switch (``lookup_hints``, ...) is refused,
    naming the variant to use (saved configs with them are read by drafters.factory.upgrade_saved_config)."""
    flat = _compose("train", ["drafter=layerwise", "+drafter.lookup_hints=true", "drafter.block_size=4"])
    with pytest.raises(ValueError, match=r"flat switches.*lookup_hints -> variants.hints"):
        _built(flat)


def _experiment_defaults(name: str) -> list:
    import yaml

    return yaml.safe_load((CONF / "experiment" / f"{name}.yaml").read_text()).get("defaults", [])


def _experiment_bases(name: str) -> list[str]:
    """The experiments ``name`` builds on: its defaults that are plain names (an absolute path such as
    ``/drafter/variant/store_hints`` includes a config of another group)."""
    return [d for d in _experiment_defaults(name) if isinstance(d, str) and d != "_self_" and not d.startswith("/")]


@pytest.mark.parametrize("experiment", EXPERIMENTS)
def test_experiments_state_the_science_and_launch_apart(experiment):
    """An experiment file sets no run mode or callback (conf/launch/ does), and builds on at most one other
    experiment, which builds on none (a regime, a drafter or a loss it may include)."""
    import yaml

    doc = yaml.safe_load((CONF / "experiment" / f"{experiment}.yaml").read_text())
    assert not {"mode", "callbacks"} & set(doc.get("hydra", {})), experiment
    bases = _experiment_bases(experiment)
    assert len(bases) <= 1 and not any(_experiment_bases(b) for b in bases)


def test_launch_run_makes_a_sweep_experiment_one_run():
    """``experiment=deep_frozen launch=run``: the same training config as the sweep's, run once, without the report
    (what a caller such as the main job names instead of restating the experiment)."""
    sweep = _compose("train", ["experiment=deep_frozen"])
    single = _compose("train", ["experiment=deep_frozen", "launch=run"])
    assert str(sweep.hydra.mode) == "RunMode.MULTIRUN" and "report" in sweep.hydra.callbacks
    assert single.hydra.mode in (None, "RUN") or str(single.hydra.mode) == "RunMode.RUN"
    assert "report" not in (single.hydra.callbacks or {})
    for key in ("drafter", "evaluate", "train", "optimizer", "data", "suite"):
        assert OmegaConf.to_container(OmegaConf.select(single, key)) == \
            OmegaConf.to_container(OmegaConf.select(sweep, key)), key
