"""The rollouts, independent of any model: what a training step plays and how it is credited.

`rollout.py` holds what every rollout shares (`RolloutSettings`, the records of an episode, the transition contract);
`magrpo_rollout.py` the MAGRPO tree, `atgrpo_rollout.py` AT-GRPO's episodes, `program_rollout.py` the episodes of an
agent program grouped and credited; `scheduling.py` the turn schedulers, `rows.py` the rows handed to TRL,
`advantages.py` the advantage math as pure functions. A rollout reaches a model only through the `generate` and
`score` hooks it is given.

May import: the top-level foundation modules (`registry`, `agents`, `precision`) and `sandbox`; nothing above.
"""
