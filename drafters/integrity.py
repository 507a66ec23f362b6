"""What a saved drafter was saved as, recorded beside it and checked when it is loaded (issue 49).

Saving a drafter (:meth:`drafters.model.DFlashDrafter.save_pretrained`) and exporting it
(:func:`drafters.dflash.export_dflash`) write :data:`RECORD_NAME` next to ``config.json``::

    {"weights_sha256": {"model.safetensors": "<sha256 of the file>", ...},
     "files_sha256": {"config.json": "<sha256>", "card.json": "<sha256>"},
     "settings": {<the config.json fields that define the drafter, as it was trained>}}

(a sidecar file: servers such as vLLM read ``config.json`` and ``model.safetensors`` only). Loading
(:func:`drafters.factory.load`, both formats) calls :func:`check_saved_record` with the settings of the drafter
it read, in the record's spelling:

* a weights file whose sha256 is not the recorded one (another drafter's weights of the same shapes) is refused,
  naming the file and both hashes;
* a setting that differs from the recorded one (``block_size`` edited from 4 to 8 in ``config.json``) is
  refused, naming the file, the key and both values, unless :data:`OVERRIDE` is given: then it is used with a
  warning, and :func:`edited_settings` says what was edited for the evaluation's results;
* every byte of ``config.json`` and of a shipped drafter's ``card.json`` is recorded too (``files_sha256``: the
  files of :data:`COVERED` present when the record is written, and those added by :func:`record_files`, e.g. a card
  written when the drafter is shipped): a file that changed otherwise than in its settings (a key blockdraft does
  not read, a card's τ) is refused, naming it and both hashes (``config.json``: unless :data:`OVERRIDE`). Records
  written before ``files_sha256`` existed check the weights and settings only;
* a drafter saved before blockdraft wrote records (or by another tool) loads with a one-line warning, unless it is
  shipped (under :data:`SHIPPED_DIR`, ``experiments/assets``): a shipped drafter without its record is refused;
* the autoregressive assistants (Hugging Face folders) carry a record too (:func:`write_assistant_record`: their
  weights and ``config.json``), checked the same way (:func:`check_assistant_record`);
* weights holding a NaN or an infinity are refused when saved (:func:`write_record` reads the written files back
  before recording them) and when loaded (:func:`check_finite_weights`), naming the file and the tensor.

The sha256 is that of the whole file (``sha256sum model.safetensors`` gives the same).
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from drafters.storage import DamagedFileError, read_json, sha256_file, write_json_atomic

RECORD_NAME = "blockdraft_record.json"
#: where the drafters and assistants shipped with blockdraft live: one without its record is refused, not warned about
SHIPPED_DIR = Path(__file__).resolve().parents[1] / "experiments" / "assets"
#: the files besides the weights whose every byte a drafter's record covers, where present when it is written
COVERED = ("config.json", "card.json")
#: config.json keys of a Hugging Face folder that are not settings of the model (the writing library's version)
HF_UNRECORDED = ("transformers_version",)
OVERRIDE = "drafter.allow_edited_settings=true"  # the one setting that accepts edited settings
ABSENT = "absent"  # how a setting missing on one side is shown


class ChangedDrafterError(ValueError):
    """A saved drafter's weights or settings are not those recorded when it was saved."""


class NonFiniteWeightsError(ValueError):
    """A drafter's weights hold a NaN or an infinity (a diverged training run): never saved, shipped or loaded."""


def check_finite_weights(tensors: Mapping[str, torch.Tensor], where: str | Path) -> None:
    """Refuse ``tensors`` (a state dict) when a floating-point one holds a NaN or an infinity, naming ``where`` (the
    weights file), the first such tensor and how many of its values are not finite."""
    for name, tensor in tensors.items():
        if not (torch.is_tensor(tensor) and tensor.is_floating_point()) or bool(torch.isfinite(tensor).all()):
            continue
        bad = int((~torch.isfinite(tensor)).sum())
        raise NonFiniteWeightsError(
            f"drafter weights {where}: tensor {name} (shape {tuple(tensor.shape)}) holds {bad} NaN or infinite "
            "values: the training that made them diverged; train again (e.g. with a lower learning rate) or use "
            "an earlier checkpoint")


def write_record(directory: str | Path, settings: Mapping[str, Any], files: Sequence[str],
                 covered: Sequence[str] = COVERED) -> None:
    """Write :data:`RECORD_NAME` in ``directory``: the sha256 of each of ``files`` (names in it, written
    already), of each of ``covered`` that is there (:data:`COVERED`: config.json, card.json) and ``settings`` (JSON
    values). A file whose weights are not all finite is refused
    (:class:`NonFiniteWeightsError`), and a record already in ``directory`` is removed: the folder then holds no
    drafter that loads."""
    directory = Path(directory)
    for name in files:
        try:
            check_finite_weights(load_file(str(directory / name)), directory / name)
        except NonFiniteWeightsError:
            (directory / RECORD_NAME).unlink(missing_ok=True)
            raise
    write_json_atomic(directory / RECORD_NAME, {
        "weights_sha256": {name: sha256_file(directory / name) for name in sorted(files)},
        "files_sha256": {name: sha256_file(directory / name) for name in covered if (directory / name).is_file()},
        "settings": _plain(settings)})


def record_files(directory: str | Path, names: Sequence[str]) -> None:
    """Add the sha256 of ``names`` (files of ``directory`` written after its record, e.g. a shipped drafter's
    ``card.json``) to the record in ``directory`` (``files_sha256``); a folder without a record is refused."""
    directory = Path(directory)
    record = read_record(directory)
    if record is None:
        raise FileNotFoundError(f"{directory} has no {RECORD_NAME} to add {list(names)} to; save the drafter first")
    record["files_sha256"] = {**record.get("files_sha256", {}),
                              **{name: sha256_file(directory / name) for name in names}}
    write_json_atomic(directory / RECORD_NAME, record)


def read_record(directory: str | Path) -> dict | None:
    """The record of the drafter saved in ``directory``; None when it has none (saved before records)."""
    path = Path(directory) / RECORD_NAME
    if not path.is_file():
        return None
    record = read_json(path, "drafter record")
    if not all(isinstance(record, dict) and isinstance(record.get(k), dict) for k in ("weights_sha256", "settings")):
        raise DamagedFileError(f"drafter record {path} lacks its weights_sha256 or settings object; restore it, "
                               "or save or export the drafter again")
    return record


def _plain(settings: Mapping[str, Any]) -> dict:
    """``settings`` as JSON reads them back (tuples become lists)."""
    return json.loads(json.dumps(settings))


def _differences(recorded: Any, found: Any, key: str = "") -> dict[str, dict[str, Any]]:
    """``{dotted key: {"recorded", "found"}}`` where two settings differ (the recorded order, then keys added),
    descending into mappings both have."""
    if isinstance(recorded, Mapping) and isinstance(found, Mapping):
        diffs: dict[str, dict[str, Any]] = {}
        for name in [*recorded, *(k for k in found if k not in recorded)]:
            diffs.update(_differences(recorded.get(name, ABSENT), found.get(name, ABSENT), f"{key}{name}."))
        return diffs
    return {} if recorded == found else {key.rstrip("."): {"recorded": recorded, "found": found}}


def edited_settings(directory: str | Path, settings: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """``{key: {"recorded": value, "found": value}}`` of each of ``settings`` (the saved drafter's, as
    :func:`write_record` took them) that differs from the record in ``directory`` (dotted keys into the mappings
    both have; a value missing on one side reads :data:`ABSENT`); {} when none differs or there is no record."""
    record = read_record(directory)
    return {} if record is None else _edits(record, settings)


def _edits(record: Mapping[str, Any], settings: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    return _differences(record["settings"], _plain(settings))


def _show(value: Any) -> str:
    return ABSENT if value == ABSENT else repr(value)


def _check_weights(directory: Path, record: Mapping[str, Any]) -> None:
    """Refuse a recorded weights file that is missing or whose sha256 changed, naming it and both hashes."""
    for name, recorded in record["weights_sha256"].items():
        path = directory / name
        if not path.is_file():
            raise ChangedDrafterError(f"drafter weights {path} are missing but {directory / RECORD_NAME} records "
                                      f"sha256 {recorded} for them; restore the file")
        found = sha256_file(path)
        if found != recorded:
            raise ChangedDrafterError(
                f"drafter weights {path} have sha256 {found} but {directory / RECORD_NAME} records {recorded}: "
                "the file was replaced or changed after the drafter was saved; restore the saved file, or save or "
                "export the drafter again to record these weights")


def check_saved_record(directory: str | Path, config_name: str, settings: Mapping[str, Any],
                       allow_edited_settings: bool = False) -> None:
    """Check the drafter saved in ``directory`` against its record: its weights files (refused when changed)
    and ``settings`` (those ``config_name`` gave it, in the record's spelling): refused when edited unless
    ``allow_edited_settings`` (then warned about). Without a record: a warning."""
    directory = Path(directory)
    record = read_record(directory)
    if record is None and SHIPPED_DIR in directory.resolve().parents:
        raise ChangedDrafterError(f"shipped drafter {directory} has no {RECORD_NAME}: a drafter shipped in "
                                  f"{SHIPPED_DIR.name}/ is used only with the record of its weights and settings; "
                                  f"restore it (git checkout -- {directory / RECORD_NAME})")
    if record is None:
        warnings.warn(f"drafter {directory} has no {RECORD_NAME} (saved by an older blockdraft or another tool): "
                      f"its weights and {config_name} are loaded without checking that they are those it was "
                      "saved with; save or export it again to record them", stacklevel=3)
        return
    _check_weights(directory, record)
    edits = _edits(record, settings)
    _check_files(directory, record, config_name, bool(edits), allow_edited_settings)
    if not edits:
        return
    shown = "; ".join(f"{k} is {_show(v['found'])}, recorded {_show(v['recorded'])}" for k, v in edits.items())
    what = f"drafter config {directory / config_name} differs from the settings {directory / RECORD_NAME} records: {shown}"
    if allow_edited_settings:
        warnings.warn(f"{what}; used anyway ({OVERRIDE})", stacklevel=3)
        return
    raise ChangedDrafterError(f"{what}. The drafter was trained with the recorded values: restore {config_name}, "
                              f"or set {OVERRIDE} to use the edited ones")


def _check_files(directory: Path, record: Mapping[str, Any], config_name: str, edited: bool, allow: bool) -> None:
    """Refuse a file of the record's ``files_sha256`` whose bytes changed, naming it and both hashes; ``config_name``
    with ``edited`` settings is left to the settings' check, and with ``allow`` (:data:`OVERRIDE`) only warned about."""
    for name, recorded in (record.get("files_sha256") or {}).items():
        path = directory / name
        found = sha256_file(path) if path.is_file() else ABSENT
        if found == recorded or (name == config_name and edited):
            continue
        what = (f"{path} has sha256 {found} but {directory / RECORD_NAME} records {recorded}: the file changed after "
                "the drafter was saved")
        if name == config_name and allow:
            warnings.warn(f"{what}; used anyway ({OVERRIDE})", stacklevel=4)
            continue
        fix = f", or set {OVERRIDE} to use it as it is" if name == config_name else ""
        raise ChangedDrafterError(f"{what} (its record covers every byte of it); restore the recorded file{fix}")


def _hf_settings(directory: Path) -> dict:
    config = read_json(directory / "config.json", "model config")
    return {k: v for k, v in config.items() if k not in HF_UNRECORDED}


def write_assistant_record(directory: str | Path) -> None:
    """Write the record of the Hugging Face model (an assistant) saved in ``directory``: the sha256 of its
    ``*.safetensors`` files and its ``config.json`` settings (all its keys but :data:`HF_UNRECORDED`)."""
    directory = Path(directory)
    write_record(directory, _hf_settings(directory), [p.name for p in sorted(directory.glob("*.safetensors"))],
                 covered=())  # config.json's settings, not its bytes: transformers_version changes with the library


def check_assistant_record(directory: str | Path, allow_edited_settings: bool = False) -> None:
    """:func:`check_saved_record` for a Hugging Face model folder (an assistant; :func:`write_assistant_record`)."""
    directory = Path(directory)
    check_saved_record(directory, "config.json", _hf_settings(directory), allow_edited_settings)


__all__ = ["ABSENT", "COVERED", "OVERRIDE", "RECORD_NAME", "SHIPPED_DIR", "ChangedDrafterError", "NonFiniteWeightsError",
           "check_assistant_record", "check_finite_weights", "check_saved_record", "edited_settings", "read_record",
           "record_files", "write_assistant_record", "write_record"]
