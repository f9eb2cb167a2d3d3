"""Shared fixtures. Nothing here touches the network: the Hub is put in offline mode before anything imports it."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402
import torch  # noqa: E402


@pytest.fixture(scope="session")
def default_model_dir() -> str:
    """The real embedded default model (SmolLM2-135M-Instruct), converted once per cache folder."""
    from trl_marl import default_model_path

    return default_model_path()


@pytest.fixture(scope="session")
def tiny_model_dir(default_model_dir, tmp_path_factory) -> str:
    """A tiny randomly initialised Llama with the default model's tokenizer and chat template, for fast tests."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(default_model_dir)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=512,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    folder = tmp_path_factory.mktemp("tiny-llama")
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return str(folder)


@pytest.fixture
def shared_tmp(monkeypatch):
    """A temporary directory that the sandbox user (nobody, when the tests run as root) can reach, as TMPDIR: where the
    local backend makes its run directories."""
    import shutil
    import tempfile
    from pathlib import Path

    directory = Path(tempfile.mkdtemp(dir="/var/tmp"))
    directory.chmod(0o755)
    monkeypatch.setenv("TMPDIR", str(directory))
    monkeypatch.setattr(tempfile, "tempdir", None)
    yield directory
    shutil.rmtree(directory)


@pytest.fixture(scope="session")
def other_base_dir(tmp_path_factory) -> str:
    """A second base of another architecture and vocabulary, for teams on several bases
    (`trl_marl.team.offline_base`): a tiny randomly initialised Qwen2 with a BPE tokenizer trained on local prose and
    a chat template of its own. Its token ids mean nothing to the default model's tokenizer, and the other way
    round."""
    from trl_marl.team.offline_base import make_offline_base

    return make_offline_base(tmp_path_factory.mktemp("tiny-qwen2"))
