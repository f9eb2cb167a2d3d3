"""The trainers and their collaborators: the one seam with TRL.

`team_trainer.py` (`TeamTrainer(GRPOTrainer)`) holds every TRL override, each handing off to a collaborator:
`team_assembly.py` (the team built around TRL's init), `checkpoints.py` (`TeamCheckpoints`: saving, resuming and the
best model, every adapter), `sharing.py` (what a save writes), `metrics.py`, `scoring.py` (the rollouts' `score`
hook), `team_inputs.py` and `reward_checks.py` (a task's and the rewards' inputs, checked before a model loads),
`episode_runner.py` (agent programs against the trainer's own server). `magrpo_trainer.py` and `atgrpo_trainer.py`
each own their algorithm's rollout.

May import: every layer below (foundation, `sandbox`, `rollouts`, `tasks`, `generation`, `config`, `team`, `memory`,
`serving`); only `cli` and the package's `__init__` sit above.
"""
