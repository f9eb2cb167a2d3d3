"""`MAGRPOTrainer`: TRL's `GRPOTrainer` where each prompt is answered by a team of LoRA agents on one base model.

What is multi-agent, and therefore overridden:
- `_generate_and_score_completions`: every agent answers every prompt copy (one `generate` call for the team,
  rows routed to their agent's adapter); joint actions get one team reward; advantages follow MAGRPO (§3 of
  DESIGN.md); the result holds one row per (prompt copy, agent) with `agent_index`, `turn_index`, `group_index`.
- `_get_per_token_logps_and_entropies` / `_compute_loss`: each row's log-probs come from its agent's adapter.
Everything else (loss types, clipping, KL to the base, gradient accumulation, logging, checkpoints) is TRL's.
"""

import itertools

import torch
from accelerate.utils import gather_object, set_seed
from datasets import Dataset, IterableDataset
from transformers import PreTrainedTokenizerBase, TrainerCallback
from trl import GRPOTrainer
from trl.models.utils import disable_gradient_checkpointing
from trl.trainer.utils import create_model_from_path, nanstd, pad, use_adapter

from .advantages import aligned_credit, cross_credit, group_advantages, team_rewards
from .agents import (
    agent_adapter_names,
    agent_prompt,
    attach_agent_adapters,
    completion_text,
    keep_4bit_weights_trainable,
    lora_config_from_args,
)
from .config import MAGRPOConfig
from .rewards import TeamRewardFunc, checked_team_reward
from .routing import AdapterRouter


class MAGRPOTrainer(GRPOTrainer):
    """Multi-agent GRPO (MAGRPO, arXiv 2508.04652) as a thin [`~trl.GRPOTrainer`] subclass.

    Args:
        model: a model id or local path, a loaded `PreTrainedModel` (adapters are added, one per agent), or a
            `PeftModel` that already carries one adapter per agent (named after the agents).
        reward_funcs: team reward function(s) `f(prompts, completions, **kwargs) -> list[float | None]`, where each
            completion is a mapping agent name -> text and kwargs carry the dataset columns, `completion_ids` (a
            mapping agent name -> token ids), `turn` and TRL's `trainer_state`, `log_extra`, `log_metric`.
        args: a [`MAGRPOConfig`] (it names the agents).
        quantization_config: e.g. a 4-bit `BitsAndBytesConfig`, used when `model` is an id or path.
        peft_config: a `LoraConfig` for every agent's adapter; defaults to one built from the `lora_*` fields.
        The other arguments are TRL's.
    """

    _tag_names = ["trl", "trl-marl", "magrpo"]
    _name = "MAGRPO"

    def __init__(
        self,
        model,
        reward_funcs: TeamRewardFunc | list[TeamRewardFunc],
        args: MAGRPOConfig | None = None,
        train_dataset: Dataset | IterableDataset | None = None,
        eval_dataset: Dataset | IterableDataset | dict | None = None,
        processing_class: PreTrainedTokenizerBase | None = None,
        callbacks: list[TrainerCallback] | None = None,
        optimizers: tuple = (None, None),
        quantization_config=None,
        peft_config=None,
    ):
        if not isinstance(args, MAGRPOConfig):
            raise TypeError(
                f"`args` must be a MAGRPOConfig naming the agents, got {type(args).__name__}, e.g. "
                "MAGRPOConfig(output_dir='out', agents=['concise', 'detailed'])."
            )
        reward_funcs = reward_funcs if isinstance(reward_funcs, list) else [reward_funcs]
        if not reward_funcs:
            raise ValueError("`reward_funcs` is empty: give at least one team reward function.")
        reward_funcs = [checked_team_reward(func) for func in reward_funcs]

        if isinstance(model, str):
            model_init_kwargs = dict(args.model_init_kwargs or {})
            if quantization_config is not None:
                model_init_kwargs["quantization_config"] = quantization_config
            if args.distributed_state.distributed_type in ["MULTI_GPU", "DEEPSPEED"]:
                model_init_kwargs["device_map"] = None
            model_init_kwargs.setdefault("trust_remote_code", args.trust_remote_code)
            model = create_model_from_path(model, **model_init_kwargs)

        self.agent_names = args.agent_names
        self.agent_adapters = agent_adapter_names(args)
        self.adapter_names = list(dict.fromkeys(self.agent_adapters))  # each adapter once
        # As TRL: seed before creating adapters, so their initialisation is reproducible (and equal to TRL's).
        set_seed(args.seed)
        model = attach_agent_adapters(model, self.agent_adapters, peft_config or lora_config_from_args(args))

        if args.ddp_find_unused_parameters is None and len(self.adapter_names) > 1:
            # A micro-batch may hold rows of only some agents; the other adapters then get no gradient under DDP.
            args.ddp_find_unused_parameters = True

        # TRL would clone an adapter named "default" as the KL reference when given a PeftModel with beta != 0; with
        # fresh adapters the base model (adapters disabled) is every agent's reference, which TRL uses when no "ref"
        # adapter exists. model_init_kwargs were used above; TRL would warn that they are ignored.
        beta, model_init_kwargs = args.beta, args.model_init_kwargs
        args.beta, args.model_init_kwargs = 0.0, None
        try:
            super().__init__(
                model=model,
                reward_funcs=reward_funcs,
                args=args,
                train_dataset=train_dataset,
                eval_dataset=eval_dataset,
                processing_class=processing_class,
                callbacks=callbacks,
                optimizers=optimizers,
            )
        finally:
            args.beta, args.model_init_kwargs = beta, model_init_kwargs
        self.beta = beta

        self.num_agents = args.num_agents
        self.joint_mode = args.joint_mode
        self.baseline = args.baseline
        self._use_chat_template = getattr(self.processing_class, "chat_template", None) is not None
        # One adapter needs no routing, which keeps the single-agent case numerically identical to GRPOTrainer.
        unwrapped = self.accelerator.unwrap_model(self.model)
        self.router = AdapterRouter(unwrapped, self.adapter_names) if len(self.adapter_names) > 1 else None
        keep_4bit_weights_trainable(unwrapped)
        self._rows_agent_index: torch.Tensor | None = None

    # ------------------------------------------------------------------ routing

    def _route_rows(self, agent_index: torch.Tensor | list[int]) -> None:
        if self.router is not None:
            self.router.route([self.agent_adapters[int(i)] for i in agent_index])

    def _get_per_token_logps_and_entropies(
        self, model, input_ids, attention_mask, logits_to_keep, batch_size=None, **kwargs
    ):
        agent_index = self._rows_agent_index
        if self.router is None or agent_index is None:
            return super()._get_per_token_logps_and_entropies(
                model, input_ids, attention_mask, logits_to_keep, batch_size=batch_size, **kwargs
            )
        if len(agent_index) != input_ids.size(0):
            raise RuntimeError(
                f"{len(agent_index)} agent indices for {input_ids.size(0)} rows: rows lost their agents."
            )
        batch_size = batch_size or input_ids.size(0)
        logps, entropies, aux_losses = [], [], []
        for start in range(0, input_ids.size(0), batch_size):
            end = start + batch_size
            # The routing stays set after this call: gradient checkpointing replays this forward in the backward.
            self._route_rows(agent_index[start:end])
            chunk_logps, chunk_entropies, chunk_aux = super()._get_per_token_logps_and_entropies(
                model, input_ids[start:end], attention_mask[start:end], logits_to_keep, **kwargs
            )
            logps.append(chunk_logps)
            entropies.append(chunk_entropies)
            aux_losses.append(chunk_aux)
        entropies = torch.cat(entropies) if entropies[0] is not None else None
        aux_loss = torch.stack(aux_losses).mean() if aux_losses[0] is not None else None
        return torch.cat(logps), entropies, aux_loss

    def _compute_loss(self, model, inputs):
        self._rows_agent_index = inputs["agent_index"]
        return super()._compute_loss(model, inputs)

    def _clear_routing(self) -> None:
        self._rows_agent_index = None
        if self.router is not None:
            self.router.route(None)

    def training_step(self, model, inputs, num_items_in_batch):
        # The routing of a micro-batch must outlive its forward (checkpointing replays it in the backward) but not
        # the step: afterwards the model answers to `set_adapter` again.
        try:
            return super().training_step(model, inputs, num_items_in_batch)
        finally:
            self._clear_routing()

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        try:
            return super().prediction_step(model, inputs, prediction_loss_only, ignore_keys=ignore_keys)
        finally:
            self._clear_routing()

    def _load_from_checkpoint(self, resume_from_checkpoint, model=None):
        super()._load_from_checkpoint(resume_from_checkpoint, model=model)
        # Trainer reloads every adapter of a PeftModel but leaves only the active one trainable, and builds the
        # optimizer afterwards: without this, a resumed run would train a single agent.
        self.accelerator.unwrap_model(model or self.model).set_requires_grad(self.adapter_names, requires_grad=True)

    # ------------------------------------------------------------------ rollout

    def _generate_and_score_completions(self, inputs: list[dict]) -> dict:
        device = self.accelerator.device
        mode = "train" if self.model.training else "eval"
        num_generations = self.num_generations if mode == "train" else self.num_generations_eval
        num_rows, num_agents = len(inputs), self.num_agents
        prompts = [example["prompt"] for example in inputs]

        # Row-major samples: sample r * N + a is agent a's answer to prompt copy r.
        agent_index = torch.arange(num_agents).repeat(num_rows)
        agent_prompts = [
            agent_prompt(agent["system_prompt"], prompt, self._use_chat_template)
            for prompt in prompts
            for agent in self.args.agents
        ]
        self._route_rows(agent_index)
        try:
            prompt_ids_list, completion_ids_list, _, completions, *_ = self._generate(agent_prompts)
        finally:
            self._clear_routing()
        texts = [completion_text(c) for c in completions]

        rewards_per_func, joint_prompts, joint_completions = self._score_joint_actions(
            inputs, prompts, texts, completion_ids_list, num_generations
        )
        rewards = team_rewards(rewards_per_func, self.reward_weights)
        group_size = num_generations if self.joint_mode == "aligned" else num_generations**num_agents
        joint_advantages, std = group_advantages(rewards.view(-1, group_size), self.baseline, self.scale_rewards)
        if self.joint_mode == "aligned":
            credit = aligned_credit(joint_advantages, num_agents)
        else:
            credit = cross_credit(joint_advantages, num_agents, num_generations)
        credit = credit.reshape(-1, num_agents)  # (global prompt copies, N)
        first_row = self.accelerator.process_index * num_rows
        advantages = credit[first_row : first_row + num_rows].reshape(-1)

        output = self._pad_samples(prompt_ids_list, completion_ids_list)
        output["advantages"] = advantages
        output["agent_index"] = agent_index.to(device)
        output["turn_index"] = torch.zeros_like(output["agent_index"])
        row_of_sample = torch.arange(num_rows, device=device).repeat_interleave(num_agents)
        output["group_index"] = (first_row + row_of_sample) // num_generations
        output.update(self._reference_logps(output, mode))

        self._log_team_metrics(mode, rewards_per_func, rewards, std, credit, completion_ids_list)
        self._log_joint_actions(mode, joint_prompts, joint_completions, rewards_per_func, joint_advantages)
        return output

    def _score_joint_actions(self, inputs, prompts, texts, completion_ids_list, num_generations):
        """Team rewards of this process's joint actions, gathered over processes: `(J_global, F)`.

        Aligned: one joint action per prompt copy. Cross: prompt copy r holds the joint actions where the first agent
        plays r's completion and every other agent any completion of the group, so groups stay contiguous.
        """
        num_agents, names = self.num_agents, self.agent_names
        per_row_texts = [texts[r * num_agents : (r + 1) * num_agents] for r in range(len(inputs))]
        per_row_ids = [completion_ids_list[r * num_agents : (r + 1) * num_agents] for r in range(len(inputs))]
        if self.joint_mode == "aligned":
            choices = [[(r, a) for a in range(num_agents)] for r in range(len(inputs))]
            sources_texts, sources_ids = per_row_texts, per_row_ids
            joint_rows = list(range(len(inputs)))
        else:
            # Other agents' completions of a group may live on other processes.
            sources_texts, sources_ids = gather_object(per_row_texts), gather_object(per_row_ids)
            offset = self.accelerator.process_index * len(inputs)
            choices, joint_rows = [], []
            for r in range(len(inputs)):
                group_start = (offset + r) // num_generations * num_generations
                for others in itertools.product(range(num_generations), repeat=num_agents - 1):
                    choices.append([(offset + r, 0)] + [(group_start + g, a + 1) for a, g in enumerate(others)])
                    joint_rows.append(r)
        joint_completions = [{names[a]: sources_texts[row][a] for row, a in choice} for choice in choices]
        joint_ids = [{names[a]: sources_ids[row][a] for row, a in choice} for choice in choices]
        joint_inputs = [{**inputs[r], "turn": 0} for r in joint_rows]
        joint_prompts = [prompts[r] for r in joint_rows]
        rewards_per_func = self._calculate_rewards(joint_inputs, joint_prompts, joint_completions, joint_ids)
        return rewards_per_func, joint_prompts, joint_completions

    def _pad_samples(self, prompt_ids_list, completion_ids_list) -> dict:
        device, pad_id = self.accelerator.device, self._tokenizer.pad_token_id

        def padded(sequences, value, side):
            tensors = [torch.tensor(s, dtype=torch.long) for s in sequences]
            return pad(tensors, padding_value=value, padding_side=side, pad_to_multiple_of=self.pad_to_multiple_of).to(
                device
            )

        prompt_ids = padded(prompt_ids_list, pad_id, "left")
        prompt_mask = padded([[1] * len(s) for s in prompt_ids_list], 0, "left")
        completion_ids = padded(completion_ids_list, pad_id, "right")
        completion_mask = padded([[1] * len(s) for s in completion_ids_list], 0, "right")
        if self.mask_truncated_completions:
            eos_and_pad = [*self.eos_token_ids, pad_id]
            is_truncated = torch.tensor([ids[-1] not in eos_and_pad for ids in completion_ids_list], device=device)
            completion_mask = completion_mask * (~is_truncated).unsqueeze(1).int()
        return {
            "prompt_ids": prompt_ids,
            "prompt_mask": prompt_mask,
            "completion_ids": completion_ids,
            "completion_mask": completion_mask,
            "num_items_in_batch": self.accelerator.gather(completion_mask.sum()).sum(),
        }

    def _reference_logps(self, samples: dict, mode: str) -> dict:
        """Old log-probs (when generation and optimisation steps are misaligned, as TRL) and, with `beta != 0`, the
        base model's log-probs (adapters disabled: the shared reference of every agent)."""
        generate_every = self.args.steps_per_generation * self.num_iterations
        need_old = self.args.gradient_accumulation_steps % generate_every != 0
        if not need_old and self.beta == 0.0:
            return {}
        input_ids = torch.cat([samples["prompt_ids"], samples["completion_ids"]], dim=1)
        attention_mask = torch.cat([samples["prompt_mask"], samples["completion_mask"]], dim=1)
        logits_to_keep = samples["completion_ids"].size(1)
        batch_size = self.args.per_device_train_batch_size if mode == "train" else self.args.per_device_eval_batch_size
        self._rows_agent_index = samples["agent_index"]
        logps = {}
        with torch.no_grad(), disable_gradient_checkpointing(self.model, self.args.gradient_checkpointing_kwargs):
            if need_old:
                logps["old_per_token_logps"], _, _ = self._get_per_token_logps_and_entropies(
                    self.model, input_ids, attention_mask, logits_to_keep, batch_size=batch_size
                )
            if self.beta != 0.0:
                with use_adapter(self.accelerator.unwrap_model(self.model), adapter_name=None):
                    logps["ref_per_token_logps"], _, _ = self._get_per_token_logps_and_entropies(
                        self.model, input_ids, attention_mask, logits_to_keep, batch_size=batch_size
                    )
        self._clear_routing()
        return logps

    # ------------------------------------------------------------------ metrics

    def _log_team_metrics(self, mode, rewards_per_func, rewards, std, credit, completion_ids_list):
        metrics = self._metrics[mode]
        for i, name in enumerate(self.reward_func_names):
            metrics[f"rewards/{name}/mean"].append(torch.nanmean(rewards_per_func[:, i]).item())
            metrics[f"rewards/{name}/std"].append(nanstd(rewards_per_func[:, i]).item())
        metrics["reward"].append(torch.nanmean(rewards).item())
        metrics["reward_std"].append(nanstd(rewards).item())
        metrics["frac_reward_zero_std"].append(torch.isclose(std, torch.zeros_like(std)).float().mean().item())

        device, num_agents = self.accelerator.device, self.num_agents
        eos_and_pad = [*self.eos_token_ids, self._tokenizer.pad_token_id]
        lengths = torch.tensor([len(ids) for ids in completion_ids_list], device=device).view(-1, num_agents)
        truncated = torch.tensor([ids[-1] not in eos_and_pad for ids in completion_ids_list], device=device)
        lengths = self.accelerator.gather(lengths).float()
        truncated = self.accelerator.gather(truncated.view(-1, num_agents)).float()
        for a, name in enumerate(self.agent_names):
            metrics[f"agents/{name}/completion_length"].append(lengths[:, a].mean().item())
            metrics[f"agents/{name}/clipped_ratio"].append(truncated[:, a].mean().item())
            metrics[f"agents/{name}/advantage_mean"].append(credit[:, a].mean().item())
            metrics[f"agents/{name}/advantage_std"].append(credit[:, a].std().item() if len(credit) > 1 else 0.0)

    def _log_joint_actions(self, mode, joint_prompts, joint_completions, rewards_per_func, joint_advantages):
        """The completions table: one line per joint action (its prompt, the agents' answers, rewards, advantage)."""
        self._logs["prompt"].extend(gather_object(joint_prompts))
        self._logs["completion"].extend(
            gather_object(["\n\n".join(f"[{n}] {t}" for n, t in joint.items()) for joint in joint_completions])
        )
        for i, name in enumerate(self.reward_func_names):
            self._logs["rewards"][name].extend(rewards_per_func[:, i].tolist())
        self._logs["advantages"].extend(joint_advantages.reshape(-1).tolist())
        self._flush_reward_logs(mode, len(joint_prompts))

    def _flush_reward_logs(self, mode: str, num_local: int) -> None:
        """Gather what reward functions logged through `log_extra` / `log_metric`, as GRPOTrainer does."""
        for column in sorted(set(gather_object(list(self._pending_extra_logs)))):
            values = self._pending_extra_logs.get(column, [None] * num_local)
            self._logs["extra"][column].extend(gather_object(values))
        self._pending_extra_logs.clear()
        for name in sorted(set(gather_object(list(self._pending_metrics)))):
            values = self._pending_metrics.get(name, [])
            local = torch.tensor([sum(values), len(values)], dtype=torch.float32, device=self.accelerator.device)
            total, count = self.accelerator.gather(local).view(-1, 2).sum(dim=0).tolist()
            self._metrics[mode][name].append(total / count)
        self._pending_metrics.clear()
