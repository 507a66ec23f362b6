"""What a resumed training must share with the run it continues: ``<run dir>/run_settings.json``.

A training (the drafters' :mod:`experiments.pipeline.training`, the assistant's :mod:`experiments.pipeline.assistant`)
writes the settings under its resume keys (dotted prefixes of its resolved config) before it fits; started again
in the same run dir, it resumes only when they are the same, else it refuses and names the differences. The budget
(``train.max_steps`` and what follows from it) may change, as may what does not change the optimisation
(:data:`RESUME_FREE`).
"""

from __future__ import annotations

from pathlib import Path

from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from drafters import storage

FINGERPRINT = "run_settings.json"
# the trainer.precision that resumes a run in the arithmetic it recorded
RESUME_AS = {"bfloat16": "bf16-mixed", "float16": "16-mixed", "float32": "32", "float64": "64"}
# Free under any resume key: the budget, where the recorded answers lie (data.backend.path: a re-clone or worktree;
# the run reads data.data_dir, named by the data settings), and what does not change the optimisation.
RESUME_FREE = ("train.max_steps", "scheduler.max_steps", "target.recipe", "data.regenerate_if_missing",
               "data.features.batch_size", "data.features.head_dtype",  # runs saved before it lack the key
               "data.datamodule.num_workers", "data.datamodule.val_batch_size",
               "data.datamodule.max_val_samples", "drafter.gradient_checkpointing",
               "drafter.allow_other_target", "drafter.allow_edited_settings", "data.backend.path")


def _flatten(obj, prefix: str) -> dict:
    if isinstance(obj, dict):
        out = {}
        for k, v in obj.items():
            out.update(_flatten(v, f"{prefix}.{k}" if prefix else str(k)))
        return out
    return {prefix: obj}


def _not_free(settings: dict) -> dict:
    """``settings`` (flat) without the keys under :data:`RESUME_FREE`, sorted."""
    return {k: v for k, v in sorted(settings.items())
            if not any(k == p or k.startswith(p + ".") for p in RESUME_FREE)}


def run_fingerprint(cfg: DictConfig, keys: tuple[str, ...]) -> dict:
    """The settings of ``cfg`` under ``keys`` (dotted prefixes) a resumed run must keep, flat, minus the free ones."""
    full = _flatten(OmegaConf.to_container(cfg, resolve=True), "")
    return _not_free({k: v for k, v in full.items() if any(k == p or k.startswith(p + ".") for p in keys)})


def choices() -> dict:
    """The config group choices of the resumable sections (``loss: uniform``), for messages."""
    if not HydraConfig.initialized():
        return {}
    return {k: v for k, v in HydraConfig.get().runtime.choices.items() if k in ("target", "drafter", "loss", "data")}


def write(run_dir: Path, cfg: DictConfig, keys: tuple[str, ...], precision: str | None, resumed: bool) -> None:
    """Record ``cfg``'s settings under ``keys`` and the arithmetic it trains in (``precision``: not where a resumed
    run's record has none, as from before the key: what it trained in before is not known)."""
    path = run_dir / FINGERPRINT
    if resumed and path.is_file() and "precision" not in storage.read_json(path, "run settings"):
        precision = None
    record = {"choices": choices(), "settings": run_fingerprint(cfg, keys)}
    storage.write_json_atomic(path, record | ({"precision": precision} if precision else {}))


def check(run_dir: Path, cfg: DictConfig, keys: tuple[str, ...], precision: str | None = None) -> None:
    """Refuse to resume ``run_dir`` with other settings under ``keys`` than it trained with, or in another
    ``precision`` (``trainer.precision=auto`` resolves by the CPU), naming them. A run from before the record: accepted
    (and recorded by the resumed training)."""
    path = run_dir / FINGERPRINT
    if not path.is_file():
        return
    saved = storage.read_json(path, "run settings")
    old, new = _not_free(saved.get("settings", {})), run_fingerprint(cfg, keys)  # saved before a key was freed: freed
    now = choices()
    changed = {k: (v, now.get(k)) for k, v in (saved.get("choices") or {}).items() if v != now.get(k)}
    diffs = [f"{k}: {old.get(k, '<unset>')!r} -> {new.get(k, '<unset>')!r}"
             for k in sorted(set(old) | set(new)) if old.get(k) != new.get(k)]
    was = saved.get("precision")
    if was is not None and precision is not None and was != precision:
        raise ValueError(f"{run_dir} trained in {was} and would resume in {precision} (trainer.precision="
                         f"{cfg.trainer.get('precision')} on this CPU; a drafter would read the other feature cache): "
                         f"resume it with trainer.precision={RESUME_AS.get(was, '32')}, or choose another name=")
    if diffs:
        raise ValueError(f"{run_dir} was trained with other settings; a resumed run keeps the settings it trained "
                         f"with (only the budget, train.max_steps, may change)"
                         + "".join(f" ({k}: {a} -> {b})" for k, (a, b) in changed.items()) + ". Differences "
                         f"(saved -> now): {'; '.join(diffs[:8])}{' ...' if len(diffs) > 8 else ''}. "
                         f"Choose another name=, or delete {run_dir} to start over")
