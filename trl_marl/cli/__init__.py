"""The `trl-marl` command (`python -m trl_marl.cli`): `command.py` reads the command line and dispatches (`list`,
`train`, `evaluate`, `estimate`, `serve`), `train.py` is `trl-marl train` (a config and flags into a trainer, checked
before a model loads), `evaluation.py` is `evaluate_task` (`trl-marl evaluate`).

May import: everything below it; it is the top layer, and nothing in the package imports it.
"""

from .command import main

__all__ = ["main"]
