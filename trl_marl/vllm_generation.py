"""Team rollouts through vLLM: one engine holds the base model and serves every agent's adapter as a LoRA
(docs/vllm.md).

TRL's `VLLMGeneration` merges the active adapter into the base weights and pushes them to vLLM, so its engine serves
one policy. A team needs one policy per agent in the same batch, which vLLM does natively: each prompt of a
`LLM.generate` call may carry its own `LoRARequest`. `TeamVLLMGeneration` keeps TRL's settings and generation code and
changes three things:

- the engine is built with LoRA enabled (`max_loras` = the team's adapters, `max_lora_rank` = their largest rank)
  and in the training model's dtype;
- `sync_weights` sends only the trained adapters (the base never changes), saved in PEFT format under a new name and
  id per version, so that an adapter of an earlier step can never be served; frozen adapters are loaded once;
- `generate` gives row `i` the `LoRARequest` of the adapter the router sends row `i` to (`AdapterRouter.route`), and
  rows come back in order.
"""

from __future__ import annotations

import functools
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any
from unittest import mock

from trl.generation import vllm_generation
from trl.generation.vllm_generation import VLLMGeneration

from .routing import BASE

if TYPE_CHECKING:
    from .routing import AdapterRouter

SERVER_MODE_REASON = (
    "`vllm_mode='server'` is not supported: TRL's `trl vllm-serve` server receives merged full weights, one policy, "
    "while each agent needs its own adapter in the same batch. Use `vllm_mode='colocate'`, which serves every agent's "
    "adapter as a LoRA from one engine in the trainer's process."
)


def _shared_memory_dir() -> str | None:
    """A RAM-backed folder for adapter versions where the system has one (Linux `/dev/shm`), else the default temp."""
    return "/dev/shm" if Path("/dev/shm").is_dir() else None


class TeamVLLMGeneration(VLLMGeneration):
    """TRL's colocated vLLM generation, serving one LoRA per adapter of the team.

    Args:
        model: the trainer's PEFT model (its base is what vLLM loads, from `model.name_or_path`).
        router: the trainer's adapter router; `generate` serves row `i` with `router.row_adapters[i]`.
        trained_adapters: the adapters that change with training: each `sync_weights` sends a new version of them.
        lora_rank: the largest LoRA rank of the team's adapters (vLLM's `max_lora_rank`).
        **settings: `VLLMGeneration`'s own arguments (accelerator, processing class, vLLM and sampling settings).
    """

    def __init__(
        self,
        model: Any,
        router: AdapterRouter,
        trained_adapters: list[str],
        lora_rank: int,
        **settings: Any,
    ):
        if settings.get("mode", "colocate") != "colocate":
            raise ValueError(SERVER_MODE_REASON)
        self.router = router
        self.adapter_names = list(router.adapter_names)
        self.trained_adapters = list(trained_adapters)
        self.lora_rank = lora_rank
        self.version = -1  # the version of the trained adapters the engine serves; -1 before the first sync
        self.lora_requests: dict[str, Any] = {}  # adapter name -> the LoRARequest of its served version
        self._next_lora_id = 1
        self._adapter_dir = Path(tempfile.mkdtemp(prefix="trl_marl-vllm-adapters-", dir=_shared_memory_dir()))
        super().__init__(model=model, **settings)

    def _init_vllm(self) -> None:
        """TRL's colocate engine, built with LoRA serving for every adapter and in the model's dtype."""
        from vllm import LLM

        with_lora = functools.partial(
            LLM,
            enable_lora=True,
            max_loras=len(self.adapter_names),
            max_lora_rank=self.lora_rank,
            dtype=str(self.model.dtype).removeprefix("torch."),
        )
        with mock.patch.object(vllm_generation, "LLM", with_lora):
            super()._init_vllm()

    def sync_weights(self) -> None:
        """Send the trained adapters (all adapters on the first call) to the engine as a new version."""
        from vllm.lora.request import LoRARequest

        self.version += 1
        sending = self.adapter_names if not self.lora_requests else self.trained_adapters
        folder = self._adapter_dir / f"v{self.version}"
        self.model.save_pretrained(folder, selected_adapters=sending)
        for adapter in sending:
            old = self.lora_requests.get(adapter)
            self.lora_requests[adapter] = LoRARequest(
                f"{adapter}@v{self.version}", self._next_lora_id, str(self._adapter_path(folder, adapter))
            )
            self._next_lora_id += 1
            if old is not None:
                self.llm.llm_engine.remove_lora(old.lora_int_id)
        if self.version > 0:
            shutil.rmtree(self._adapter_dir / f"v{self.version - 1}", ignore_errors=True)

    @staticmethod
    def _adapter_path(folder: Path, adapter: str) -> Path:
        """Where PEFT's `save_pretrained` put `adapter` (the `default` adapter in the folder itself)."""
        return folder if adapter == "default" else folder / adapter

    def row_lora_requests(self, num_rows: int) -> list[Any]:
        """The LoRA request of each row the router routes (None for a row routed to the base model)."""
        row_adapters = self.router.row_adapters
        if row_adapters is None or len(row_adapters) != num_rows:
            raise RuntimeError(
                f"vLLM got {num_rows} prompts but the router routes "
                f"{'no rows' if row_adapters is None else f'{len(row_adapters)} rows'}: route the rows to their "
                "adapters (`TeamTrainer._route_rows`) before generating."
            )
        return [None if adapter == BASE else self.lora_requests[adapter] for adapter in row_adapters]

    def generate(self, prompts, images, num_generations, profiler=None):
        """TRL's colocated generation, each row served with its adapter's LoRA."""
        requests = self.row_lora_requests(len(prompts))
        generate = self.llm.generate
        with mock.patch.object(self.llm, "generate", functools.partial(generate, lora_request=requests)):
            return super().generate(prompts, images, num_generations, profiler)

    def close(self) -> None:
        """Remove the saved adapter versions."""
        shutil.rmtree(self._adapter_dir, ignore_errors=True)
