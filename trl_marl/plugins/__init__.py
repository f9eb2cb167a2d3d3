"""trl_marl's own plugins, registered through its own entry points in `pyproject.toml` like anyone's."""
