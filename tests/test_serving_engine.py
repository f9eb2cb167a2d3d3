"""The serving engine (`trl_marl.serving.engine`): rows of any agents and settings in shared routed calls, each row
generating as it would alone; a long row yields to waiting ones; seeded rows sample the same tokens whatever shares
their call; stop strings, log-probabilities."""

import json
import threading
import time

import pytest
import torch
from datasets import Dataset

from trl_marl import MAGRPOConfig, MAGRPOTrainer, load_team
from trl_marl.serving.completion_text import CompletionDecoder, StreamedText
from trl_marl.serving.engine import BatchingEngine, EngineStopped
from trl_marl.serving.rows import GeneratedRow, RowRequest
from trl_marl.serving.step_hooks import nucleus_sample
from trl_marl.team.base_generation import tokenize_text_prompts

AGENTS = [{"name": "planner", "system_prompt": "Plan briefly."}, {"name": "checker", "system_prompt": "Check."}]
QUESTION = [{"role": "user", "content": "Suggest a name for a cat."}]


def no_reward(prompts, completions, **kwargs):
    return [0.0] * len(prompts)


def save_tiny_team(model_dir: str, folder, agents=AGENTS) -> str:
    """A two-agent team on `model_dir`, saved as `save_model` saves one, its agents' LoRA weights made to differ (a
    fresh LoRA B is zero, which would leave both agents equal to the base)."""
    args = MAGRPOConfig(
        output_dir=str(folder),
        agents=agents,
        num_turns=1,
        max_completion_length=12,
        lora_r=4,
        lora_alpha=8,
        report_to="none",
        use_cpu=True,
        bf16=False,
    )
    trainer = MAGRPOTrainer(model_dir, no_reward, args=args, train_dataset=Dataset.from_dict({"prompt": ["Hi."]}))
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in trainer.model.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.5)
    trainer.save_model()
    assert json.loads((folder / "team.json").read_text())["agents"][0]["name"] == agents[0]["name"]
    return str(folder)


def agent_prompt_ids(team, agent: int, messages=QUESTION) -> list[int]:
    conversation = [{"role": "system", "content": team.agents[agent]["system_prompt"]}, *messages]
    tokenizer = team.bases[team.agent_base[agent]].tokenizer
    return tokenize_text_prompts(tokenizer, {}, None, [conversation])[0][0]


@pytest.fixture(scope="module")
def team(tiny_model_dir, tmp_path_factory):
    return load_team(save_tiny_team(tiny_model_dir, tmp_path_factory.mktemp("served-team")))


@pytest.fixture
def engine(team):
    engine = BatchingEngine(team, max_batch_rows=8, chunk_tokens=4).start()
    yield engine
    engine.close()


def test_rows_of_both_agents_in_one_call_answer_as_each_agent_alone_and_as_team_run(team, engine):
    requests = [RowRequest(agent, agent_prompt_ids(team, agent), 12) for agent in (0, 1, 0, 1)]
    together = engine.generate(requests)
    alone = [engine.generate([request])[0] for request in requests[:2]]
    episode = team.run(QUESTION, num_turns=1)
    assert [row.text for row in together] == [row.text for row in alone] * 2
    assert [row.text for row in alone] == [episode.final["planner"], episode.final["checker"]]
    assert alone[0].text != alone[1].text  # the agents' adapters differ


def test_a_long_row_yields_to_a_waiting_one_after_chunk_tokens(team, engine):
    long_started, progress = threading.Event(), {}

    def on_long(row, finished):
        if len(row.completion_ids) >= 2:
            long_started.set()

    (long,) = engine.submit([RowRequest(0, agent_prompt_ids(team, 0), 300)], on_long)
    assert long_started.wait(60)
    progress["submitted"] = len(long.completion_ids)
    (short,) = engine.submit(
        [RowRequest(1, agent_prompt_ids(team, 1), 3)],
        lambda row, finished: finished and progress.setdefault("short_done", len(long.completion_ids)),
    )
    assert short.done_event.wait(60) and long.done_event.wait(120)
    assert short.finish_reason == "length" and len(short.completion_ids) == 3
    # the short row waited at most `chunk_tokens` (4) of the long row's tokens, then ran 3 beside it
    assert progress["short_done"] - progress["submitted"] <= 4 + 3
    assert long.finish_reason == "length" and len(long.completion_ids) == 300
    assert long.text == engine.generate([long.request])[0].text  # continuing in a later call changed nothing


def test_a_seeded_row_samples_the_same_tokens_alone_and_beside_other_rows(team, engine):
    seeded = RowRequest(0, agent_prompt_ids(team, 0), 10, temperature=1.0, top_p=0.9, seed=7)
    alone = engine.generate([seeded])[0]
    others = [RowRequest(1, agent_prompt_ids(team, 1), 10, temperature=0.7, seed=1), RowRequest(1, [1, 2, 3], 5)]
    beside = engine.generate([others[0], seeded, others[1]])[1]
    other_seed = engine.generate([RowRequest(0, seeded.prompt_ids, 10, temperature=1.0, top_p=0.9, seed=8)])[0]
    assert beside.completion_ids == alone.completion_ids
    assert other_seed.completion_ids != alone.completion_ids


def test_nucleus_sampling_keeps_only_the_tokens_that_reach_top_p():
    scores = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    generator = torch.Generator().manual_seed(0)
    drawn = {int(nucleus_sample(scores, 1.0, 0.7, generator)) for _ in range(200)}
    assert drawn == {0, 1}  # 0.5 < 0.7 <= 0.5 + 0.3
    assert {int(nucleus_sample(scores, 1.0, 0.5, generator)) for _ in range(50)} == {0}


def test_a_stop_string_ends_the_row_and_is_cut_from_its_text(team, engine):
    full = engine.generate([RowRequest(0, agent_prompt_ids(team, 0), 12)])[0]
    stop = full.text[5:8]
    row = engine.generate([RowRequest(0, agent_prompt_ids(team, 0), 12, stop=(stop,), top_logprobs=1)])[0]
    assert row.finish_reason == "stop"
    assert row.text == full.text[: full.text.index(stop)]
    # the tokens past the cut are dropped: the row's tokens (its usage, its log-probabilities) are those of its text
    decode = engine.decoder_of(0)
    assert len(decode(row.completion_ids[:-1])) < len(row.text) <= len(decode(row.completion_ids))
    assert row.completion_ids == full.completion_ids[: len(row.completion_ids)]
    assert len(row.logprobs) == len(row.top_logprobs) == len(row.completion_ids)


def test_rows_decoded_token_by_token_stop_and_finish_as_rows_decoded_whole(team, engine, monkeypatch):
    tokenizer, prompt = team.tokenizer, agent_prompt_ids(team, 0)
    full = engine.generate([RowRequest(0, prompt, 24)])[0].text
    stops = [(full[5:8],), (full[-2:],), (full[10:11], "never seen"), ("never seen",)]
    decoders = {
        "whole": lambda tokens: tokenizer.decode(tokens, skip_special_tokens=True),
        "token by token": CompletionDecoder(tokenizer),
    }
    answers = {}
    for name, decoder in decoders.items():
        monkeypatch.setattr(engine, "decoder_of", lambda agent, decoder=decoder: decoder)
        rows = engine.generate([RowRequest(0, prompt, 24, stop=stop, top_logprobs=1) for stop in stops])
        answers[name] = [(row.text, row.finish_reason, row.completion_ids, row.logprobs) for row in rows]
        assert isinstance(rows[0].decoded, StreamedText) == (name == "token by token")
    assert answers["token by token"] == answers["whole"]
    assert [reason for _, reason, _, _ in answers["whole"]] == ["stop", "stop", "stop", "length"]


def test_a_stop_string_after_a_character_split_across_tokens_keeps_that_characters_tokens(team):
    from trl_marl.serving.step_hooks import finish

    tokenizer = team.tokenizer
    ids = tokenizer.encode("🙂STOP and more", add_special_tokens=False)
    row = GeneratedRow(RowRequest(0, [1], 20, stop=("STOP",)))
    row.completion_ids, row.logprobs, row.top_logprobs = list(ids), [-1.0] * len(ids), [[]] * len(ids)
    finish(row, "length", lambda tokens: tokenizer.decode(tokens, skip_special_tokens=True))
    assert row.text == "🙂" and row.finish_reason == "stop"
    assert tokenizer.decode(row.completion_ids) == "🙂" and len(row.logprobs) == len(row.completion_ids) >= 2


def test_rows_record_each_tokens_log_probability_under_the_model(team, engine):
    request = RowRequest(1, agent_prompt_ids(team, 1), 3, top_logprobs=2)
    row = engine.generate([request])[0]
    model = team.model
    model.set_adapter("checker")
    with torch.no_grad():
        ids = torch.tensor([request.prompt_ids + row.completion_ids])
        logits = model(input_ids=ids).logits[0, len(request.prompt_ids) - 1 : -1]
    expected = torch.log_softmax(logits.float(), -1).gather(1, torch.tensor(row.completion_ids)[:, None])[:, 0]
    assert row.logprobs == pytest.approx(expected.tolist(), abs=1e-4)
    assert [top[0][0] for top in row.top_logprobs] == row.completion_ids  # greedy: the most likely token
    assert all(len(top) == 2 for top in row.top_logprobs)


def test_the_engines_thread_runs_on_the_cuda_device_of_the_thread_that_started_it(monkeypatch):
    # CUDA's current device is per thread; under `accelerate launch` a process's GPU is not a new thread's device 0
    set_on = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: set_on.append((threading.current_thread(), device)))
    engine = BatchingEngine(team=None).start()
    engine_thread = engine._thread
    engine.close()
    assert set_on == [(engine_thread, 3)]


def test_a_failing_call_fails_its_rows_and_the_next_call_is_served(team, engine, monkeypatch):
    model = team.bases[0].model

    def broken(*args, **kwargs):
        raise RuntimeError("the device fell over")

    monkeypatch.setattr(model, "generate", broken)
    failed = engine.generate([RowRequest(0, [1, 2, 3], 4)])[0]
    monkeypatch.undo()
    assert failed.finish_reason == "error" and "fell over" in str(failed.error)
    assert engine.generate([RowRequest(0, [1, 2, 3], 4)])[0].finish_reason == "length"


def test_a_row_that_fails_inside_a_shared_call_fails_alone_and_the_rows_beside_it_finish(team, engine):
    """A temperature that overflows the logits makes sampling raise for the whole call; its neighbours run again in
    calls of their own, continuing from their tokens, and answer as they would have alone."""
    greedy = RowRequest(0, agent_prompt_ids(team, 0), 8)
    seeded = RowRequest(1, agent_prompt_ids(team, 1), 8, temperature=0.8, seed=3)
    broken = RowRequest(0, agent_prompt_ids(team, 0), 8, temperature=1e-39)  # inf logits: NaN probabilities
    alone = [engine.generate([request])[0] for request in (greedy, seeded)]
    rows = engine.generate([greedy, seeded, broken])  # the seeded row draws before the broken one raises
    assert rows[2].finish_reason == "error" and "probability tensor" in str(rows[2].error)
    assert [row.finish_reason for row in rows[:2]] == ["length", "length"]
    # as alone: the greedy row, and the seeded one, its generator given back its state before the failed step's draw
    assert [row.completion_ids for row in rows[:2]] == [row.completion_ids for row in alone]
    assert not any(row.alone for row in rows[:2])


def test_rows_retried_alone_run_once_alone_then_share_calls_again(team):
    engine = BatchingEngine(team, chunk_tokens=4).start()
    try:
        healthy = [RowRequest(agent, agent_prompt_ids(team, agent), 40) for agent in (0, 1)]
        broken = RowRequest(0, agent_prompt_ids(team, 0), 40, temperature=1e-39)
        rows = engine.generate([healthy[0], broken, healthy[1]])
    finally:
        engine.close()
    assert [row.finish_reason for row in rows] == ["length", "error", "length"]
    # the failed call; each row alone once (a healthy one yields after 4 tokens to the rows waiting); then the two
    # healthy rows share one call to their end (reviewed: never clearing `alone` took 31 calls, one row at a time)
    assert engine.calls == 5


def test_when_the_captured_step_fails_the_rows_continue_on_eager_generate_without_repeating_a_token(team, monkeypatch):
    from trl_marl.generation.captured_decode import CapturedDecoder

    requests = [RowRequest(agent, agent_prompt_ids(team, agent), 12) for agent in (0, 1)]
    eager_engine = BatchingEngine(team).start()
    eager = [row.completion_ids for row in eager_engine.generate(requests)]
    eager_engine.close()
    base = team.bases[0]
    decoder = CapturedDecoder(base.model, base.router, path="static", fall_back=True)

    def failing_step(*args):
        raise RuntimeError("CUDA graph capture failed")  # after the prefill: the hooks have recorded a token

    decoder._step = failing_step
    monkeypatch.setattr(base, "decoder", decoder)
    engine = BatchingEngine(team).start()
    try:
        rows = engine.generate(requests)
    finally:
        engine.close()
    assert decoder.failure == "RuntimeError: CUDA graph capture failed"
    assert [row.completion_ids for row in rows] == eager and [row.finish_reason for row in rows] == ["length"] * 2


def test_a_failure_before_the_generate_call_fails_its_rows_and_the_next_call_is_served(team, engine, monkeypatch):
    def broken(agent):
        raise RuntimeError("no stop tokens")

    monkeypatch.setattr(team, "stop_token_ids", broken)
    failed = engine.generate([RowRequest(0, [1, 2, 3], 4)])[0]
    monkeypatch.undo()
    assert failed.finish_reason == "error" and "no stop tokens" in str(failed.error)
    assert engine.alive and engine.generate([RowRequest(0, [1, 2, 3], 4)])[0].finish_reason == "length"


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # the thread re-raises, to log it
def test_a_failure_that_stops_the_engines_thread_fails_its_rows_and_refuses_new_ones(team, monkeypatch):
    engine = BatchingEngine(team)

    def broken():
        raise RuntimeError("the queue is corrupt")

    monkeypatch.setattr(engine, "_take_rows", broken)
    engine.start()
    try:
        failed = engine.generate([RowRequest(0, [1, 2, 3], 4)])[0]
        assert failed.finish_reason == "error" and "the queue is corrupt" in str(failed.error)
        engine._thread.join(10)
        assert not engine.alive and engine.stats()["engine"] == "failed"
        with pytest.raises(EngineStopped, match="the queue is corrupt"):
            engine.submit([RowRequest(0, [1, 2, 3], 4)])
    finally:
        engine.close()


def test_cancelled_rows_stop_generating(team, engine):
    started = threading.Event()
    (row,) = engine.submit([RowRequest(0, agent_prompt_ids(team, 0), 400)], lambda row, finished: started.set())
    assert started.wait(60)
    engine.cancel([row])
    assert row.done_event.wait(30)
    assert row.finish_reason == "cancelled" and len(row.completion_ids) < 400


def test_closing_the_engine_stops_the_running_call_at_its_next_token(team):
    engine = BatchingEngine(team).start()
    started = threading.Event()
    (row,) = engine.submit([RowRequest(0, agent_prompt_ids(team, 0), 450)], lambda row, finished: started.set())
    assert started.wait(60)
    engine.close()  # returns once the call has stopped, without generating the row's 450 tokens
    assert row.done_event.is_set() and row.finish_reason == "cancelled"
    assert len(row.completion_ids) < 450 and not engine.alive


def test_a_call_takes_rows_from_each_waiting_request_in_turn(team):
    engine = BatchingEngine(team, max_batch_rows=3)  # not started: the queue is read as the engine's thread reads it
    prompt = [1, 2, 3]
    many = engine.submit([RowRequest(0, prompt, 2, seed=seed) for seed in range(5)])
    one = engine.submit([RowRequest(1, prompt, 2)])
    two = engine.submit([RowRequest(0, prompt, 2), RowRequest(1, prompt, 2)])
    assert engine._take_rows() == [many[0], one[0], two[0]]
    assert engine._take_rows() == [many[1], two[1], many[2]]
    assert engine._take_rows() == [many[3], many[4]]
    engine.close()


def test_through_the_captured_decode_loop_rows_generate_as_with_eager_generate(team, monkeypatch):
    from trl_marl.generation.captured_decode import CapturedDecoder

    requests = [
        RowRequest(0, agent_prompt_ids(team, 0), 40),
        RowRequest(1, agent_prompt_ids(team, 1), 6, temperature=1.0, seed=5, top_logprobs=2),
    ]

    def generated(engine):
        first = engine.submit(requests[:1])[0]
        while len(first.completion_ids) < 2:  # the long row is running: the second waits, then shares a call
            threading.Event().wait(0.01)
        rows = [first, *engine.submit(requests[1:])]
        for row in rows:
            row.done_event.wait()
        return [(row.completion_ids, row.logprobs, row.finish_reason) for row in rows], engine.calls

    eager_engine = BatchingEngine(team, chunk_tokens=4).start()
    eager, _ = generated(eager_engine)
    eager_engine.close()
    base = team.bases[0]
    monkeypatch.setattr(base, "decoder", CapturedDecoder(base.model, base.router, path="static"))
    captured_engine = BatchingEngine(team, chunk_tokens=4).start()
    captured, calls = generated(captured_engine)
    captured_engine.close()
    assert calls >= 2  # the long row yielded and continued
    assert [ids for ids, _, _ in captured] == [ids for ids, _, _ in eager]
    assert [reason for _, _, reason in captured] == ["length", "length"]
    for (_, captured_logprobs, _), (_, eager_logprobs, _) in zip(captured, eager):
        assert captured_logprobs == pytest.approx(eager_logprobs, abs=1e-4)


def test_without_the_serve_extra_serving_says_what_to_install_and_importing_trl_marl_does_not_need_it(
    team, monkeypatch, capsys
):
    import subprocess
    import sys

    from trl_marl import serve_team
    from trl_marl.cli import main

    imported = subprocess.run(
        [sys.executable, "-c", "import sys, trl_marl; print(sorted({'fastapi', 'uvicorn'} & set(sys.modules)))"],
        capture_output=True,
        text=True,
        check=True,
    )
    assert imported.stdout.strip() == "[]"
    monkeypatch.setitem(sys.modules, "fastapi", None)  # as if it were not installed
    with pytest.raises(ImportError, match=r'pip install "trl-marl\[serve\]"'):
        serve_team(team)
    assert main(["serve", "any-team-folder"]) == 2
    assert 'pip install "trl-marl[serve]"' in capsys.readouterr().err


def test_max_batch_rows_bounds_the_rows_of_one_call(team, monkeypatch):
    engine = BatchingEngine(team, max_batch_rows=2)
    sizes, call = [], engine._call
    monkeypatch.setattr(engine, "_call", lambda rows: (sizes.append(len(rows)), call(rows)))
    requests = [RowRequest(agent % 2, agent_prompt_ids(team, agent % 2), 3) for agent in range(5)]
    rows = engine.submit(requests)  # all queued before the engine starts
    engine.start()
    for row in rows:
        assert row.done_event.wait(60)
    engine.close()
    assert sizes == [2, 2, 1]


def test_the_serve_command_passes_its_flags_to_the_server_and_load_team(team, tmp_path, monkeypatch, capsys):
    import trl_marl.serving.server as server_module
    from trl_marl.cli import main

    team_file = tmp_path / "team.json"
    team_file.write_text(json.dumps({"format": "trl_marl.team/1", "agents": []}))
    seen = {}
    monkeypatch.setattr(server_module, "serve_forever", lambda folder, **options: seen.update(options, folder=folder))
    flags = ["--host", "0.0.0.0", "--port", "0", "--api_key", "k", "--load_in_4bit", "--dtype", "bfloat16"]
    flags += ["--base_model", "org/model", "--captured_decode", "off", "--max_batch_rows", "4"]
    flags += ["--chunk_tokens", "8", "--max_tokens", "32", "--max_body_bytes", "1000", "--log_level", "info"]
    flags += ["--max_request_rows", "9", "--allowed_hosts", "box.lan, gpu.lan", "--allowed_origins", "https://ui.lan"]
    assert main(["serve", str(tmp_path), *flags]) == 0
    assert seen == {
        "folder": tmp_path,
        "host": "0.0.0.0",
        "port": 0,
        "api_key": "k",
        "load_in_4bit": True,
        "dtype": "bfloat16",
        "base_model": "org/model",
        "captured_decode": False,
        "max_batch_rows": 4,
        "chunk_tokens": 8,
        "max_tokens": 32,
        "max_body_bytes": 1000,
        "max_request_rows": 9,
        "allowed_hosts": ("box.lan", "gpu.lan"),
        "allowed_origins": ("https://ui.lan",),
        "log_level": "info",
    }
    seen.clear()
    assert main(["serve", str(tmp_path), "--use_vllm", "--vllm_max_model_length", "256"]) == 0
    assert (seen["use_vllm"], seen["vllm_max_model_length"], seen["vllm_gpu_memory_utilization"]) == (True, 256, 0.3)
    for flag in ("--max_request_rows", "--chunk_tokens"):
        assert main(["serve", str(tmp_path), flag, "0"]) == 2  # refused before anything loads
    assert capsys.readouterr().err.count("must be at least 1, got 0") == 2


def test_the_serve_command_takes_its_key_from_a_file_or_the_environment_not_both_flags(tmp_path, monkeypatch, capsys):
    import trl_marl.serving.server as server_module
    from trl_marl.cli import main

    (tmp_path / "team.json").write_text(json.dumps({"format": "trl_marl.team/1", "agents": []}))
    seen = {}
    monkeypatch.setattr(server_module, "serve_forever", lambda folder, **options: seen.update(options))
    monkeypatch.delenv("TRL_MARL_API_KEY", raising=False)
    assert main(["serve", str(tmp_path)]) == 0 and seen["api_key"] is None
    monkeypatch.setenv("TRL_MARL_API_KEY", "from-env\n")  # as `export KEY=$(cat file)` may leave it
    assert main(["serve", str(tmp_path)]) == 0 and seen["api_key"] == "from-env"
    key_file = tmp_path / "key"
    key_file.write_text("from-file\n")
    assert main(["serve", str(tmp_path), "--api_key_file", str(key_file)]) == 0 and seen["api_key"] == "from-file"
    key_file.write_text("\n")
    assert main(["serve", str(tmp_path), "--api_key_file", str(key_file)]) == 2
    assert main(["serve", str(tmp_path), "--api_key_file", str(tmp_path / "missing")]) == 2
    assert main(["serve", str(tmp_path), "--api_key_file", str(key_file), "--api_key", "k"]) == 2
    assert main(["serve", str(tmp_path), "--api_key", " "]) == 2
    errors = capsys.readouterr().err
    assert "its first line is empty" in errors and "cannot read it" in errors and "give one" in errors
    assert "--api_key is empty" in errors


def test_a_team_on_two_bases_answers_each_agent_on_its_own_base_as_team_run(tiny_model_dir, other_base_dir, tmp_path):
    agents = [AGENTS[0], {**AGENTS[1], "model": other_base_dir}]
    team = load_team(save_tiny_team(tiny_model_dir, tmp_path / "two-bases", agents))
    engine = BatchingEngine(team).start()
    rows = engine.generate([RowRequest(agent, agent_prompt_ids(team, agent), 12) for agent in (0, 1, 1, 0)])
    engine.close()
    episode = team.run(QUESTION, num_turns=1)
    assert [row.text for row in rows] == [episode.final[name] for name in ("planner", "checker", "checker", "planner")]
    assert engine.calls == 2  # one call per base


def test_an_agents_stop_tokens_are_its_bases_end_of_sequence_tokens(team):
    eos = team.model.generation_config.eos_token_id
    expected = {*(eos if isinstance(eos, list) else [eos]), team.tokenizer.eos_token_id}
    assert set(team.stop_token_ids(0)) == set(team.stop_token_ids(1)) == expected


def test_an_engine_idle_after_serving_gives_free_memory_back_once_per_idle_spell(team, monkeypatch):
    from trl_marl.serving import engine as engine_module

    released, lock_free = [], []

    def take_the_lock() -> None:  # as a request submitting or cancelling does
        taken = engine._condition.acquire(blocking=False)
        if taken:
            engine._condition.release()
        lock_free.append(taken)

    def release() -> None:
        other = threading.Thread(target=take_the_lock)
        other.start()
        other.join()
        released.append(True)

    monkeypatch.setattr(engine_module, "release_free_memory", release)
    monkeypatch.setattr(engine_module, "IDLE_SECONDS", 0.2)

    def released_after_idle(expected: int) -> int:
        deadline = time.monotonic() + 10
        while len(released) < expected and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(1.0)  # five more idle periods: no further release in the same idle spell
        return len(released)

    engine = BatchingEngine(team).start()
    try:
        time.sleep(1.0)
        assert released == []  # nothing served yet, nothing freed to give back
        engine.generate([RowRequest(0, agent_prompt_ids(team, 0), 4)])
        assert released_after_idle(1) == 1
        engine.generate([RowRequest(1, agent_prompt_ids(team, 1), 4)])
        assert released_after_idle(2) == 2
        assert lock_free == [True, True]  # given back outside the engine's lock
        engine.generate([RowRequest(0, agent_prompt_ids(team, 0), 4)])
        engine.pause()  # a trainer between its rollouts gives memory back itself
        time.sleep(1.0)
        assert len(released) == 2
    finally:
        engine.close()
