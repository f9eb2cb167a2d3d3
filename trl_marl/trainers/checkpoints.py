"""Checkpoints that a crash cannot corrupt, and resuming exactly where training stopped: the functions and the sampler
that `TeamTrainer`'s checkpoint overrides (`train`, `_save_checkpoint`, `_load_rng_state`, `_get_train_sampler`) use.

`transformers.Trainer` writes `checkpoint-N/` file by file and `resume_from_checkpoint=True` takes the highest N, so
a process killed while writing leaves a folder that looks like the latest checkpoint and cannot be loaded. Here:

- a checkpoint is *complete* once `trl_marl_checkpoint.json` is in it; the file is written last (atomically, by a
  rename) after every process has written its part, and removed first when a folder is written again;
- `resume_from_checkpoint=True` takes the latest complete checkpoint; a path to an incomplete one is an error naming
  the latest complete one;
- older checkpoints are rotated away (`save_total_limit`) only after the new one is complete.

Resuming is exact: besides what `Trainer` restores (every agent's adapter, the optimizer, the scheduler, the RNG
states, the position in the epoch), each process saves GRPO's generation buffer — the completions generated for
`steps_per_generation` optimizer steps and the position in them (`_buffered_inputs`, `_step`) — so a run resumed
between two generations trains on the same completions as one that never stopped. And the order of the prompts in
each epoch is a function of the seed and the epoch (`ResumableRepeatSampler`), so a run resumed in a later epoch, or
exactly at an epoch boundary, sees the prompts in the order the uninterrupted run saw them.
"""

from __future__ import annotations

import json
import logging
import os
import re

import torch
from accelerate.utils import send_to_device
from transformers.trainer import TRAINER_STATE_NAME
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR
from trl.trainer.utils import RepeatSampler

logger = logging.getLogger("trl_marl")

COMPLETE_MARKER = "trl_marl_checkpoint.json"
ROLLOUT_STATE = "trl_marl_rollout_state_{process}.pt"
_CHECKPOINT = re.compile(rf"^{PREFIX_CHECKPOINT_DIR}-(\d+)$")


def is_complete_checkpoint(folder: str | os.PathLike) -> bool:
    """Whether `folder` is a checkpoint whose writing finished (its `trl_marl_checkpoint.json` exists)."""
    return os.path.isfile(os.path.join(folder, COMPLETE_MARKER))


def last_complete_checkpoint(output_dir: str | os.PathLike) -> str | None:
    """The complete `checkpoint-N` folder of `output_dir` with the highest N, or None."""
    if not os.path.isdir(output_dir):
        return None
    steps = [
        (int(match.group(1)), name)
        for name in os.listdir(output_dir)
        if (match := _CHECKPOINT.match(name)) and is_complete_checkpoint(os.path.join(output_dir, name))
    ]
    return os.path.join(output_dir, max(steps)[1]) if steps else None


def resumed_epoch(checkpoint: str | os.PathLike) -> int:
    """The epoch a run resumed from `checkpoint` continues in: the whole part of its `trainer_state.json`'s `epoch`
    (2 after exactly two epochs; 1 halfway through the second)."""
    with open(os.path.join(checkpoint, TRAINER_STATE_NAME)) as file:
        return int(json.load(file).get("epoch") or 0)


def write_json_atomically(path: str, content: dict) -> None:
    """Write `content` to `path` through a temporary file and a rename: readers see the old file or the new one."""
    temporary = f"{path}.tmp"
    with open(temporary, "w") as file:
        json.dump(content, file, indent=2)
        file.flush()
        os.fsync(file.fileno())
    os.replace(temporary, path)


class ResumableRepeatSampler(RepeatSampler):
    """TRL's `RepeatSampler` whose shuffle in epoch `e` is the same whether or not training stopped before it.

    `RepeatSampler` seeds its generator once and draws one permutation per epoch, so epoch `e`'s order is the
    `e+1`-th draw. A resumed run builds a new sampler, whose first draw is epoch 0's order: from the first epoch
    boundary on, it trained on other prompts than the run that never stopped. `Trainer` calls `set_epoch(e)` before
    every epoch (through accelerate's data loader); this puts the generator where the uninterrupted run's generator is
    at the start of epoch `e`: seeded, with `e` permutations drawn.

    A run resumed mid-epoch starts at `epoch`: there `set_epoch` may never arrive, since accelerate's `set_epoch` does
    not reach a sampler under a data loader that skips the trained batches and is sharded over processes.
    """

    def __init__(self, *args, epoch: int = 0, **kwargs):
        super().__init__(*args, **kwargs)
        self.set_epoch(epoch)

    def set_epoch(self, epoch: int) -> None:
        if self.shuffle:
            self.generator.manual_seed(self.seed)
            for _ in range(epoch):
                torch.randperm(self.num_samples, generator=self.generator)


def resumable_sampler(sampler, epoch: int):
    """TRL's shuffling `RepeatSampler` as a `ResumableRepeatSampler` from `epoch` on; any other sampler as it is."""
    if type(sampler) is not RepeatSampler or not sampler.shuffle or sampler.seed is None:
        return sampler
    return ResumableRepeatSampler(
        data_source=sampler.data_source,
        mini_repeat_count=sampler.mini_repeat_count,
        batch_size=sampler.batch_size,
        repeat_count=sampler.repeat_count,
        shuffle=sampler.shuffle,
        seed=sampler.seed,
        epoch=epoch,
    )


def checkpoint_to_resume(resume_from_checkpoint: str | bool | None, output_dir: str) -> str | None:
    """The checkpoint `train(resume_from_checkpoint=...)` resumes from: the latest complete one of `output_dir` for
    `True`, a given folder if it is complete, None for none. Raises `ValueError` naming what to pass instead."""
    if resume_from_checkpoint is True:
        latest = last_complete_checkpoint(output_dir)
        if latest is None:
            raise ValueError(
                f"resume_from_checkpoint=True, but {output_dir} holds no complete checkpoint (a `checkpoint-N` "
                f"folder with {COMPLETE_MARKER}). Train without resuming, or pass the folder of one."
            )
        logger.info("Resuming from %s, the latest complete checkpoint.", latest)
        return latest
    if resume_from_checkpoint and not is_complete_checkpoint(resume_from_checkpoint):
        latest = last_complete_checkpoint(os.path.dirname(os.path.abspath(resume_from_checkpoint)))
        raise ValueError(
            f"{resume_from_checkpoint} is not a complete trl_marl checkpoint: it has no {COMPLETE_MARKER}, so its "
            "writing did not finish (the process stopped while saving it) or it was not written by a trl_marl "
            f"trainer. The latest complete checkpoint beside it: {latest}. Resume from that one (or pass "
            "resume_from_checkpoint=True)."
        )
    return resume_from_checkpoint or None


def mark_incomplete(checkpoint: str) -> None:
    """Before a checkpoint folder is written (again): until `mark_complete`, it is incomplete."""
    marker = os.path.join(checkpoint, COMPLETE_MARKER)
    if os.path.exists(marker):
        os.remove(marker)


def save_rollout_state(checkpoint: str, process: int, step: int, buffered_inputs) -> None:
    """This process's generation buffer (GRPO's `_buffered_inputs` and `_step`) into `checkpoint`."""
    os.makedirs(checkpoint, exist_ok=True)
    path = os.path.join(checkpoint, ROLLOUT_STATE.format(process=process))
    torch.save({"step": step, "buffered_inputs": buffered_inputs}, path)


def mark_complete(checkpoint: str, global_step: int, num_processes: int) -> None:
    """Written last, once every process wrote its part: the checkpoint is complete."""
    content = {"global_step": global_step, "num_processes": num_processes}
    write_json_atomically(os.path.join(checkpoint, COMPLETE_MARKER), content)


def load_rollout_state(checkpoint: str, process: int, num_processes: int, device) -> tuple[int, list] | None:
    """`(step, buffered_inputs)` this process saved in `checkpoint`, on `device`; None (with a warning: the first
    step after resuming generates anew) when it has none, or the number of processes changed."""
    path = os.path.join(checkpoint, ROLLOUT_STATE.format(process=process))
    with open(os.path.join(checkpoint, COMPLETE_MARKER)) as file:
        saved_processes = json.load(file).get("num_processes")
    if not os.path.isfile(path) or saved_processes != num_processes:
        logger.warning(
            "%s has no generation buffer for %d process(es) (it was saved by %s): the first step after resuming "
            "generates new completions, so the run is not an exact continuation.",
            checkpoint,
            num_processes,
            saved_processes,
        )
        return None
    # Loaded on the host, then moved: under several CPU processes the device is `cpu:0`, which `torch.load` cannot
    # map storages to.
    state = torch.load(path, map_location="cpu", weights_only=False)
    return state["step"], send_to_device(state["buffered_inputs"], device)
