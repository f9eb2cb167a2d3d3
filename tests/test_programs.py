"""Training a team from agent programs (`MAGRPOTrainer(episode=fn)`, docs/programs.md): the G episodes of a row run
concurrently against the trainer's own server, each call recorded as the model produced it and trained on exactly those
ids; episodes grouped and credited as MAGRPO's single-turn rollout; failed and hung episodes left out."""

import asyncio
import gc
import json
import ssl
import sys
import threading
import uuid

import pytest
import torch
from datasets import Dataset
from transformers import TrainerCallback

pytest.importorskip("fastapi", reason="programs are served by the `serve` extra (FastAPI, uvicorn)")
openai = pytest.importorskip("openai", reason="episodes call the agents with the `openai` client")

from trl_marl import MAGRPOConfig, MAGRPOTrainer  # noqa: E402
from trl_marl.rollouts.magrpo_rollout import TreeRollout  # noqa: E402
from trl_marl.rollouts.program_rollout import EpisodeResult, EpisodesFailed, ProgramRollout  # noqa: E402
from trl_marl.serving.episodes import RecordedCall  # noqa: E402
from trl_marl.team.base_generation import tokenize_text_prompts  # noqa: E402

AGENTS = [{"name": "writer", "system_prompt": "Write."}, {"name": "critic", "system_prompt": "Critique."}]
DATA = Dataset.from_dict({"prompt": ["Name a cat.", "Name a dog."]})


def config(tmp_path, **overrides) -> MAGRPOConfig:
    settings = dict(
        output_dir=str(tmp_path),
        agents=AGENTS,
        num_generations=4,
        per_device_train_batch_size=4,
        max_completion_length=8,
        max_steps=1,
        learning_rate=0.05,
        lora_r=4,
        lora_alpha=8,
        report_to="none",
        use_cpu=True,
        bf16=False,
        logging_steps=1,
        save_strategy="no",
        episode_timeout=120,
    )
    return MAGRPOConfig(**{**settings, **overrides})


def ask(client, agent: str, content: str, **kwargs) -> str:
    messages = [{"role": "user", "content": content}]
    return client.chat.completions.create(model=agent, messages=messages, **kwargs).choices[0].message.content


def lora_b(trainer) -> dict:
    return {name: p.detach().clone() for name, p in trainer.model.named_parameters() if "lora_B" in name}


def moved_adapters(before: dict, trainer) -> set[str]:
    after = dict(trainer.model.named_parameters())
    return {name.split(".")[-2] for name in before if not torch.equal(before[name], after[name])}


def keep_rollouts(trainer) -> list:
    """The rollouts the trainer makes, kept as it returns them."""
    kept, rollout = [], trainer._rollout

    def keeping(*args, **kwargs):
        kept.append(rollout(*args, **kwargs))
        return kept[-1]

    trainer._rollout = keeping
    return kept


def test_a_programs_calls_are_recorded_exactly_and_trained_and_every_agents_adapter_moves(tiny_model_dir, tmp_path):
    received = []

    def episode(client, row):
        draft = ask(client, "writer", row["prompt"], max_tokens=6)
        review = ask(client, "critic", f"Review: {draft}")
        received.extend([("writer", row["prompt"], draft), ("critic", f"Review: {draft}", review)])
        return float(len(review) % 3)

    trainer = MAGRPOTrainer(tiny_model_dir, args=config(tmp_path, max_steps=2), episode=episode, train_dataset=DATA)
    rollouts, before = keep_rollouts(trainer), lora_b(trainer)
    trainer.train()
    assert moved_adapters(before, trainer) == {"writer", "critic"}
    samples = [sample for rollout in rollouts for sample in rollout.samples]
    assert len(samples) == len(received) == 2 * 2 * 4  # 2 steps x 4 episodes x 2 calls
    tokenizer = trainer.processing_class
    for sample in samples:
        agent = AGENTS[sample.agent]
        content = sample.model_input[-1]["content"]
        assert (agent["name"], content, sample.text) in received
        # the prompt as the model saw it (the agent's role, the chat template), and the ids it sampled
        conversation = [{"role": "system", "content": agent["system_prompt"]}, *sample.model_input]
        assert sample.prompt_ids == tokenize_text_prompts(tokenizer, {}, None, [conversation])[0][0]
        assert tokenizer.decode(sample.completion_ids, skip_special_tokens=True) == sample.text
        assert len(sample.completion_ids) == (6 if agent["name"] == "writer" else 8)  # max_tokens, else the config's
    assert trainer.state.log_history[0]["episodes/calls_mean"] == 2.0
    assert trainer._episode_runner is None  # the server stops with `train()`


def test_episodes_running_at_once_never_mix_their_calls(tiny_model_dir, tmp_path):
    def episode(client, row):
        content = f"{uuid.uuid4().hex[:8]} {row['prompt']}"  # this episode's own marker
        calls = [threading.Thread(target=ask, args=(client, agent, content)) for agent in ["writer", "critic"] * 2]
        for call in calls:
            call.start()
        for call in calls:
            call.join()
        return 1.0

    trainer = MAGRPOTrainer(tiny_model_dir, args=config(tmp_path), episode=episode, train_dataset=DATA)
    rollouts = keep_rollouts(trainer)
    trainer.train()
    markers = {}
    for sample in rollouts[0].samples:
        markers.setdefault((sample.node, sample.position), set()).add(sample.model_input[-1]["content"].split()[0])
    assert len(markers) == 4 and all(len(found) == 1 for found in markers.values())  # one episode, one marker
    assert len({marker for found in markers.values() for marker in found}) == 4
    assert sum(len(found) for found in markers.values()) == 4 and len(rollouts[0].samples) == 16


def test_an_episode_that_raises_or_hangs_is_left_out_and_the_run_goes_on(tiny_model_dir, tmp_path):
    release = threading.Event()
    episodes = iter(range(100))

    def episode(client, row):
        number = next(episodes)
        ask(client, "writer", row["prompt"])
        if number == 0:
            raise RuntimeError("the tool crashed")
        if number == 1:
            release.wait(60)  # hangs past the timeout
        return float(number)

    args = config(tmp_path, episode_timeout=5)
    trainer = MAGRPOTrainer(tiny_model_dir, args=args, episode=episode, train_dataset=DATA)
    rollouts, before = keep_rollouts(trainer), lora_b(trainer)
    try:
        trainer.train()
    finally:
        release.set()
    logged = trainer.state.log_history[0]
    assert logged["episodes/failed"] == 2 and logged["episodes/groups_without_signal"] == 0
    assert len(rollouts[0].samples) == 2  # the two episodes that returned, one call each
    # the two scored episodes (rewards 2 and 3) form the group: (r - 2.5) / std([2, 3])
    assert sorted(sample.advantage for sample in rollouts[0].samples) == pytest.approx([-0.7071, 0.7071], abs=1e-3)
    assert moved_adapters(before, trainer) == {"writer"}


def test_a_step_where_more_episodes_fail_than_allowed_stops_training_naming_the_episode_the_call_and_the_cause(
    tiny_model_dir, tmp_path
):
    def episode(client, row):
        return ask(client, "writer", row["prompt"], temperature=0.3)  # the trainer samples at 1.0: refused

    trainer = MAGRPOTrainer(tiny_model_dir, args=config(tmp_path), episode=episode, train_dataset=DATA)
    before = lora_b(trainer)
    with pytest.raises(EpisodesFailed) as stopped:
        trainer.train()
    message = str(stopped.value)
    assert "4 of the step's 4 episodes failed, more than `episode_max_failed_fraction` (0.5)" in message
    assert "episode 0 (dataset row 0, episode 1 of its 4): the episode raised BadRequestError" in message
    assert "its request 1 to `writer` was answered 400 (invalid_value)" in message and "`temperature`" in message
    assert moved_adapters(before, trainer) == set() and trainer.state.global_step == 0


def test_with_every_failure_allowed_a_step_whose_every_episode_failed_trains_nothing_and_goes_on(
    tiny_model_dir, tmp_path
):
    def episode(client, row):
        return "not a reward"

    args = config(tmp_path, episode_max_failed_fraction=1.0)
    trainer = MAGRPOTrainer(tiny_model_dir, args=args, episode=episode, train_dataset=DATA)
    before = lora_b(trainer)
    trainer.train()
    assert trainer.state.log_history[0]["episodes/failed"] == 4
    assert moved_adapters(before, trainer) == set()


def test_an_async_program_gets_an_async_client(tiny_model_dir, tmp_path):
    async def episode(client, row):
        assert isinstance(client, openai.AsyncOpenAI)
        drafts = await asyncio.gather(*(client.chat.completions.create(
            model=agent, messages=[{"role": "user", "content": row["prompt"]}]) for agent in ("writer", "critic")
        ))  # fmt: skip
        return {"writer": drafts[0].choices[0].message.content, "critic": drafts[1].choices[0].message.content}

    def both_spoke(prompts, completions, **kwargs):
        return [float(len(c["writer"]) > len(c["critic"])) for c in completions]

    trainer = MAGRPOTrainer(tiny_model_dir, both_spoke, args=config(tmp_path), episode=episode, train_dataset=DATA)
    rollouts = keep_rollouts(trainer)
    trainer.train()
    rewards = [ja.reward for ja in rollouts[0].joint_actions]
    expected = [
        float(len(ja.completions["writer"]) > len(ja.completions["critic"])) for ja in rollouts[0].joint_actions
    ]
    assert rewards == expected and len(rollouts[0].samples) == 8


def live_tls_contexts() -> int:
    return sum(isinstance(thing, ssl.SSLContext) for thing in gc.get_objects())


@pytest.mark.parametrize("asynchronous", [False, True], ids=["sync", "async"])
def test_the_episodes_clients_share_one_tls_context_so_a_step_leaves_none_behind(
    tiny_model_dir, tmp_path, asynchronous
):
    # Each client's own context (~0.3 MiB of parsed CA certificates) stayed alive in reference cycles until a full
    # collection, which a training process seldom runs: the program path's resident set grew every step. Without the
    # collector, what a step leaves behind stays countable.
    def episode(client, row):
        return float(len(ask(client, "writer", row["prompt"])) > 3)

    async def async_episode(client, row):
        answer = await client.chat.completions.create(
            model="writer", messages=[{"role": "user", "content": row["prompt"]}]
        )
        return float(len(answer.choices[0].message.content) > 3)

    counts = []

    class Count(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            counts.append(live_tls_contexts())

    trainer = MAGRPOTrainer(
        tiny_model_dir,
        args=config(tmp_path, max_steps=4),
        episode=async_episode if asynchronous else episode,
        train_dataset=DATA,
        callbacks=[Count()],
    )
    gc.collect()
    gc.disable()
    try:
        trainer.train()
    finally:
        gc.enable()
    # steps 3 and 4: 8 more episodes, 8 clients, no context more (the second step's first calls add one, once)
    assert len(counts) == 4 and counts[3] == counts[1]


def test_a_program_episode_gives_the_built_in_rollouts_rewards_advantages_and_loss(tiny_model_dir, tmp_path):
    """Parity: an episode in which every agent answers the prompt once, on the same completions as MAGRPO's own
    single-turn rollout, yields the same rewards, advantages and loss."""

    def longer_draft(prompts, completions, **kwargs):
        return [float(len(c["writer"]) - len(c["critic"])) for c in completions]

    args = config(tmp_path, num_generations=3, per_device_train_batch_size=6)
    trainer = MAGRPOTrainer(tiny_model_dir, longer_draft, args=args, train_dataset=DATA)
    examples = [{"prompt": prompt} for prompt in DATA["prompt"] for _ in range(3)]
    tokenizer = trainer.processing_class
    texts = {}

    def generate(model_inputs, agent_index):
        """Stand-in generation: a different completion for every row."""
        prompt_ids, completion_ids, out = [], [], []
        for model_input, agent in zip(model_inputs, agent_index):
            text = "ab" * (len(texts) % 5 + 1) + str(agent)
            texts[len(texts)] = (agent, model_input, text)
            prompt_ids.append(tokenize_text_prompts(tokenizer, {}, None, [model_input])[0][0])
            completion_ids.append(tokenizer.encode(text, add_special_tokens=False))
            out.append(text)
        return prompt_ids, completion_ids, out

    hooks = trainer._rollout_hooks(examples, 3)
    built_in = TreeRollout(trainer.rollout_settings, 3).run(
        examples, first_copy=0, generate=generate, score=hooks["score"]
    )

    def run_episodes(copies):  # the same completions, made by "programs"
        results = []
        for copy in range(len(copies)):
            calls = [
                sample for sample in built_in.samples if sample.position == copy % 3 and sample.node[2] == copy // 3
            ]
            recorded = [
                RecordedCall(s.agent, s.model_input, s.prompt_ids, s.completion_ids, [], s.text, "length")
                for s in calls
            ]
            results.append(EpisodeResult({AGENTS[s.agent]["name"]: s.text for s in calls}, recorded))
        return results

    program = ProgramRollout(trainer.rollout_settings, 3).run(
        examples, first_copy=0, run_episodes=run_episodes, score=hooks["score"]
    )
    assert [ja.reward for ja in program.joint_actions] == [ja.reward for ja in built_in.joint_actions]
    key = lambda s: (s.node, s.position, s.agent)  # noqa: E731
    pairs = list(zip(sorted(program.samples, key=key), sorted(built_in.samples, key=key)))
    assert [(p.advantage, p.group, p.completion_ids) for p, _ in pairs] == [
        (b.advantage, b.group, b.completion_ids) for _, b in pairs
    ]
    losses = []
    trainer.current_gradient_accumulation_steps = 1  # what `train()` sets before a loss
    for rollout in (built_in, program):
        trainer._rollout = lambda inputs, num_generations, rollout=rollout: rollout
        inputs = trainer._generate_and_score_completions(examples)
        losses.append(trainer.compute_loss(trainer.model, inputs).item())
    assert losses[0] == losses[1] and losses[0] != 0.0


def test_a_langgraph_program_trains_the_team_for_two_steps(tiny_model_dir, tmp_path):
    langgraph = pytest.importorskip("langgraph.graph", reason="the agent-framework test drives LangGraph")
    chat_openai = pytest.importorskip(
        "langchain_openai", reason="LangGraph reaches the agents through langchain-openai"
    )
    from typing import Annotated, TypedDict

    from langchain_core.messages import AIMessage, HumanMessage

    class Exchange(TypedDict):
        messages: Annotated[list, lambda left, right: left + right]

    def episode(client, row):
        """A writer drafts, a critic reviews the draft: a LangGraph graph whose nodes are the team's agents, reached
        through the episode's client's address and key."""

        def agent(name: str):
            model = chat_openai.ChatOpenAI(
                model=name, base_url=str(client.base_url), api_key=client.api_key, max_retries=0
            )
            return lambda state: {"messages": [AIMessage(content=model.invoke(state["messages"]).content)]}

        graph = langgraph.StateGraph(Exchange)
        graph.add_node("writer", agent("writer"))
        graph.add_node("critic", agent("critic"))
        graph.add_edge(langgraph.START, "writer")
        graph.add_edge("writer", "critic")
        graph.add_edge("critic", langgraph.END)
        result = graph.compile().invoke({"messages": [HumanMessage(content=row["prompt"])]})
        return float(len(result["messages"][2].content) % 4)

    trainer = MAGRPOTrainer(tiny_model_dir, args=config(tmp_path, max_steps=2), episode=episode, train_dataset=DATA)
    rollouts, before = keep_rollouts(trainer), lora_b(trainer)
    trainer.train()
    assert moved_adapters(before, trainer) == {"writer", "critic"}
    assert [len(rollout.samples) for rollout in rollouts] == [8, 8]  # 4 episodes x 2 calls, each step
    critic = next(sample for sample in rollouts[0].samples if sample.agent == 1)
    assert [message["role"] for message in critic.model_input] == ["user", "assistant"]  # it saw the draft


@pytest.fixture(scope="module")
def training_server(tiny_model_dir, tmp_path_factory):
    """A saved team served as a trainer serves its own: requests only through open episodes."""
    from test_serving_engine import save_tiny_team

    from trl_marl import load_team
    from trl_marl.serving.app import ServingSettings
    from trl_marl.serving.engine import BatchingEngine
    from trl_marl.serving.episodes import EpisodeBook, EpisodeSampling
    from trl_marl.serving.server import bind_server

    team = load_team(save_tiny_team(tiny_model_dir, tmp_path_factory.mktemp("team")))
    book = EpisodeBook(EpisodeSampling(temperature=0.7, top_p=0.9, max_tokens=5), max_calls=2)
    server = bind_server(BatchingEngine(team), ServingSettings(api_key="k", episodes=book))
    server._start_in_thread()
    yield server, book
    server.close()


def episode_client(server, key: str):
    return openai.OpenAI(base_url=f"{server.root_url}/episodes/{key}/v1", api_key="k", max_retries=0)


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"seed": 3}, "seed"),
        ({"temperature": 1.0}, "temperature"),
        ({"top_p": 0.5}, "top_p"),
        ({"max_tokens": 6}, "max_tokens"),
    ],
)
def test_during_training_a_call_that_sets_its_own_sampling_is_a_400_naming_the_field(training_server, fields, param):
    server, book = training_server
    key = book.open(seed=1)
    with pytest.raises(openai.BadRequestError) as refused:
        ask(episode_client(server, key), "planner", "Hi.", **fields)
    assert refused.value.body["param"] == param and "trainer" in refused.value.message
    assert book.close(key) == []


def test_during_training_requests_outside_an_open_episode_are_refused_and_calls_are_bounded(training_server):
    server, book = training_server
    plain = openai.OpenAI(base_url=server.base_url, api_key="k", max_retries=0)
    with pytest.raises(openai.PermissionDeniedError, match="must come from an episode"):
        ask(plain, "planner", "Hi.")
    with pytest.raises(openai.NotFoundError, match="No open episode"):
        ask(episode_client(server, "0123456789abcdef"), "planner", "Hi.")
    key = book.open(seed=1)
    client = episode_client(server, key)
    assert client.models.retrieve("checker").id == "checker"  # frameworks look their model up first
    texts = [ask(client, "planner", "Hi."), ask(client, "checker", "Hi.", temperature=0.7)]
    with pytest.raises(openai.RateLimitError, match="its 2 calls"):
        ask(client, "planner", "Hi.")
    recorded = book.close(key)
    assert [call.text for call in recorded] == texts and [call.agent for call in recorded] == [0, 1]
    assert all(len(call.completion_ids) == len(call.logprobs) <= 5 for call in recorded)
    with pytest.raises(openai.NotFoundError):  # closed: a late call of a hung program
        ask(client, "planner", "Hi.")


def test_an_episodes_calls_sample_the_same_tokens_when_its_seed_and_calls_repeat(training_server):
    server, book = training_server

    def run(seed: int) -> list[list[int]]:
        key = book.open(seed)
        client = episode_client(server, key)
        ask(client, "planner", "Name a cat.")
        ask(client, "checker", "Name a dog.")
        return [call.completion_ids for call in book.close(key)]

    assert run(5) == run(5) and run(5) != run(6)


def test_stopping_and_resuming_a_program_run_equals_the_uninterrupted_run(tiny_model_dir, tmp_path):
    from test_resume import StopAt, adapters

    def episode(client, row):
        draft = ask(client, "writer", row["prompt"])
        review = ask(client, "critic", draft)
        return float(len(draft) - len(review))

    def trainer_in(folder, **overrides):
        args = config(folder, max_steps=4, seed=3, lr_scheduler_type="linear", **overrides)
        return MAGRPOTrainer(tiny_model_dir, args=args, episode=episode, train_dataset=DATA)

    uninterrupted = trainer_in(tmp_path / "a")
    uninterrupted.train()
    first = trainer_in(tmp_path / "b", save_strategy="steps", save_steps=2)
    first.add_callback(StopAt(2))
    first.train()
    resumed = trainer_in(tmp_path / "b")
    resumed.train(resume_from_checkpoint=True)
    assert resumed.state.global_step == 4
    expected, final = adapters(uninterrupted), adapters(resumed)
    for name in expected:
        torch.testing.assert_close(final[name], expected[name], rtol=1e-5, atol=1e-6, msg=name)
    rewards = [log["reward"] for log in resumed.state.log_history if "reward" in log and log["step"] > 2]
    assert rewards == [log["reward"] for log in uninterrupted.state.log_history if "reward" in log][2:]


def test_an_outcome_nothing_scores_and_an_empty_completion_are_handled_and_errors_are_logged(
    tiny_model_dir, tmp_path, caplog
):
    def episode(client, row):
        ask(client, "writer", row["prompt"], stop=[" ", "a", "e", "o"])  # may end before its first token
        return float(len(row["prompt"]))

    def scores_mappings(prompts, completions, **kwargs):
        return [1.0] * len(completions)

    args = config(tmp_path, episode_max_failed_fraction=1.0)  # every episode fails: logged, not stopped
    trainer = MAGRPOTrainer(tiny_model_dir, scores_mappings, args=args, episode=episode, train_dataset=DATA)
    with caplog.at_level("WARNING", logger="trl_marl"):
        trainer.train()
    assert trainer.state.log_history[0]["episodes/failed"] == 4
    assert "4 of 4 episodes left out: the episode returned a float, but the trainer's reward functions" in caplog.text

    def names_the_agents(client, row):
        ask(client, "writer", row["prompt"], stop=[" ", "a", "e", "o"])
        return {"writer": "x"}

    trainer = MAGRPOTrainer(tiny_model_dir, args=args, episode=names_the_agents, train_dataset=DATA)
    with caplog.at_level("WARNING", logger="trl_marl"):
        trainer.train()
    assert "returned a mapping, but the trainer has no reward function to score it" in caplog.text
    assert trainer._episode_runner is None


def test_a_call_arriving_after_its_episode_ended_never_reaches_the_model_during_the_loss(
    tiny_model_dir, tmp_path, monkeypatch
):
    from trl_marl.serving.engine import BatchingEngine

    late, in_loss, calls_in_loss = [], threading.Event(), []

    def episode(client, row):
        own = openai.OpenAI(base_url=str(client.base_url), api_key=client.api_key, max_retries=0)  # as frameworks do

        def call_later():
            try:
                late.append(ask(own, "writer", row["prompt"]))
            except openai.APIStatusError as error:
                late.append(error.status_code)
            except openai.APIConnectionError:  # after the last step: the server has stopped with `train()`
                late.append("stopped")

        threading.Timer(0.3, call_later).start()  # a thread the program leaves running
        ask(client, "critic", row["prompt"])
        return 1.0

    call, loss = BatchingEngine._call, MAGRPOTrainer.compute_loss
    monkeypatch.setattr(
        BatchingEngine, "_call", lambda self, rows: (calls_in_loss.append(in_loss.is_set()), call(self, rows))[1]
    )

    def compute_loss(self, *args, **kwargs):
        in_loss.set()
        try:
            threading.Event().wait(0.6)  # long enough for the late calls to arrive
            return loss(self, *args, **kwargs)
        finally:
            in_loss.clear()

    monkeypatch.setattr(MAGRPOTrainer, "compute_loss", compute_loss)
    trainer = MAGRPOTrainer(tiny_model_dir, args=config(tmp_path, max_steps=2), episode=episode, train_dataset=DATA)
    trainer.train()
    for _ in range(50):
        if len(late) == 8:
            break
        threading.Event().wait(0.1)
    # refused: the episode is over (404), the engine paused (503), the server stopped. Which of them depends on when
    # the late call lands (on a loaded machine every one can land in the loss's pause); a closed episode's 404 is
    # checked on its own in test_during_training_requests_outside_an_open_episode_are_refused_and_calls_are_bounded.
    assert len(late) == 8 and set(late) <= {404, 503, "stopped"}
    assert calls_in_loss and not any(calls_in_loss)


@pytest.mark.parametrize(
    "field, value",
    [
        ("num_turns", 2),
        ("joint_mode", "cross"),
        ("top_k", 5),
        ("min_p", 0.1),
        ("repetition_penalty", 1.1),
        ("generation_kwargs", {"no_repeat_ngram_size": 2}),
        ("vllm_structured_outputs_regex", "[0-9]+"),
    ],
)
def test_what_the_episode_server_cannot_do_is_refused_by_name_before_any_model_loads(tmp_path, field, value):
    with pytest.raises(ValueError, match=rf"`{field}=.*` is not supported with an episode function"):
        MAGRPOTrainer("no/such-model", args=config(tmp_path, **{field: value}), episode=lambda client, row: 1.0)


def test_without_the_openai_client_an_episode_trainer_says_what_to_install_before_any_model_loads(
    tmp_path, monkeypatch
):
    monkeypatch.setitem(sys.modules, "openai", None)  # `import openai` fails
    with pytest.raises(ImportError, match=r'needs openai, which is not installed: pip install "trl-marl\[serve\]"'):
        MAGRPOTrainer("no/such-model", args=config(tmp_path), episode=lambda client, row: 1.0)


def test_an_episodes_error_describes_its_first_failed_requests_and_counts_the_rest():
    from trl_marl.serving.episodes import EpisodeBook, EpisodeSampling
    from trl_marl.serving.errors import APIError

    book = EpisodeBook(EpisodeSampling(temperature=1.0, top_p=1.0, max_tokens=8))
    key = book.open(seed=0)
    for _ in range(1000):  # a program that retries a refused call until it times out
        number = book.received(key)
        book.note_failure(key, number, "writer", APIError(429, "This episode has made its 64 calls.", code="limit"))
    failures = book.failures(key)
    assert failures[0] == "its request 1 to `writer` was answered 429 (limit): This episode has made its 64 calls."
    assert len(failures) == 4 and failures[-1] == "997 more of its requests failed"


# -- programs that call tools (docs/programs.md, "Tools")

TOOL_STEPS = dict(max_steps=2, max_completion_length=160)  # the tiny model spells tool-call markup in many tokens


def test_an_agents_sdk_program_with_a_function_tool_and_a_typed_answer_trains_every_agent(tiny_model_dir, tmp_path):
    """The writer must call a tool the program runs (`tool_choice: required`, chat completions), then hands the
    tool's result over to the critic (a handoff, the Responses API), who answers in a schema (`output_type`). Each call
    is a training row with its exact sampled ids, tool-call markup included; the tool's result is prompt of the next
    call, never trained."""
    sdk = pytest.importorskip("agents", reason="the OpenAI Agents SDK (`openai-agents`) drives this test")
    from typing import Literal

    from pydantic import BaseModel

    sdk.set_tracing_disabled(True)

    class Verdict(BaseModel):
        ok: bool

    async def episode(client, row):
        @sdk.function_tool
        def weather(city: Literal["Paris", "Rome"]) -> str:
            """Today's weather in a city."""
            return f"sunny in {city}" if city == "Paris" else f"rain in {city}"

        def chat_model(name):
            return sdk.OpenAIChatCompletionsModel(model=name, openai_client=client)

        def responses_model(name):  # the SDK's default API
            return sdk.OpenAIResponsesModel(model=name, openai_client=client)

        settings = sdk.ModelSettings(tool_choice="required", parallel_tool_calls=False)
        writer = sdk.Agent(name="writer", model=chat_model("writer"), tools=[weather], model_settings=settings,
                           tool_use_behavior="stop_on_first_tool")  # fmt: skip
        found = (await sdk.Runner.run(writer, row["prompt"], max_turns=2)).final_output
        critic = sdk.Agent(name="critic", model=responses_model("critic"), output_type=Verdict)
        triage = sdk.Agent(name="writer", model=responses_model("writer"), handoffs=[critic], model_settings=settings)
        handed = await sdk.Runner.run(triage, f"The weather: {found}. Is it fine?", max_turns=2)
        assert handed.last_agent.name == "critic"
        return float(handed.final_output.ok) + (0.5 if "sunny" in found else 0.0)

    args = config(tmp_path, **TOOL_STEPS)
    trainer = MAGRPOTrainer(tiny_model_dir, args=args, episode=episode, train_dataset=DATA)
    rollouts, before = keep_rollouts(trainer), lora_b(trainer)
    trainer.train()
    assert moved_adapters(before, trainer) == {"writer", "critic"}
    assert all(entry.get("episodes/failed", 0) == 0 for entry in trainer.state.log_history if "loss" in entry)
    tokenizer = trainer.processing_class
    writer_rows = [sample for rollout in rollouts for sample in rollout.samples if sample.agent == 0]
    critic_rows = [sample for rollout in rollouts for sample in rollout.samples if sample.agent == 1]
    assert len(writer_rows) == 2 * len(critic_rows) == 2 * 2 * 4  # the writer twice, the critic once, per episode
    for sample in writer_rows:  # the call (of the tool, or the handoff), markup and all, as sampled
        written = tokenizer.decode(sample.completion_ids)
        assert written.startswith("<tool_call>\n") and "</tool_call>" in written
        assert '"name": "weather"' in written or '"name": "transfer_to_critic"' in written
    for sample in critic_rows:  # the tool's result is in its prompt, and its answer is the schema's JSON
        assert "The weather: " in tokenizer.decode(sample.prompt_ids)
        assert json.loads(tokenizer.decode(sample.completion_ids, skip_special_tokens=True))["ok"] in (True, False)


def test_a_langgraph_react_program_trains_the_agent_that_calls_its_tool(tiny_model_dir, tmp_path):
    pytest.importorskip("langgraph.prebuilt", reason="the ReAct agent is LangGraph's")
    chat_openai = pytest.importorskip("langchain_openai", reason="LangGraph reaches the agents through it")
    from typing import Literal

    from langchain_core.tools import tool
    from langgraph.prebuilt import create_react_agent
    from pydantic import BaseModel

    class Verdict(BaseModel):
        ok: bool

    def episode(client, row):
        @tool(return_direct=True)
        def weather(city: Literal["Paris", "Rome"]) -> str:
            """Today's weather in a city."""
            return f"sunny in {city}"

        def model(name):
            return chat_openai.ChatOpenAI(model=name, base_url=str(client.base_url), api_key=client.api_key,
                                          max_retries=0)  # fmt: skip

        bound = model("writer").bind_tools([weather], tool_choice="required", parallel_tool_calls=False, strict=True)
        result = create_react_agent(bound, [weather]).invoke({"messages": [("user", row["prompt"])]})
        found = result["messages"][-1].content
        verdict = model("critic").with_structured_output(Verdict, method="json_schema", strict=True).invoke(found)
        return float(verdict.ok) + (0.5 if "Paris" in found else 0.0)

    args = config(tmp_path, **TOOL_STEPS)
    trainer = MAGRPOTrainer(tiny_model_dir, args=args, episode=episode, train_dataset=DATA)
    before = lora_b(trainer)
    trainer.train()
    assert moved_adapters(before, trainer) == {"writer", "critic"}
    assert all(entry.get("episodes/failed", 0) == 0 for entry in trainer.state.log_history if "loss" in entry)


def test_a_constrained_calls_recorded_log_probabilities_are_the_models_own_not_the_grammars(training_server):
    """The grammar decides which tokens are sampled, not how they are scored: a recorded call's log-probabilities
    (what the loss and TRL's importance-sampling correction compare) are the model's unconstrained ones."""
    import torch

    server, book = training_server
    key = book.open(seed=4)
    client = episode_client(server, key)
    fmt = {
        "type": "json_schema",
        "json_schema": {
            "name": "v",
            "schema": {
                "type": "object",
                "properties": {"ok": {"type": "boolean"}},
                "required": ["ok"],
                "additionalProperties": False,
            },
        },
    }
    client.chat.completions.create(model="planner", messages=[{"role": "user", "content": "Hi."}], response_format=fmt)
    (call,) = book.close(key)
    team, base = server.team, server.team.bases[0]
    ids = torch.tensor([call.prompt_ids + call.completion_ids])
    server.engine.pause()  # the answer may be sent before the engine's call returns: the model is ours once paused
    base.router.route([team.agents[0]["adapter"]])
    try:
        with torch.no_grad():
            logits = base.model(ids).logits[0, len(call.prompt_ids) - 1 : -1].float()
    finally:
        base.router.route(None)
        server.engine.resume()
    unconstrained = torch.log_softmax(logits, -1).gather(1, torch.tensor(call.completion_ids)[:, None])[:, 0]
    assert call.logprobs == pytest.approx(unconstrained.tolist(), abs=1e-4)
    assert max(call.logprobs) < -0.5  # a grammar-renormalised score of a forced token would be near 0
