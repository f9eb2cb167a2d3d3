def other_reward(prompts, completions, **kwargs):
    """Team reward: always 0."""
    return [0.0] * len(prompts)
