"""Every primary config and every experiment composes; the README and CI agree; conf/ ships."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from hydra.errors import ConfigCompositionException
from hydra.utils import instantiate

import experiments  # noqa: F401  (registers the ${asset:...} resolver)

ROOT = Path(__file__).resolve().parents[1]
CONF = ROOT / "conf"
PRIMARY = ["train", "evaluate", "regenerate", "train_target", "target_quality", "main"]
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


def test_unknown_group_option_is_a_clear_error():
    with pytest.raises(ConfigCompositionException, match="loss"):
        _compose("train", ["loss=does_not_exist"])


def test_tiny_target_path_points_into_the_package():
    cfg = _compose("train")
    assert Path(cfg.target.path) == ROOT / "experiments" / "assets" / "tiny_target"


def test_readme_gives_two_setup_commands_and_ci_runs_the_test_one():
    readme = (ROOT / "README.md").read_text()
    setup = readme.split("## Set-up", 1)[1].split("\n## ", 1)[0]
    commands = re.findall(r"```bash\n(.+?)\n```", setup, flags=re.DOTALL)
    assert len(commands) == 2, commands
    main_cmd, test_cmd = commands
    assert "experiments.main" in main_cmd and "pytest" in test_cmd
    ci = [line for line in (ROOT / ".ci" / "run").read_text().splitlines() if line and not line.startswith(("#", "set ", "cd "))]
    assert ci == [test_cmd]


def test_conf_is_installed_as_package_data():
    text = (ROOT / "pyproject.toml").read_text()
    assert '"conf*"' in text and '"conf" = ["*.yaml", "**/*.yaml"]' in text
    assert (CONF / "__init__.py").exists()
