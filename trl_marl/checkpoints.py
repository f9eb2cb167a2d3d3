"""Checkpoints that a crash cannot corrupt, and resuming exactly where training stopped (a mixin of the trainers).

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
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, rotate_checkpoints
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


class CheckpointMixin:
    """Crash-safe checkpoints and exact resume for a `GRPOTrainer` subclass (see the module docstring)."""

    def _get_train_sampler(self, dataset=None):
        sampler = super()._get_train_sampler(dataset)
        if type(sampler) is not RepeatSampler or not sampler.shuffle or sampler.seed is None:
            return sampler
        return ResumableRepeatSampler(
            data_source=sampler.data_source,
            mini_repeat_count=sampler.mini_repeat_count,
            batch_size=sampler.batch_size,
            repeat_count=sampler.repeat_count,
            shuffle=sampler.shuffle,
            seed=sampler.seed,
            epoch=getattr(self, "_resumed_epoch", 0),
        )

    def train(self, resume_from_checkpoint: str | bool | None = None, *args, **kwargs):
        if resume_from_checkpoint is True:
            resume_from_checkpoint = last_complete_checkpoint(self.args.output_dir)
            if resume_from_checkpoint is None:
                raise ValueError(
                    f"resume_from_checkpoint=True, but {self.args.output_dir} holds no complete checkpoint (a "
                    f"`checkpoint-N` folder with {COMPLETE_MARKER}). Train without resuming, or pass the folder of "
                    "one."
                )
            logger.info("Resuming from %s, the latest complete checkpoint.", resume_from_checkpoint)
        elif resume_from_checkpoint and not is_complete_checkpoint(resume_from_checkpoint):
            latest = last_complete_checkpoint(os.path.dirname(os.path.abspath(resume_from_checkpoint)))
            raise ValueError(
                f"{resume_from_checkpoint} is not a complete trl_marl checkpoint: it has no {COMPLETE_MARKER}, so its "
                "writing did not finish (the process stopped while saving it) or it was not written by a trl_marl "
                f"trainer. The latest complete checkpoint beside it: {latest}. Resume from that one (or pass "
                "resume_from_checkpoint=True)."
            )
        self._resumed_epoch = resumed_epoch(resume_from_checkpoint) if resume_from_checkpoint else 0
        return super().train(resume_from_checkpoint, *args, **kwargs)

    def _save_checkpoint(self, model, trial) -> None:
        run_dir = self._get_output_dir(trial=trial)
        checkpoint = os.path.join(run_dir, f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}")
        marker = os.path.join(checkpoint, COMPLETE_MARKER)
        if self.args.should_save and os.path.exists(marker):
            os.remove(marker)  # the folder is being written again: incomplete until this save finishes
        self.accelerator.wait_for_everyone()
        save_total_limit, self.args.save_total_limit = self.args.save_total_limit, None
        try:
            super()._save_checkpoint(model, trial)  # with rotation postponed until this checkpoint is complete
        finally:
            self.args.save_total_limit = save_total_limit
        os.makedirs(checkpoint, exist_ok=True)
        rollout_state = {"step": self._step, "buffered_inputs": self._buffered_inputs}
        torch.save(
            rollout_state, os.path.join(checkpoint, ROLLOUT_STATE.format(process=self.accelerator.process_index))
        )
        self.accelerator.wait_for_everyone()
        if self.args.should_save:
            write_json_atomically(
                marker, {"global_step": self.state.global_step, "num_processes": self.accelerator.num_processes}
            )
            rotate_checkpoints(
                output_dir=run_dir,
                save_total_limit=save_total_limit,
                best_model_checkpoint=self.state.best_model_checkpoint,
                use_mtime=True,
            )
        self.accelerator.wait_for_everyone()

    def _load_rng_state(self, checkpoint: str | None) -> None:
        # Trainer calls this once when it resumes, right before the first step; restore the generation buffer there.
        super()._load_rng_state(checkpoint)
        if checkpoint is None:
            return
        path = os.path.join(checkpoint, ROLLOUT_STATE.format(process=self.accelerator.process_index))
        with open(os.path.join(checkpoint, COMPLETE_MARKER)) as file:
            saved_processes = json.load(file).get("num_processes")
        if not os.path.isfile(path) or saved_processes != self.accelerator.num_processes:
            logger.warning(
                "%s has no generation buffer for %d process(es) (it was saved by %s): the first step after resuming "
                "generates new completions, so the run is not an exact continuation.",
                checkpoint,
                self.accelerator.num_processes,
                saved_processes,
            )
            return
        # Loaded on the host, then moved: under several CPU processes the device is `cpu:0`, which `torch.load` cannot
        # map storages to.
        state = torch.load(path, map_location="cpu", weights_only=False)
        self._step, self._buffered_inputs = (
            state["step"],
            send_to_device(state["buffered_inputs"], self.accelerator.device),
        )
