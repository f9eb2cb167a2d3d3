"""The guard of the vLLM test modules: they skip where vLLM is not installed, and fail under TRL_MARL_REQUIRE_VLLM=1
(CI's vLLM environment), so that a broken vLLM install cannot pass as skipped tests."""

import importlib.util
import os

import pytest


def skip_without_vllm() -> None:
    if importlib.util.find_spec("vllm") is None:
        if os.environ.get("TRL_MARL_REQUIRE_VLLM") == "1":
            raise ImportError("TRL_MARL_REQUIRE_VLLM=1 but vLLM is not installed (see docs/vllm.md, Install).")
        pytest.skip("vLLM is not installed (see docs/vllm.md, Install)", allow_module_level=True)
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine core in this process, as TRL's colocate
