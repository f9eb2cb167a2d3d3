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
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, rotate_checkpoints
from trl.trainer.utils import RepeatSampler

from ..agents import adapter_parameters
from ..team.bases import load_base_adapters

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


class TeamCheckpoints:
    """`TeamTrainer`'s checkpoint overrides (`train`, `_save_checkpoint`, `_load_rng_state`, `_get_train_sampler`,
    `_load_from_checkpoint`, `_load_best_model`), each over `GRPOTrainer`'s and built on the functions above: complete
    checkpoints, exact resume, every agent's adapter reloaded in place. A mixin of `TeamTrainer` only, listed before
    `GRPOTrainer`, whose methods its `super()` calls reach."""

    def _get_train_sampler(self, dataset=None):
        # The epoch's order depends on the seed and the epoch only, also in a resumed run.
        return resumable_sampler(super()._get_train_sampler(dataset), epoch=self._resumed_epoch)

    def train(self, resume_from_checkpoint: str | bool | None = None, *args, **kwargs):
        # `True` is the latest *complete* checkpoint; an incomplete one is refused.
        resume_from_checkpoint = checkpoint_to_resume(resume_from_checkpoint, self.args.output_dir)
        self._resumed_epoch = resumed_epoch(resume_from_checkpoint) if resume_from_checkpoint else 0
        try:
            return super().train(resume_from_checkpoint, *args, **kwargs)
        finally:
            self._release_generation()

    def _release_generation(self) -> None:
        """When `train()` returns, also when training failed: the vLLM engine's memory is free for what follows
        (`load_team(..., use_vllm=True)`, another trainer); a later `evaluate()` or `train()` starts it again."""
        if self.use_vllm:
            self.vllm_generation.close()

    def _save_checkpoint(self, model, trial) -> None:
        # Complete or ignored: the marker goes last, once every process wrote its part (and its generation buffer);
        # older checkpoints rotate away only then.
        run_dir = self._get_output_dir(trial=trial)
        checkpoint = os.path.join(run_dir, f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}")
        if self.args.should_save:
            mark_incomplete(checkpoint)
        self.accelerator.wait_for_everyone()
        save_total_limit, self.args.save_total_limit = self.args.save_total_limit, None
        try:
            super()._save_checkpoint(model, trial)
        finally:
            self.args.save_total_limit = save_total_limit
        save_rollout_state(checkpoint, self.accelerator.process_index, self._step, self._buffered_inputs)
        self.accelerator.wait_for_everyone()
        if self.args.should_save:
            mark_complete(checkpoint, self.state.global_step, self.accelerator.num_processes)
            rotate_checkpoints(
                output_dir=run_dir,
                save_total_limit=save_total_limit,
                best_model_checkpoint=self.state.best_model_checkpoint,
                use_mtime=True,
            )
        self.accelerator.wait_for_everyone()

    def _load_rng_state(self, checkpoint: str | None) -> None:
        # Trainer calls this once when it resumes, right before the first step: the generation buffer comes back here.
        super()._load_rng_state(checkpoint)
        if checkpoint is None:
            return
        accelerator = self.accelerator
        state = load_rollout_state(
            checkpoint, accelerator.process_index, accelerator.num_processes, accelerator.device
        )
        if state is not None:
            self._step, self._buffered_inputs = state

    def _load_from_checkpoint(self, resume_from_checkpoint, model=None):
        unwrapped = self.accelerator.unwrap_model(model or self.model)
        if len(self.bases) > 1:
            # Trainer would load every adapter folder of the checkpoint onto the first base, the other bases' too:
            # each base loads its own agents' adapters, in place, in the parameters the optimizer holds.
            for index, base in enumerate(self.bases):
                load_base_adapters(resume_from_checkpoint, base.model, self._base_adapters(index))
            self._set_adapter_trainability([base.model for base in self.bases])
            self._serve_loaded_adapters()
            return
        kept = {name: param for name, param in unwrapped.named_parameters() if "lora_" in name}
        super()._load_from_checkpoint(resume_from_checkpoint, model=model)
        # Trainer reloads every adapter with PEFT's `load_adapter`, which may replace its parameters with float32 ones
        # (on a 4-bit base the adapters train in bf16) and leaves only the active adapter trainable. The loaded values
        # go back into the parameters the optimizer, DDP and the router hold, in their own precision; without this a
        # resumed run would go on in another precision and train a single agent (or a frozen one), and a `train()`
        # after the best model was loaded would find the adapters outside its optimizer.
        with torch.no_grad():
            for name, loaded in list(unwrapped.named_parameters()):
                param = kept.get(name)
                if param is not None and loaded is not param:
                    param.copy_(loaded)
                    module, _, attribute = name.rpartition(".")
                    setattr(unwrapped.get_submodule(module), attribute, param)
        self._set_adapter_trainability([unwrapped])
        self._adapter_parameters = adapter_parameters(unwrapped, self.adapter_names)
        self._serve_loaded_adapters()

    def _load_best_model(self):
        # Trainer looks for one adapter at the checkpoint's root; a team's adapters are in `<adapter>/` folders, which
        # `_load_from_checkpoint` reads (every adapter, in its precision). DeepSpeed and FSDP load their own
        # whole-model state, every adapter included.
        if self.is_deepspeed_enabled or self.is_fsdp_enabled:
            super()._load_best_model()
            self._serve_loaded_adapters()
            return
        logger.info(
            "Loading every agent's adapter from the best checkpoint, %s (%s = %s).",
            self.state.best_model_checkpoint,
            self.args.metric_for_best_model,
            self.state.best_metric,
        )
        self._load_from_checkpoint(self.state.best_model_checkpoint)

    def _serve_loaded_adapters(self) -> None:
        """Adapters loaded outside an optimizer step (a checkpoint, the best model) are no served version of any step:
        the vLLM engine is sent them at its next generation."""
        if self.use_vllm:
            self.vllm_generation.invalidate()
            self._last_loaded_step = -1
