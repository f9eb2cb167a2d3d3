"""Plugins of the test package: a team reward, a task, a turn scheduler and an episode (an agent program)."""

from datasets import Dataset

from trl_marl import Task
from trl_marl.rollouts.scheduling import Sequential


def fewest_words(prompts, completions, **kwargs):
    """Team reward: 1 / (1 + the team's total word count)."""
    return [1.0 / (1 + sum(len(text.split()) for text in c.values())) for c in completions]


class Greetings(Task):
    """Two agents greet in two turns; the team is rewarded for brevity."""

    name = "greetings"
    agents = [{"name": "host", "system_prompt": "Greet the guest."}, {"name": "guest", "system_prompt": "Reply."}]
    num_turns = 2
    scheduler = "reverse_order"
    reward_funcs = ["fewest_words"]

    def dataset(self, split="train"):
        return Dataset.from_dict({"prompt": [[{"role": "user", "content": f"Say hello to {n}."}] for n in "ABCD"]})


class ReverseOrder(Sequential):
    """Agents act one at a time, last agent first; each sees what was said before it."""

    name = "reverse_order"

    def phases(self, turn, num_agents):
        return [[agent] for agent in reversed(range(num_agents))]


def each_agent_once(client, row):
    """Episode: every agent of the team (the endpoint's models) answers the prompt once; the team is rewarded for
    brevity (`fewest_words` scores the returned answers)."""
    messages = [{"role": "user", "content": row["prompt"]}]
    agents = [model.id for model in client.models.list()]
    return {
        agent: client.chat.completions.create(model=agent, messages=messages).choices[0].message.content
        for agent in agents
    }
