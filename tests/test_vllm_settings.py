"""The vLLM path's pieces that need no engine, run in the default environment: TRL's importance-sampling ratio on
hand-computed values, and the settings the team engine refuses."""

import math

import pytest
import torch

from trl_marl import MAGRPOConfig
from trl_marl.vllm_generation import TeamVLLMGeneration, importance_sampling_ratio, keep_base_when_sleeping

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
