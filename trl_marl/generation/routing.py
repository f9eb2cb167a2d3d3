"""Per-row routing of a batch to its agents' LoRA adapters, for training forwards as for generation.

A batch mixes the agents' rows; each row must go through its own agent's adapter, in one forward. The router keeps
the routing in persistent hooks (not, as PEFT's `adapter_names=`, in hooks that live for one call and only in eval
mode), so the routing set before a training forward is still in place when gradient checkpointing replays that
forward in the backward pass.

Plain LoRA layers (linear, same dropout for every agent) get a batched path: the base layer runs once for the whole
batch, then the LoRA deltas of every row come from two matmuls against the agents' matrices concatenated along the
rank: `h = x A_catᵀ` gives every agent's rank-space projection of every row, a mask keeps each row's own agent's
block, and `h B_catᵀ` (B scaled per agent) is each row's `scale_a · B_a A_a x`. Nothing is copied per row: the extra
memory is the concatenated adapters (cached during generation) and `h`, rows × tokens × the summed ranks. Other
layers (LoRA variants, `modules_to_save`, …), and every layer under DeepSpeed ZeRO-3 (whose parameters are gathered
only while their own module runs), use PEFT's own mixed-batch path (`adapter_names=` injected per call). Several
adapters cannot be routed under FSDP or ZeRO-3 at all (`check_sharding_routable`).

A row routed to `BASE` goes through the base model alone: that is how the KL reference (the base, shared by every
agent) is computed. PEFT's own ways to the base (`disable_adapter()`, TRL's `use_adapter(model, None)`) end in
`set_adapter`, which turns gradients off on every adapter but the active one; routing never touches `requires_grad`.
When every row goes to the same adapter (AT-GRPO's `generate` calls under a sequential scheduler, a one-agent team),
only that adapter's LoRA projection is computed, as PEFT computes it, with no concatenation and no mask.
"""

import inspect
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import peft
import torch
from peft import PeftModel
from peft.tuners.lora import LoraLayer
from peft.utils import AuxiliaryTrainingWrapper
from transformers.integrations import is_deepspeed_zero3_enabled

from ..agents import is_4bit_linear
from .tensor_routing import TensorRouting, routed_lora_delta, routed_lora_dropout

BASE = "__base__"  # PEFT's name for "no adapter": a row routed here goes through the base model alone
BASE_ROW = -1  # the agent index of a row routed to the base model alone (the KL reference)
# The submodule of a team's first base that holds its other bases (`team/bases.py`): each has a router of its own.
OTHER_BASES = "team_bases"

# The PEFT releases the router is tested with (pyproject.toml pins the same range).
PEFT_TESTED = ">=0.18,<0.22"
# PEFT internals the router reads: attributes of every `LoraLayer` and methods of `PeftModel`.
LORA_LAYER_ATTRIBUTES = ("lora_A", "lora_B", "scaling", "lora_dropout", "lora_variant", "lora_bias", "get_base_layer")
PEFT_MODEL_METHODS = ("set_requires_grad", "set_adapter", "get_base_model")


def rows_to_adapters(agent_index: torch.Tensor | Sequence[int], agent_adapters: Sequence[str]) -> list[str]:
    """The adapter of each row: its agent's (`agent_adapters[i]`), or `BASE` for a row of agent index `BASE_ROW`."""
    indices = agent_index.tolist() if isinstance(agent_index, torch.Tensor) else agent_index  # one device sync
    return [agent_adapters[i] if i != BASE_ROW else BASE for i in indices]


def missing_peft_internals(model: PeftModel) -> list[str]:
    """The PEFT internals the router relies on that `model` lacks: each `LoraLayer`'s matrices, scalings, dropouts,
    variants and biases (per adapter), a `forward` that takes `adapter_names` (PEFT's mixed-batch path), and the
    `PeftModel` methods the trainer calls."""
    missing = [f"PeftModel.{name}" for name in PEFT_MODEL_METHODS if not callable(getattr(model, name, None))]
    layer = next((module for module in model.modules() if isinstance(module, LoraLayer)), None)
    if layer is None:
        return missing + ["a LoraLayer in the model"]
    missing += [f"LoraLayer.{name}" for name in LORA_LAYER_ATTRIBUTES if not hasattr(layer, name)]
    parameters = inspect.signature(type(layer).forward).parameters
    if "adapter_names" not in parameters and not any(p.kind is p.VAR_KEYWORD for p in parameters.values()):
        missing.append(f"{type(layer).__name__}.forward(..., adapter_names=...)")
    return missing


def check_sharding_routable(num_adapters: int, sharding: str | None) -> None:
    """Refuse several adapters under a sharding of parameters (`sharding`: "FSDP" or "DeepSpeed ZeRO-3", None for
    none), naming the reason and what to use instead.

    A sharded parameter is gathered by a collective that every process runs together, module by module. Rows of one
    micro-batch go to different adapters on different processes (and a process may hold no row of some agent), so
    the processes would run different adapters' modules, in different orders: the gathers would pair one process's
    adapter with another's weights, or wait forever. One adapter (`adapter_mode="shared"`) runs the same modules on
    every process."""
    if sharding and num_adapters > 1:
        raise ValueError(
            f"A team of {num_adapters} adapters cannot train under {sharding}: its parameters are gathered module by "
            "module by every process together, while each process's rows go through different agents' adapters. Use "
            "DDP or DeepSpeed ZeRO-1/2 (a 4-bit base and LoRA adapters fit one GPU per process), or one adapter for "
            "the whole team (`adapter_mode='shared'`)."
        )


def check_peft_internals(model: PeftModel) -> None:
    """Fail with a clear message, before anything trains, when this PEFT release moved what the router reads."""
    missing = missing_peft_internals(model)
    if missing:
        raise RuntimeError(
            f"trl_marl routes rows to adapters through PEFT internals that peft {peft.__version__} does not have: "
            f"{', '.join(missing)}. trl_marl is tested with peft{PEFT_TESTED}: install a release in that range, e.g. "
            f"`pip install 'peft{PEFT_TESTED}'`."
        )


class AdapterRouter:
    """Routes row `i` of every forward to adapter `row_adapters[i]` until the next `route` call.

    Args:
        model: the `PeftModel` carrying the adapters.
        adapter_names: the adapters rows may be routed to (and `BASE`, the base model alone).
    """

    def __init__(self, model: PeftModel, adapter_names: Sequence[str]):
        check_peft_internals(model)
        self.adapter_names = list(dict.fromkeys(adapter_names))
        self.row_adapters: list[str] | None = None
        self._row_index: torch.Tensor | None = None  # (rows,) index into adapter_names, -1 for BASE; model's device
        self._single: int | None = None  # the one index every row shares, if they do
        self._masks: dict[tuple, torch.Tensor] = {}  # (ranks, device, dtype) -> (rows, summed ranks) block mask
        self._weight_cache: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # kept while no grad is taken
        self._tensor_routing: TensorRouting | None = None  # built at the first `tensor_routing` call
        self._handles = []
        self._plain_layers: list[LoraLayer] = []
        self._other_layers: list[torch.nn.Module] = []
        for path, module in model.named_modules():
            if path.split(".")[0] == OTHER_BASES:
                continue  # a layer of another base of the team (`team/bases.py`), which has its own router
            if isinstance(module, LoraLayer) and self._is_plain_lora(module):
                self._plain_layers.append(module)
                self._handles.append(module.register_forward_pre_hook(self._base_only, with_kwargs=True))
                self._handles.append(module.register_forward_hook(self._add_routed_lora))
            elif isinstance(module, (LoraLayer, AuxiliaryTrainingWrapper)):
                self._other_layers.append(module)
                self._handles.append(module.register_forward_pre_hook(self._inject_adapter_names, with_kwargs=True))
                if isinstance(module, LoraLayer) and is_4bit_linear(module.get_base_layer()):
                    # PEFT's 4-bit layer clones the base output before adding LoRA deltas in its single-adapter path
                    # but not in its mixed-batch path, whose in-place add then fails under autograd.
                    self._handles.append(module.get_base_layer().register_forward_hook(self._clone_output))
        # Routing tensors are built once per `route` call, on the device the adapters live on (read at each call: the
        # model may have moved since), never on the host and copied per layer.
        self._adapter_weight = next(
            (p for n, p in model.named_parameters() if "lora_" in n and n.split(".")[0] != OTHER_BASES), None
        )

    def _is_plain_lora(self, layer: LoraLayer) -> bool:
        # Under ZeRO-3 a parameter is gathered only while its own module runs; the batched path reads the adapters'
        # weights without running `lora_A` / `lora_B`, so it would see empty partitions. PEFT's path runs them (a team
        # under ZeRO-3 has one adapter: `check_sharding_routable`).
        if is_deepspeed_zero3_enabled():
            return False
        if getattr(layer, "fan_in_fan_out", False) or not all(name in layer.lora_A for name in self.adapter_names):
            return False
        if any(name in layer.lora_variant or layer.lora_bias.get(name, False) for name in self.adapter_names):
            return False
        if not all(isinstance(layer.lora_A[name], torch.nn.Linear) for name in self.adapter_names):
            return False
        dropouts = {getattr(layer.lora_dropout[name], "p", 0.0) for name in self.adapter_names}
        return len(dropouts) == 1

    def route(self, row_adapters: Sequence[str] | None) -> None:
        """Route the rows of the next forward calls (an adapter name per row, or `BASE`); `None` gives the model back
        to PEFT's active adapter."""
        self._masks, self._weight_cache = {}, {}
        if row_adapters is None:
            self.row_adapters = self._row_index = self._single = None
            return
        unknown = set(row_adapters) - {*self.adapter_names, BASE}
        if unknown:
            raise ValueError(f"Cannot route rows to adapters {sorted(unknown)}; known: {self.adapter_names}.")
        self.row_adapters = list(row_adapters)
        positions = {name: index for index, name in enumerate(self.adapter_names)}
        row_index = [positions.get(name, -1) for name in self.row_adapters]
        self._row_index = torch.tensor(row_index, device=self.device)
        self._single = row_index[0] if len(set(row_index)) == 1 else None
        self._base_names = [BASE] * len(self.row_adapters)

    @property
    def device(self) -> torch.device:
        """Where the routing tensors are built: the adapters' device."""
        return self._adapter_weight.device if self._adapter_weight is not None else torch.device("cpu")

    # -- batched path

    def _base_only(self, module, args, kwargs):
        # "__base__" is PEFT's name for "no adapter": the layer then returns its base output, to which the routed
        # LoRA deltas are added below.
        if self.row_adapters is not None:
            kwargs["adapter_names"] = self._base_names
        return args, kwargs

    def _concatenated(self, layer: LoraLayer) -> tuple[torch.Tensor, torch.Tensor]:
        """`A_cat` `(Σr, in)` and `B_cat` `(out, Σr)`, each agent's B scaled by its LoRA scaling.

        Cached only for forwards without gradients (generation: the weights do not change until the next routing),
        and read only by them. A forward with gradients always concatenates anew: reentrant gradient checkpointing
        runs a layer's first forward without gradients and replays it with gradients in the backward, and the replay
        must build its matrices from the parameters, not reuse the first forward's detached copies."""
        if torch.is_grad_enabled():
            return self._concatenate(layer)
        if id(layer) not in self._weight_cache:
            self._weight_cache[id(layer)] = self._concatenate(layer)
        return self._weight_cache[id(layer)]

    def _concatenate(self, layer: LoraLayer) -> tuple[torch.Tensor, torch.Tensor]:
        lora_a = torch.cat([layer.lora_A[name].weight for name in self.adapter_names])
        lora_b = torch.cat([layer.lora_B[name].weight * layer.scaling[name] for name in self.adapter_names], dim=1)
        return lora_a, lora_b

    def _mask(self, layer: LoraLayer, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
        """`(rows, Σr)`: 1 on the rank block of each row's agent, 0 elsewhere (0 everywhere for a `BASE` row)."""
        ranks = tuple(layer.r[name] for name in self.adapter_names)
        key = (ranks, device, dtype)
        if key not in self._masks:
            row_index = self._row_index.to(device)  # a no-op unless the model is split over devices
            block_of_column = torch.tensor(
                [block for block, rank in enumerate(ranks) for _ in range(rank)], device=device
            )
            self._masks[key] = (row_index[:, None] == block_of_column[None, :]).to(dtype)
        return self._masks[key]

    def _add_routed_lora(self, module, args, output):
        if self.row_adapters is None or module.disable_adapters or module.merged:
            return None
        if self._single is not None:  # every row on one adapter (or on the base): no concatenation, no mask
            if self._single < 0:
                return None
            name = self.adapter_names[self._single]
            lora_a, lora_b = module.lora_A[name], module.lora_B[name]
            x = module.lora_dropout[name](args[0].to(lora_a.weight.dtype))
            return (output + lora_b(lora_a(x)) * module.scaling[name]).to(output.dtype)
        lora_a, lora_b = self._concatenated(module)
        x = routed_lora_dropout(module, self.adapter_names)(args[0])
        mask = self._mask(module, lora_a.device, lora_a.dtype)
        return output + routed_lora_delta(x, lora_a, lora_b, mask).to(output.dtype)

    # -- routing as tensors, for a captured decode step

    def tensor_routing_unsupported(self) -> str | None:
        """Why this model's routing cannot be held in tensors (`tensor_routing`), or None when it can: every LoRA
        layer must take the batched path, and none may be merged into its base or disabled."""
        if self._other_layers:
            return (
                f"{type(self._other_layers[0]).__name__} layers (LoRA variants, biases, modules_to_save, differing "
                "dropouts, adapters on different modules) route through PEFT's per-row Python path"
            )
        if any(layer.merged for layer in self._plain_layers):
            return "an adapter is merged into the base weights"
        if any(layer.disable_adapters for layer in self._plain_layers):
            return "the adapters are disabled (`disable_adapter()`)"
        return None

    @contextmanager
    def tensor_routing(self, row_adapters: Sequence[str], rows: int | None = None) -> Iterator[None]:
        """Route the rows of the forwards inside the block through forwards that read the routing from tensors only.

        Each plain LoRA layer's forward becomes its base layer plus `routed_lora_delta` of its input after the routed
        adapters' dropout (`routed_lora_dropout`: the module the ordinary routing applies, so that in train mode both
        draw alike), layers reading one input sharing their matmuls once `fuse_shared_inputs` has run, and a call
        whose rows all go to one adapter reading that adapter's weights alone (`tensor_routing.py`). The matrices and
        masks live in buffers allocated once and refreshed in place at each entry (the adapters may have trained
        since), so a decode step captured inside one block (`torch.compile`, CUDA graphs) replays in the next with new
        weights and rows and no recompilation: nothing in it is a Python list of rows, a hook or a tensor made per
        call. The hooks of the ordinary routing are idle inside the block. Batches have up to `rows` rows (default
        `len(row_adapters)`); the rows past `row_adapters` are padding, whose outputs nothing reads (a mixed call
        routes them to the base alone, a call on one adapter to that adapter). Rows routed to `BASE` get no LoRA
        delta. Unsupported models raise (`tensor_routing_unsupported`)."""
        reason = self.tensor_routing_unsupported()
        if reason:
            raise ValueError(f"This team's routing cannot be captured: {reason}.")
        unknown = set(row_adapters) - {*self.adapter_names, BASE}
        if unknown:
            raise ValueError(f"Cannot route rows to adapters {sorted(unknown)}; known: {self.adapter_names}.")
        if self._tensor_routing is None:
            self._tensor_routing = TensorRouting(self._plain_layers, self.adapter_names)
        previous = self.row_adapters
        try:  # the routing is restored on every exit, a failing refresh's included (a fallback runs routed)
            self.route(None)
            row_index = [self.adapter_names.index(name) if name != BASE else -1 for name in row_adapters]
            self._tensor_routing.refresh(row_index, rows)
            with self._tensor_routing.installed():
                yield
        finally:
            self.route(previous)

    def fuse_shared_inputs(self) -> bool:
        """Inside `tensor_routing`, after a forward of the whole model: group the layers that read one input (q/k/v,
        gate/up), so that their LoRA work is one A matmul, one mask and one B matmul
        (`TensorRouting.fuse_shared_inputs`); whether it regrouped."""
        return self._tensor_routing is not None and self._tensor_routing.fuse_shared_inputs()

    @property
    def tensor_routing_mode(self) -> str:
        """What the LoRA layers' forwards read now: inside `tensor_routing`, its buffers (`TensorRouting.mode`:
        "single", every routed row on one adapter, no mask; or "mixed"); outside it, "unrouted" (the ordinary
        forwards). A decode step recorded in one mode is not replayed in another."""
        if self._tensor_routing is None or not self._tensor_routing.active:
            return "unrouted"
        return self._tensor_routing.mode

    @property
    def tensor_buffers_version(self) -> int:
        """How many times the current mode's `tensor_routing` buffers were replaced so far (`TensorRouting.version`;
        0 when unrouted): a decode step recorded under one version reads stale buffers under another."""
        if self.tensor_routing_mode == "unrouted":
            return 0
        return self._tensor_routing.version

    # -- PEFT's mixed-batch path

    def _inject_adapter_names(self, module, args, kwargs):
        if self.row_adapters is not None:
            kwargs["adapter_names"] = self.row_adapters
        return args, kwargs

    def _clone_output(self, module, args, output):
        if self.row_adapters is not None and torch.is_grad_enabled():
            return output.clone()
        return None

    def remove(self) -> None:
        """Remove the hooks (the model then behaves as plain PEFT again)."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self.route(None)
