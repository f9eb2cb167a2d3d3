"""The rows a rollout hands to TRL: the check that each group's rows are one dataset row's copies, and the padding
of a generation batch to the equal row counts TRL needs, with the loss scale that keeps padding rows out of it.
"""

import hashlib
import re
from collections.abc import Callable
from typing import Any

import torch
from trl.trainer.utils import pad


def _local(items: list) -> list:
    return list(items)


def _feed(hasher, value: Any) -> None:
    """Feed a dataset value's contents to `hasher`: equal contents, equal bytes, whatever the objects.

    A row's copies are separate objects (one `__getitem__` each), so identities and memory addresses must not count,
    and arrays must count whole (their `repr` elides the middle of a large one)."""
    if value is None or isinstance(value, bool | int | float | complex | str | bytes):
        hasher.update(f"{type(value).__name__}:{value!r};".encode())
    elif isinstance(value, dict):
        hasher.update(b"{")
        for key in sorted(value, key=repr):
            _feed(hasher, key)
            _feed(hasher, value[key])
        hasher.update(b"}")
    elif isinstance(value, list | tuple):
        hasher.update(b"[")
        for item in value:
            _feed(hasher, item)
        hasher.update(b"]")
    elif isinstance(value, torch.Tensor):
        hasher.update(f"tensor{tuple(value.shape)}{value.dtype};".encode())
        hasher.update(value.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    elif callable(getattr(value, "tobytes", None)):  # numpy arrays, PIL images
        shape = getattr(value, "shape", None) or (getattr(value, "mode", None), getattr(value, "size", None))
        hasher.update(f"{type(value).__name__}{shape}{getattr(value, 'dtype', '')};".encode())
        hasher.update(value.tobytes())
    else:  # anything else: its repr, unless that names an address (the default `object.__repr__`)
        text = repr(value)
        hasher.update((type(value).__qualname__ if re.search(r" at 0x[0-9a-fA-F]+", text) else text).encode())


def row_digest(example: dict) -> str:
    """A digest of a dataset row's contents (see `_feed`): two copies of one row get the same one."""
    hasher = hashlib.blake2b(digest_size=8)
    _feed(hasher, example)
    return hasher.hexdigest()


def check_group_layout(
    examples: list[dict], first_copy: int, num_generations: int, gather: Callable[[list], list] = _local
) -> None:
    """Check that the copies grouped as one problem are one dataset row.

    Groups are keyed by the global copy index `// num_generations`: that is right only under the layout of TRL's
    `RepeatSampler`, which yields each dataset row `num_generations` times in a row, identically on every process. A
    sampler that breaks it would silently compare candidates of different problems. A row has no index of its own
    once it reaches the trainer, so rows are compared by a digest of their contents ([`row_digest`]), gathered over
    processes (a group may span them). Identical rows at different dataset indices are one problem to this check,
    which is harmless: their candidates answer the same question.

    Raises:
        ValueError: a group holds copies of different rows; it names the copies and the sampler.
    """
    digests = [(first_copy + row, row_digest(example)) for row, example in enumerate(examples)]
    first_of_group: dict[int, tuple[int, str]] = {}
    for copy_index, digest in gather(digests):
        group = copy_index // num_generations
        first_index, first_digest = first_of_group.setdefault(group, (copy_index, digest))
        if digest != first_digest:
            raise ValueError(
                f"Rows {first_index} and {copy_index} of the generation batch are grouped as copies of one problem "
                f"(every {num_generations} consecutive rows, num_generations={num_generations}) but are different "
                "dataset rows. Groups follow the layout of TRL's `RepeatSampler` (the trainer's "
                "`_get_train_sampler`): each dataset row `num_generations` times in a row, in the same order on "
                "every process. Keep that sampler, or make yours yield that layout; a dataset transform that "
                "returns different contents for the same row (random augmentation) breaks it too."
            )


def pad_rows(samples: dict, num_rows: int) -> dict:
    """Pad a batch of rows to `num_rows` with copies of its first row that carry no loss: completion mask 0,
    advantage 0, and `is_padding` True.

    TRL splits a generation batch into `steps_per_generation` equal micro-batches, and its loss gathers per-row
    metrics over processes, which needs equal row counts on every process; a tree yields a varying number of rows.
    A copy of a real row (rather than an empty one) keeps every forward finite. Tensors with one entry per row are
    padded; 0-dim tensors (`num_items_in_batch`, which counts real tokens only) and `None` are kept.
    """
    num_real = len(samples["advantages"])
    if num_rows < num_real:
        raise ValueError(f"Cannot pad {num_real} rows down to {num_rows}.")
    padded = dict(samples)
    for key, value in samples.items():
        if isinstance(value, torch.Tensor) and value.ndim > 0:
            filler = value[:1].expand(num_rows - num_real, *value.shape[1:])
            if key in ("completion_mask", "advantages"):
                filler = torch.zeros_like(filler)
            padded[key] = torch.cat([value, filler])
    is_padding = torch.zeros(num_rows, dtype=torch.bool, device=samples["advantages"].device)
    is_padding[num_real:] = True
    padded["is_padding"] = is_padding
    return padded


# Loss types that TRL normalises by the rows of a micro-batch (padding rows included) rather than by loss tokens.
PER_ROW_LOSS_TYPES = ("grpo", "sapo", "dr_grpo", "luspo")
# Loss types that TRL normalises by the real tokens of one micro-batch.
MICRO_BATCH_TOKEN_LOSS_TYPES = ("bnpo",)


def padding_loss_scale(
    loss_type: str, rows: int, real_rows: int, total_real_rows: int, num_chunks: int, num_processes: int
) -> float:
    """The factor by which the trainer multiplies TRL's loss of one micro-batch so that padding rows change nothing.

    A generation batch holds `B` rows per process after padding, `R` real rows over the `P` processes
    (`total_real_rows`); TRL splits it into `S` micro-batches (`num_chunks`; 1 in evaluation) of `b = B / S` rows
    (`rows`), `r` of them real (`real_rows`), accumulates GA of them per optimizer step and DDP averages the processes.
    Without padding (`R = P · B`) TRL weighs every row of a generation alike, `S / (GA · R)` (`1 / R` per step when
    `S = GA`); the factor gives the real rows exactly that weight, as if they were the whole generation batch:

    - `grpo`, `sapo` (mean over rows of per-row token means), `dr_grpo` (sum / (rows · max length)) and `luspo` (mean
      over rows of per-row sums) divide a micro-batch by its `b` rows, padding rows included, so a row weighs
      `1 / (GA · P · b)`:  `scale = P · S · b / R`  (= `P · B / R`, the same for every micro-batch).
    - `bnpo` divides a micro-batch by its own real tokens, so padding rows change no micro-batch's loss; but TRL weighs
      every micro-batch `1 / (GA · P)` however few real rows it holds (one that is all padding still counts in the
      average). Weighted by its real rows instead, as every micro-batch holds `b` real rows without padding:
      `scale = P · S · r / R`.
    - `dapo`, `cispo` and `vespo` divide by `num_items_in_batch`, the real tokens of the whole generation over every
      process: exact already, `scale = 1`.

    Without padding (`r = b`, `R = P · S · b`) every factor is 1; with `R = 0` nothing trains and the factor is 1.
    """
    if total_real_rows == 0:
        return 1.0
    if loss_type in PER_ROW_LOSS_TYPES:
        return num_processes * num_chunks * rows / total_real_rows
    if loss_type in MICRO_BATCH_TOKEN_LOSS_TYPES:
        return num_processes * num_chunks * real_rows / total_real_rows
    return 1.0


def tool_masks(samples: list, pad_to_multiple_of: int | None, device: torch.device) -> torch.Tensor:
    """The rows' tool masks (`Sample.tool_mask`: 0 on tool results' tokens; a row without one, all 1), right-padded
    with 1 as TRL pads them (the completion mask zeroes the padding)."""
    masks = [
        torch.tensor(s.tool_mask if s.tool_mask is not None else [1] * len(s.completion_ids), dtype=torch.long)
        for s in samples
    ]
    return pad(masks, padding_value=1, padding_side="right", pad_to_multiple_of=pad_to_multiple_of).to(device)


def pad_samples(
    prompt_ids_list: list[list[int]],
    completion_ids_list: list[list[int]],
    pad_id: int,
    pad_to_multiple_of: int | None,
    device: torch.device,
    eos_token_ids: list[int] | None = None,
    no_loss: bool = False,
) -> dict:
    """Rows as TRL's loss takes them: prompts padded on the left, completions on the right, with their masks.

    With `eos_token_ids` (TRL's `mask_truncated_completions`) a completion that ends in neither an EOS nor padding
    carries no loss; a list per row gives each row the tokens that end it (its base's EOS and padding, for a team on
    several bases); with `no_loss` no row does.
    """

    def padded(sequences, value, side):
        tensors = [torch.tensor(s, dtype=torch.long) for s in sequences]
        return pad(tensors, padding_value=value, padding_side=side, pad_to_multiple_of=pad_to_multiple_of).to(device)

    prompt_ids = padded(prompt_ids_list, pad_id, "left")
    prompt_mask = padded([[1] * len(s) for s in prompt_ids_list], 0, "left")
    completion_ids = padded(completion_ids_list, pad_id, "right")
    completion_mask = padded([[1] * len(s) for s in completion_ids_list], 0, "right")
    if eos_token_ids is not None:
        if eos_token_ids and isinstance(eos_token_ids[0], (list, tuple)):  # per row: its own base's stops
            stops = eos_token_ids
        else:
            stops = [[*eos_token_ids, pad_id]] * len(completion_ids_list)
        is_truncated = torch.tensor(
            [ids[-1] not in stop for ids, stop in zip(completion_ids_list, stops)], device=device
        )
        completion_mask = completion_mask * (~is_truncated).unsqueeze(1).int()
    if no_loss:
        completion_mask = torch.zeros_like(completion_mask)
    return {
        "prompt_ids": prompt_ids,
        "prompt_mask": prompt_mask,
        "completion_ids": completion_ids,
        "completion_mask": completion_mask,
    }
