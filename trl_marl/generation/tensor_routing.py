"""Routing held in tensors, for a captured decode step (`AdapterRouter.tensor_routing`), with the LoRA work of layers
that read one input fused.

A captured step (a recorded CUDA graph, a compiled function) replays fixed kernels on fixed addresses: nothing in it
may be a Python list of rows, a hook, or a tensor made per call. So each plain LoRA layer's forward becomes its base
layer plus a LoRA delta read from buffers allocated once and refreshed in place at each call (the adapters may have
trained since): the agents' A matrices concatenated along the rank, their B matrices (each scaled by its agent's LoRA
scaling), and a `(rows, Σr)` mask keeping each row's own agent's rank block (`routed_lora_delta`).

Two things make the team's step cheaper than one such delta per layer:

- **Layers that read the same input share their matmuls.** An attention's q, k and v projections read one hidden
  state, an MLP's gate and up projections another. Their A matrices are stacked into one, their B matrices set on the
  diagonal of one block-diagonal matrix, so the group's deltas are one A matmul, one mask and one B matmul; each layer
  adds its own slice of the result. Which layers share an input is seen, not named: the first forward under the
  routing (the decode loop's prefill) records each layer's input, and `fuse_shared_inputs` groups the layers that were
  handed the same tensor, in call order. A layer handed another tensor than its group's first layer at a later call
  computes the group's deltas itself (right, only slower). Layers with live LoRA dropout are never grouped: PEFT draws
  a dropout mask per layer, and sharing one input would share the mask.
- **One adapter, no mask.** When every routed row goes to one adapter (a one-agent team, AT-GRPO's turn of one agent),
  the deltas are that adapter's alone, `x Aᵀ Bᵀ` over its own rank, from buffers of their own; switching to another
  adapter of the same rank copies its weights into them, so a step recorded for one agent replays for the next. A
  step recorded in one mode (`TensorRouting.mode`) is never replayed in the other: they read different buffers.

Rows routed to the base alone, and the padding rows a captured batch adds, get no LoRA delta in the mixed mode; in the
single mode padding rows get the adapter's delta, which nothing reads (a real row routed to the base makes the call
mixed).
"""

import functools
import itertools
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch
from peft.tuners.lora import LoraLayer

MIXED, SINGLE = "mixed", "single"


def routed_lora_dropout(layer: LoraLayer, adapter_names: Sequence[str]) -> torch.nn.Module:
    """The LoRA dropout of a batch routed to `adapter_names` on `layer`: the first routed adapter's module. A layer on
    the batched path has one dropout p for all of them (`AdapterRouter._is_plain_lora`); the layer may list other
    adapters, not routed, whose dropout must not apply."""
    return layer.lora_dropout[adapter_names[0]]


def routed_lora_delta(x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Each row's own agent's LoRA delta, `scale_a · B_a A_a x`, for a batch of every agent's rows.

    Args:
        x: `(rows, ..., in)`, the layer's input (after LoRA dropout).
        lora_a: `(Σr, in)`, the agents' A matrices concatenated along the rank.
        lora_b: `(out, Σr)`, their B matrices, each scaled by its agent's LoRA scaling.
        mask: `(rows, Σr)`: 1 on the rank block of each row's agent, 0 elsewhere (0 everywhere: the base alone).
            Rows past the mask's are not allowed; a mask with more rows than `x` is used for its first rows.
    """
    hidden = x.to(lora_a.dtype) @ lora_a.T  # (rows, ..., Σr): every agent's projection of every row
    mask = mask[: hidden.shape[0]]
    hidden = hidden * mask.view(mask.shape[0], *([1] * (hidden.dim() - 2)), mask.shape[1])
    return hidden @ lora_b.T


def dropout_is_live(layer: LoraLayer, adapter_names: Sequence[str]) -> bool:
    """Whether the routed LoRA dropout of `layer` can drop anything (p > 0; in eval mode it is idle, but the module may
    train again)."""
    return getattr(routed_lora_dropout(layer, adapter_names), "p", 0.0) > 0


class SharedInput:
    """Plain LoRA layers fed one input (a single layer when none shares it), whose deltas come from one A matmul, one
    mask and one B matmul: the buffers of both modes, the current mode's, and the delta of the input in flight (kept
    from the group's first layer's forward to its last's).

    Args:
        layers: the layers, in the order the model calls them.
    """

    def __init__(self, layers: Sequence[LoraLayer]):
        self.layers = list(layers)
        self.buffers: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}  # mode -> (A stacked, B block-diagonal)
        self.lora_a: torch.Tensor | None = None  # the current mode's
        self.lora_b: torch.Tensor | None = None
        self.mask: torch.Tensor | None = None  # the mixed mode's; None in the single mode
        self.columns: tuple[int, ...] = ()  # the mixed mode's adapter index of each rank column
        self.rank_slices: list[slice] = []  # the current mode's: each layer's rows of A (columns of B)
        self.output_slices: list[slice] = []  # each layer's columns of the group's delta
        self.x: torch.Tensor | None = None
        self.delta: torch.Tensor | None = None

    def refresh(self, adapter_names: Sequence[str], single: int | None) -> bool:
        """Copy the adapters' current weights into the buffers of the mode (`single`: the one adapter's index, or None
        for every adapter); whether a buffer was replaced (allocated, or of another shape, dtype or device).

        In the single mode each layer's block is as wide as its largest adapter's rank, the adapter's matrices padded
        with zeros (which add nothing): every agent fits the same buffers, so a step recorded for one replays for
        all."""
        if single is None:
            matrices = [[self._scaled(layer, name) for name in adapter_names] for layer in self.layers]
            self.columns = tuple(
                adapter
                for layer in self.layers
                for adapter, name in enumerate(adapter_names)
                for _ in range(layer.r[name])
            )
        else:
            matrices = [
                [self._scaled(layer, adapter_names[single], max(layer.r[name] for name in adapter_names))]
                for layer in self.layers
            ]
        lora_a = torch.cat([lora_a for layer in matrices for lora_a, _ in layer])
        blocks = [torch.cat([lora_b for _, lora_b in layer], dim=1) for layer in matrices]
        lora_b = torch.block_diag(*blocks) if len(blocks) > 1 else blocks[0]
        self.rank_slices = _slices(block.shape[1] for block in blocks)
        self.output_slices = _slices(block.shape[0] for block in blocks)
        mode = MIXED if single is None else SINGLE
        buffers = self.buffers.get(mode)
        replaced = buffers is None or any(
            getattr(old, key) != getattr(new, key)
            for old, new in zip(buffers, (lora_a, lora_b))
            for key in ("shape", "dtype", "device")
        )
        if replaced:
            buffers = self.buffers[mode] = (lora_a, lora_b)
            for buffer in buffers:
                torch._dynamo.mark_static_address(buffer)  # CUDA graphs read it in place, never copy it
        else:
            buffers[0].copy_(lora_a)
            buffers[1].copy_(lora_b)
        self.lora_a, self.lora_b = buffers
        return replaced

    @staticmethod
    def _scaled(layer: LoraLayer, name: str, width: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """`layer`'s A and scaled B for adapter `name`, padded with zeros to rank `width` when given."""
        lora_a = layer.lora_A[name].weight.detach()
        lora_b = layer.lora_B[name].weight.detach() * layer.scaling[name]
        extra = (width or lora_a.shape[0]) - lora_a.shape[0]
        if extra:
            lora_a = torch.cat([lora_a, lora_a.new_zeros(extra, lora_a.shape[1])])
            lora_b = torch.cat([lora_b, lora_b.new_zeros(lora_b.shape[0], extra)], dim=1)
        return lora_a, lora_b

    def delta_of(self, x: torch.Tensor, dropout: torch.nn.Module) -> torch.Tensor:
        """Every layer's delta for input `x`, side by side along the last dimension."""
        return self._delta(dropout(x), self.lora_a, self.lora_b, self.mask)

    def layer_delta(self, x: torch.Tensor, dropout: torch.nn.Module, index: int) -> torch.Tensor:
        """Layer `index`'s delta alone, from its blocks of the group's buffers (views: no copy)."""
        ranks, outputs = self.rank_slices[index], self.output_slices[index]
        mask = self.mask[:, ranks] if self.mask is not None else None
        return self._delta(dropout(x), self.lora_a[ranks], self.lora_b[outputs, ranks], mask)

    @staticmethod
    def _delta(x, lora_a, lora_b, mask) -> torch.Tensor:
        if mask is None:  # the single mode
            return (x.to(lora_a.dtype) @ lora_a.T) @ lora_b.T
        return routed_lora_delta(x, lora_a, lora_b, mask)


def _slices(widths) -> list[slice]:
    """Consecutive slices of the given widths, from 0."""
    widths = list(widths)
    return [slice(end - width, end) for end, width in zip(itertools.accumulate(widths), widths)]


class TensorRouting:
    """The buffers and forwards of `AdapterRouter.tensor_routing`: per group of layers sharing an input
    (`SharedInput`), the stacked A and block-diagonal B of each mode; per rank layout, a `(rows, Σr)` mask (grown,
    never shrunk, when a call has more rows); and per layer a forward callable made once, so that what a captured step
    reads has the same identity and addresses at every call.

    Args:
        layers: the router's plain LoRA layers.
        adapter_names: the adapters, in the router's order.
    """

    def __init__(self, layers: Sequence[LoraLayer], adapter_names: Sequence[str]):
        self.layers, self.adapter_names = list(layers), list(adapter_names)
        self.groups = [SharedInput([layer]) for layer in self.layers]  # one per layer until `fuse_shared_inputs`
        self.masks: dict[tuple, torch.Tensor] = {}
        self.single: int | None = None  # the adapter every routed row goes to, or None
        self.row_index: list[int] = []
        self.rows = 0
        # Counts, per mode, the buffers replaced (a new shape, dtype or device, a grown mask, a regrouping): a step
        # recorded before reads the old ones, so a recorded CUDA graph is valid while its mode's count is unchanged.
        self.versions = {MIXED: 0, SINGLE: 0}
        self.fused = False  # whether layers sharing an input were looked for (`fuse_shared_inputs`)
        # While not yet fused, at the first forward under the routing: the layers in call order, grouped while they
        # are handed the same input, and the input of the last group (held, not its id: no later tensor can take its
        # identity; only that one, so the prefill keeps no more alive than it would)
        self._seen: list[list[LoraLayer]] | None = None
        self._seen_input: torch.Tensor | None = None
        self._seen_ids: set[int] = set()
        self._forwards: dict[int, functools.partial] = {}
        self.active = False  # whether the forwards are installed (inside `installed`)

    @property
    def mode(self) -> str:
        """ "single" when every routed row goes to one adapter, else "mixed"."""
        return MIXED if self.single is None else SINGLE

    @property
    def version(self) -> int:
        """The current mode's count of replaced buffers (`versions`)."""
        return self.versions[self.mode]

    def refresh(self, row_index: list[int], rows: int | None = None) -> None:
        """Copy the adapters' current weights into the buffers and route row `i` to adapter `row_index[i]` (-1: the
        base alone) of batches of up to `rows` rows (default `len(row_index)`); the rows past `row_index` are padding:
        the base alone in the mixed mode, the one adapter (whose delta nothing reads) in the single mode."""
        self.row_index, self.rows = list(row_index), max(rows or 0, len(row_index))
        self.single = row_index[0] if row_index and row_index[0] >= 0 and len(set(row_index)) == 1 else None
        for group in self.groups:
            if group.refresh(self.adapter_names, self.single):
                self.versions[self.mode] += 1
            group.mask = None if self.single is not None else self._mask(group.columns, self.rows, group.lora_a)
        if self.single is None:
            # Only the layouts the groups read now: those of the layers' grouping before `fuse_shared_inputs` are
            # dropped, never refilled (they stayed at the row count of the call that made them).
            used = {(group.columns, group.mask.device, group.mask.dtype) for group in self.groups}
            self.masks = {key: mask for key, mask in self.masks.items() if key in used}
            for (columns, _, _), mask in self.masks.items():
                rows = torch.tensor(self.row_index + [-1] * (mask.shape[0] - len(self.row_index)))
                mask.copy_((rows[:, None] == torch.tensor(columns)[None, :]).to(mask.dtype))
        self._build_forwards()

    def _mask(self, columns: tuple[int, ...], rows: int, like: torch.Tensor) -> torch.Tensor:
        """The mask of a column layout (each rank column's adapter), grown (a new tensor) when a call has more rows."""
        key = (columns, like.device, like.dtype)
        mask = self.masks.get(key)
        if mask is None or mask.shape[0] < rows:
            mask = self.masks[key] = torch.zeros(rows, len(columns), device=like.device, dtype=like.dtype)
            self.versions[MIXED] += 1
            torch._dynamo.mark_static_address(mask)
            torch._dynamo.maybe_mark_dynamic(mask, 0)  # a grown mask does not recompile a compiled step
        return mask

    def _build_forwards(self) -> None:
        for group in self.groups:
            for index, layer in enumerate(group.layers):
                arguments = (group, index, routed_lora_dropout(layer, self.adapter_names))
                forward = self._forwards.get(id(layer))
                if forward is None or any(old is not new for old, new in zip(forward.args, arguments)):
                    self._forwards[id(layer)] = functools.partial(_shared_input_forward, *arguments)
        if self.active:
            self._install()

    def _install(self) -> None:
        seeing = self._seen is not None
        for layer in self.layers:
            forward = self._forwards[id(layer)]
            layer.forward = functools.partial(self._seeing_forward, layer, forward) if seeing else forward

    def _seeing_forward(self, layer: LoraLayer, forward, x, *args, **kwargs):
        if id(layer) not in self._seen_ids:  # a layer called again (a later forward) is placed already
            self._seen_ids.add(id(layer))
            joins = (
                self._seen
                and x is self._seen_input
                and not dropout_is_live(layer, self.adapter_names)
                and not dropout_is_live(self._seen[-1][0], self.adapter_names)
            )
            if joins:
                self._seen[-1].append(layer)
            else:
                self._seen.append([layer])
                self._seen_input = x
        return forward(x, *args, **kwargs)

    @contextmanager
    def installed(self) -> Iterator[None]:
        """Each layer's forward is its tensor-routed one inside the block (until fused, also noting its input)."""
        if not self.fused:
            self._seen, self._seen_ids = [], set()
        self.active = True
        self._install()
        try:
            yield
        finally:
            self.active, self._seen, self._seen_input = False, None, None
            for group in self.groups:  # a forward that raised mid-group leaves its delta: not kept past the block
                group.x = group.delta = None
            for layer in self.layers:
                del layer.forward

    def fuse_shared_inputs(self) -> bool:
        """Group the layers that the forwards run so far in the block handed the same input tensor (in call order),
        each group's LoRA work then one A matmul, one mask and one B matmul (`SharedInput`); whether it regrouped.
        Called once, after a forward of the whole model (the decode loop calls it after the prefill); layers with live
        LoRA dropout stay alone."""
        if self.fused or not self._seen:
            return False
        unseen = [[layer] for layer in self.layers if id(layer) not in self._seen_ids]
        for group in self.groups:  # the ungrouped copies are freed before the grouped ones are made
            group.buffers.clear()
            group.lora_a = group.lora_b = group.mask = None
        self.groups = [SharedInput(layers) for layers in self._seen + unseen]
        self.fused, self._seen, self._seen_input = True, None, None
        self.versions = {mode: count + 1 for mode, count in self.versions.items()}
        self.refresh(self.row_index, self.rows)
        return True


def _shared_input_forward(group: SharedInput, index: int, dropout, x, *args, **kwargs):
    """Layer `index` of `group`: its base layer plus its slice of the group's deltas for `x`, computed by the first
    layer of the group handed `x` and dropped by the last. An input of several tokens (a prefill) gets each layer's
    delta alone: the group's would hold every layer's at once, tokens × their summed widths."""
    layer = group.layers[index]
    output = layer.base_layer(x, *args, **kwargs)
    if len(group.layers) == 1:
        return output + group.delta_of(x, dropout).to(output.dtype)
    if x.dim() > 2 and x.shape[-2] > 1:
        return output + group.layer_delta(x, dropout, index).to(output.dtype)
    if group.x is not x:
        group.x, group.delta = x, group.delta_of(x, dropout)
    delta = group.delta[..., group.output_slices[index]]
    if index == len(group.layers) - 1:
        group.x = group.delta = None
    return output + delta.to(output.dtype)
