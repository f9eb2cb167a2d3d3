"""The vLLM path's pieces that need no engine, run in the default environment: TRL's importance-sampling ratio on
hand-computed values, and the settings the team engine refuses."""

import math
import shutil
from unittest import mock

import pytest
import torch
from accelerate import Accelerator

from trl_marl import MAGRPOConfig
from trl_marl.memory.geometry import largest_call_rows
from trl_marl.vllm_generation import (
    TeamVLLMGeneration,
    importance_sampling_ratio,
    keep_base_when_sleeping,
    lora_engine_settings,
)

# two rows of three tokens; the second row's last token is padding
OLD = torch.tensor([[-1.0, -2.0, -0.5], [-0.2, -0.4, -9.0]])
SAMPLING = torch.tensor([[-1.5, -1.0, -0.5], [-0.3, float("nan"), 0.0]])
MASK = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])


def test_token_level_ratios_are_exp_of_the_log_prob_gap_truncated_or_masked():
    # gaps: row 0: 0.5, -1.0, 0.0; row 1: 0.1, NaN -> 0 (ratio 1), padding -> 0
    expected = torch.tensor([[math.exp(0.5), math.exp(-1.0), 1.0], [math.exp(0.1), 1.0, 1.0]])
    truncated = importance_sampling_ratio(OLD, SAMPLING, MASK, "token_truncate", None, 1.5)
    torch.testing.assert_close(truncated, expected.clamp(max=1.5))
    masked = importance_sampling_ratio(OLD, SAMPLING, MASK, "token_mask", 0.5, 1.5)
    torch.testing.assert_close(masked, torch.where((expected < 0.5) | (expected > 1.5), 0.0, expected))


def test_sequence_level_ratios_use_the_summed_gap_of_the_completion():
    # summed gaps: row 0: 0.5 - 1.0 + 0.0 = -0.5; row 1: 0.1
    expected = torch.tensor([[math.exp(-0.5)], [math.exp(0.1)]])
    truncated = importance_sampling_ratio(OLD, SAMPLING, MASK, "sequence_truncate", None, 3.0)
    torch.testing.assert_close(truncated, expected)
    masked = importance_sampling_ratio(OLD, SAMPLING, MASK, "sequence_mask", 0.7, 3.0)
    torch.testing.assert_close(masked, torch.tensor([[0.0], [math.exp(0.1)]]))  # exp(-0.5) = 0.61 < 0.7


def test_server_mode_is_refused_naming_the_setting(tmp_path):
    values = dict(output_dir=str(tmp_path), agents=["writer", "editor"], report_to="none", use_cpu=True, use_vllm=True)
    with pytest.raises(ValueError, match="`vllm_mode='server'` is not supported: .* Use `vllm_mode='colocate'`"):
        MAGRPOConfig(**values, vllm_mode="server")
    assert MAGRPOConfig(**values, vllm_enable_sleep_mode=True).vllm_enable_sleep_mode  # sleep mode is supported
    # the engine itself refuses server mode before it builds anything
    with pytest.raises(ValueError, match="`vllm_mode='server'` is not supported"):
        TeamVLLMGeneration(None, lambda: None, ["writer"], lambda: 0, ["writer"], 8, mode="server")


def test_the_team_engine_sleeps_at_level_1_whatever_level_it_is_asked_for():
    class Engine:
        def __init__(self):
            self.calls = []

        def sleep(self, level=1, mode="abort"):
            self.calls.append((level, mode))

    engine = keep_base_when_sleeping(Engine())
    engine.sleep(level=2)  # what TRL's colocate engine asks: it would discard the base, which is never re-sent
    engine.sleep(level=2, mode="wait")
    engine.sleep()
    assert engine.calls == [(1, "abort"), (1, "wait"), (1, "abort")]


def test_the_engine_serves_lora_ranks_in_the_smallest_slots_vllm_accepts():
    ranks = {rank: lora_engine_settings(3, rank, torch.bfloat16)["max_lora_rank"] for rank in (1, 4, 8, 16, 17, 64)}
    assert ranks == {1: 1, 4: 8, 8: 8, 16: 16, 17: 32, 64: 64}
    assert lora_engine_settings(3, 4, torch.bfloat16) == {
        "enable_lora": True, "max_loras": 3, "max_lora_rank": 8, "dtype": "bfloat16"
    }  # fmt: skip
    with pytest.raises(ValueError, match="vLLM serves LoRA ranks up to 512; `lora_r` is 600"):
        lora_engine_settings(2, 600, torch.float32)


@pytest.mark.parametrize(("trl_rows", "team_rows", "expected"), [(4, 16, 16), (32, 16, 32), (4, 5000, 4096)])
def test_the_engine_runs_every_row_of_the_teams_largest_call_at_once(trl_rows, team_rows, expected):
    # TRL sizes `max_num_seqs` for one policy's prompts; a team call holds every agent's rows, up to the tokens vLLM
    # schedules in one step (TRL's `max_num_batched_tokens`: vLLM refuses a larger `max_num_seqs`)
    with mock.patch.object(TeamVLLMGeneration, "_init_vllm", lambda self: None):  # no engine: the settings only
        engine = TeamVLLMGeneration(
            None, lambda: None, ["writer"], lambda: 0, ["writer"], 8, team_rows=team_rows,
            accelerator=Accelerator(cpu=True), processing_class=None, max_num_seqs=trl_rows,
        )  # fmt: skip
    assert engine.max_num_seqs == expected
    shutil.rmtree(engine._adapter_dir)


def test_the_largest_call_of_a_magrpo_tree_holds_every_agents_rows_of_the_last_turn(tmp_path):
    # 2 copies a generation batch, 3 agents acting together, G=2 aligned, 2 turns: turn 1 has 2·2 nodes x 3 agents
    config = MAGRPOConfig(
        output_dir=str(tmp_path), agents=["ann", "bob", "cy"], num_generations=2, per_device_train_batch_size=2,
        num_turns=2, report_to="none", use_cpu=True,
    )  # fmt: skip
    assert largest_call_rows(config) == 2 * 2 * 3
