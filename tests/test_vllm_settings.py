"""The vLLM path's pieces that need no engine, run in the default environment: TRL's importance-sampling ratio on
hand-computed values, and the settings the team engine refuses."""

import math
import shutil
from collections import defaultdict
from types import SimpleNamespace
from unittest import mock

import pytest
import torch
from accelerate import Accelerator

from trl_marl import MAGRPOConfig
from trl_marl.generation.team_generation import TeamGeneration
from trl_marl.generation.vllm_generation import SamplingCorrection, TeamVLLMGeneration, importance_sampling_ratio
from trl_marl.generation.vllm_serving import TeamLLM, check_sharding_served, lora_engine_settings, sampling_seed
from trl_marl.memory.geometry import largest_call_rows

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

    engine = TeamLLM(Engine())  # the calls are the wrapped engine's
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


def test_each_row_of_each_call_gets_its_own_sampling_seed_and_a_replay_gets_the_same_ones():
    def engine(seed=0, process=0, generation_kwargs=None):
        model = SimpleNamespace(training=True)
        with mock.patch.object(TeamVLLMGeneration, "_init_vllm", lambda self: None):  # no engine: the seeds only
            built = TeamVLLMGeneration(
                model, lambda: None, ["writer"], lambda: built.step, ["writer"], 8, seed=seed,
                accelerator=Accelerator(cpu=True), processing_class=None,
                generation_kwargs=generation_kwargs,
            )  # fmt: skip
        shutil.rmtree(built._adapter_dir)
        built.accelerator = SimpleNamespace(process_index=process)
        built.step = 0
        return built

    def calls(built):
        """A run's calls: two at step 0 (a tree's two turns), an evaluation at step 1, then two training calls."""
        seeds = [built.request_seeds(3), built.request_seeds(3)]
        built.step = 1
        built.model.training = False
        seeds.append(built.request_seeds(3))
        built.model.training = True
        return seeds + [built.request_seeds(3), built.request_seeds(3)]

    run = calls(engine())
    every = [seed for call in run for seed in call]
    assert len(set(every)) == len(every)  # rows, calls, steps and modes all apart
    assert all(0 <= seed < 2**63 for seed in every)
    assert calls(engine()) == run  # another run with the same seed
    assert calls(engine(seed=1))[0][0] != run[0][0]
    assert calls(engine(process=1))[0][0] != run[0][0]
    assert calls(engine(generation_kwargs={"seed": 1})) == calls(engine(seed=1))  # TRL's generation_kwargs seed
    resumed = engine()  # a run resumed at step 1: its first training call is the uninterrupted run's 4th
    resumed.step = 1
    assert [resumed.request_seeds(3), resumed.request_seeds(3)] == run[3:]
    # pinned: the same in every Python process (no salted hash)
    assert sampling_seed(0, "train", 0, 0, 0, 0) == 4082435210283080842


def test_the_largest_call_of_a_magrpo_tree_holds_every_agents_rows_of_the_last_turn(tmp_path):
    # 2 copies a generation batch, 3 agents acting together, G=2 aligned, 2 turns: turn 1 has 2·2 nodes x 3 agents
    config = MAGRPOConfig(
        output_dir=str(tmp_path), agents=["ann", "bob", "cy"], num_generations=2, per_device_train_batch_size=2,
        num_turns=2, report_to="none", use_cpu=True,
    )  # fmt: skip
    assert largest_call_rows(config) == 2 * 2 * 3


def test_tensor_parallel_vllm_is_refused_naming_the_setting(tmp_path):
    values = dict(output_dir=str(tmp_path), agents=["writer", "editor"], report_to="none", use_cpu=True, use_vllm=True)
    with pytest.raises(
        ValueError, match=r"`vllm_tensor_parallel_size=2` is not supported with `use_vllm`.*Set it to 1"
    ):
        MAGRPOConfig(**values, vllm_tensor_parallel_size=2)


@pytest.mark.parametrize("plugin", ["fsdp", "zero3"])
def test_sharded_adapters_are_refused_before_an_engine_starts(plugin):
    state = SimpleNamespace(fsdp_plugin=object() if plugin == "fsdp" else None, deepspeed_plugin=None)
    if plugin == "zero3":
        state.deepspeed_plugin = SimpleNamespace(zero_stage=3)
    with pytest.raises(ValueError, match="not supported with FSDP or DeepSpeed ZeRO-3.*Use DDP or ZeRO-1/2"):
        check_sharding_served(SimpleNamespace(state=state))
    check_sharding_served(SimpleNamespace(state=SimpleNamespace(fsdp_plugin=None, deepspeed_plugin=None)))  # DDP


def test_a_token_vllm_could_not_score_gets_a_ratio_of_one_and_stays_out_of_the_gap_metric():
    correction = SamplingCorrection("token_truncate", clip_min=None, clip_max=3.0)
    # vLLM reports no log-prob (None) for the second token of the only row
    correction.record([1], [[7, 8]], [[5, 6, 9]], [[-0.5, None, -2.0]])
    sample = SimpleNamespace(agent=1, prompt_ids=[7, 8], completion_ids=[5, 6, 9])
    output = {
        "completion_ids": torch.tensor([[5, 6, 9, 0]]),  # padded to the batch's width
        "completion_mask": torch.tensor([[1.0, 1.0, 1.0, 0.0]]),
        "old_per_token_logps": torch.tensor([[-0.4, -1.0, -2.5, 0.0]]),
    }
    metrics = defaultdict(list)
    result = correction.outputs([sample], output, metrics, gather=lambda tensor: tensor)
    torch.testing.assert_close(
        result["importance_sampling_ratio"], torch.tensor([[math.exp(0.1), 1.0, math.exp(-0.5), 1.0]])
    )
    assert math.isnan(result["sampling_per_token_logps"][0, 1])
    assert metrics["sampling/sampling_logp_difference/max"] == [pytest.approx(0.5)]
    assert correction.sampling_logps == {}  # used once, then dropped


def test_tool_result_tokens_stay_out_of_the_sequence_ratio_and_the_gap_metric():
    """Tool results are appended to a completion, never sampled: their log-probs from vLLM are placeholders (0.0), and
    only the model's own tokens (`completion_mask * tool_mask`) enter the ratio, as TRL masks them."""
    correction = SamplingCorrection("sequence_truncate", clip_min=None, clip_max=10.0)
    correction.record([0], [[7]], [[5, 6, 9]], [[-0.5, 0.0, -2.0]])  # token 6: a tool result's
    sample = SimpleNamespace(agent=0, prompt_ids=[7], completion_ids=[5, 6, 9])
    output = {
        "completion_ids": torch.tensor([[5, 6, 9]]),
        "completion_mask": torch.tensor([[1.0, 1.0, 1.0]]),
        "tool_mask": torch.tensor([[1, 0, 1]]),
        "old_per_token_logps": torch.tensor([[-0.4, -3.0, -2.5]]),
    }
    metrics = defaultdict(list)
    result = correction.outputs([sample], output, metrics, gather=lambda tensor: tensor)
    torch.testing.assert_close(result["importance_sampling_ratio"], torch.tensor([[math.exp(0.1 - 0.5)]]))
    assert metrics["sampling/sampling_logp_difference/max"] == [pytest.approx(0.5)]


@pytest.mark.parametrize("correct", [True, False])
def test_the_team_generation_keeps_vllm_log_probs_only_for_the_correction(correct):
    """vLLM returns the sampled tokens' log-probs with every call; they are kept (by agent, prompt and completion)
    only when TRL's importance-sampling correction will read them."""
    correction = SamplingCorrection("token_truncate", clip_min=None, clip_max=3.0) if correct else None
    router = SimpleNamespace(route=lambda rows: None)
    tokenizer = SimpleNamespace(batch_decode=lambda ids, skip_special_tokens: [str(row) for row in ids])
    generation = TeamGeneration(
        router,
        ["left", "right"],
        ["left", "right"],
        tokenize=lambda inputs: ([[7]] * len(inputs), None, None),
        generate_single_turn=lambda prompt_ids, *rest: ([[5], [6]], [[-0.5], [None]]),
        processing_class=tokenizer,
        position_limit=(None, "the model's", "max_position_embeddings"),
        max_completion_length=4,
        sampling_correction=correction,
    )
    assert generation.generate(["p", "q"], [0, 1], num_generations=2) == ([[7], [7]], [[5], [6]], ["[5]", "[6]"])
    if correct:
        assert correction.sampling_logps.keys() == {(0, (7,), (5,)), (1, (7,), (6,))}
        assert math.isnan(correction.sampling_logps[(1, (7,), (6,))][0])
