"""The team as an artefact: what a trained team is on disk and on the Hub, and how it is loaded and run.

`saved.py` is the saved team (`team.json`, `load_team`, `Team.run`, `Team.play`), `saved_bases.py` its bases found
and loaded, `saved_tools.py` the tools and environment it trained with; `bases.py` which agents sit on which base
model and how each base loads, `base_generation.py` each base's own generation and the token ids carried to it;
`team_card.py` the model card, `hub.py` a team away from its machine, `default_model.py` the embedded default model,
`importable.py` functions named by import path in `team.json`, `offline_base.py` a second base made offline.

May import: the foundation modules, `config`, `sandbox`, `rollouts`, `tasks` and `generation`; nothing above.
"""
