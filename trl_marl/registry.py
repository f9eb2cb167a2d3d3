"""Plugins: team rewards, tasks and turn schedulers, found through Python entry points (docs/design.md, §9.1).

A package adds a plugin by naming it in its own `pyproject.toml`:

```toml
[project.entry-points."trl_marl.rewards"]
my_reward = "my_pkg.rewards:my_reward"
```

Discovery is lazy: listing names reads package metadata only; a plugin's module is imported when the plugin is
first used (or listed with its description). A plugin that fails to import does not break the others: using it
raises a `PluginError` naming the entry point, its distribution and the import error. Two plugins of one kind with
one name are an error naming both sources. trl_marl's own plugins are registered through its own entry points, the
same way; `register_reward` / `register_task` / `register_scheduler` / `register_episode` add in-process plugins
(notebooks, tests).
"""

import difflib
import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from importlib.metadata import EntryPoint, entry_points
from typing import Any

GROUPS = {
    "rewards": "trl_marl.rewards",
    "tasks": "trl_marl.tasks",
    "schedulers": "trl_marl.schedulers",
    "episodes": "trl_marl.episodes",
}
IN_PROCESS = "<registered in-process>"
_MISSING = object()
_in_process: dict[str, dict[str, "Plugin"]] = {kind: {} for kind in GROUPS}


class PluginError(RuntimeError):
    """A plugin is unknown, ambiguous (two with one name) or broken (its module failed to import)."""


@dataclass
class Plugin:
    """One named plugin of one kind, from an installed distribution's entry point or registered in-process."""

    kind: str
    name: str
    target: str  # "module:attribute"
    source: str  # the distribution, or IN_PROCESS
    entry_point: EntryPoint | None = None
    _object: Any = field(default=_MISSING, repr=False)
    error: BaseException | None = field(default=None, repr=False)

    def load(self) -> Any:
        """Import the plugin (once) and return it; `PluginError` naming the entry point if that fails."""
        if self._object is _MISSING and self.error is None:
            try:
                self._object = self.entry_point.load()
            except Exception as error:  # any import-time failure of a third-party module
                self.error = error
        if self.error is not None:
            raise PluginError(
                f"The {self.kind[:-1]} plugin '{self.name}' (entry point '{self.name} = {self.target}' in group "
                f"'{GROUPS[self.kind]}' of distribution '{self.source}') failed to import: "
                f"{type(self.error).__name__}: {self.error}. Fix or uninstall '{self.source}'."
            ) from self.error
        return self._object

    @property
    def description(self) -> str:
        """The first sentence of the plugin's docstring (imports it), or what broke."""
        try:
            obj = self.load()
        except PluginError:
            return f"BROKEN: {type(self.error).__name__}: {self.error}"
        paragraph = " ".join((getattr(obj, "__doc__", None) or "").strip().split("\n\n")[0].split())
        return paragraph.split(". ")[0].rstrip(".") + "." if paragraph else ""


def _distribution_name(entry_point: EntryPoint) -> str:
    dist = getattr(entry_point, "dist", None)
    return dist.name if dist is not None else "<unknown distribution>"


def discover(kind: str) -> list[Plugin]:
    """Every plugin of `kind` (`"rewards"`, `"tasks"` or `"schedulers"`), installed and in-process, sorted by name;
    name clashes are kept (see [`get_plugin`])."""
    if kind not in GROUPS:
        raise ValueError(f"Unknown plugin kind {kind!r}; the kinds are {list(GROUPS)}.")
    found, seen = [], set()
    for entry_point in entry_points(group=GROUPS[kind]):
        source = _distribution_name(entry_point)
        # The same distribution can be visible twice on sys.path (e.g. an editable install and a build folder).
        if (entry_point.name, entry_point.value, source) in seen:
            continue
        seen.add((entry_point.name, entry_point.value, source))
        found.append(Plugin(kind, entry_point.name, entry_point.value, source, entry_point))
    found += list(_in_process[kind].values())
    return sorted(found, key=lambda plugin: (plugin.name, plugin.source))


def get_plugin(kind: str, name: str) -> Plugin:
    """The plugin of `kind` called `name`; `PluginError` when there is none or more than one."""
    matches = [plugin for plugin in discover(kind) if plugin.name == name]
    if not matches:
        names = sorted({plugin.name for plugin in discover(kind)})
        raise PluginError(
            f"No {kind[:-1]} plugin named '{name}'{did_you_mean(name, names)}. Installed: {names}. Add one with an "
            "entry point in the "
            f"group '{GROUPS[kind]}' of your package, or with trl_marl.register_{kind[:-1]}."
        )
    if len(matches) > 1:
        sources = " and ".join(f"'{p.target}' from {p.source}" for p in matches)
        raise PluginError(
            f"Two {kind[:-1]} plugins are named '{name}': {sources}. Uninstall one of the distributions, or rename "
            "one of the entry points."
        )
    return matches[0]


def check_plugin_name(kind: str, name: str, field_name: str) -> None:
    """A `ValueError` naming `field_name` when no single plugin of `kind` is called `name` (reads package metadata
    only: nothing is imported)."""
    try:
        get_plugin(kind, name)
    except PluginError as error:
        raise ValueError(f"`{field_name}`: {error}") from None


def did_you_mean(name: str, known) -> str:
    """` (did you mean 'x'?)` for the closest of `known` to `name`, or nothing (a hint for error messages)."""
    match = difflib.get_close_matches(name, list(known), 1)
    return f" (did you mean '{match[0]}'?)" if match else ""


def load_plugin(kind: str, name: str) -> Any:
    """The object of the plugin of `kind` called `name` (imported now if it was not yet)."""
    return get_plugin(kind, name).load()


def register(kind: str, name: str | Callable | None = None) -> Callable[[Any], Any]:
    """Decorator registering an in-process plugin of `kind` under `name` (default: the object's `name` attribute or
    `__name__`), used as `@register_episode("my_program")` or bare, `@register_episode`. Registering a name again
    replaces the earlier in-process plugin (re-running a notebook cell)."""

    def decorator(obj: Any) -> Any:
        plugin_name = name or getattr(obj, "name", None) or obj.__name__
        target = f"{getattr(obj, '__module__', '?')}:{getattr(obj, '__qualname__', plugin_name)}"
        _in_process[kind][plugin_name] = Plugin(kind, plugin_name, target, IN_PROCESS, _object=obj)
        return obj

    if kind not in GROUPS:
        raise ValueError(f"Unknown plugin kind {kind!r}; the kinds are {list(GROUPS)}.")
    if callable(name):  # used bare: `name` is the decorated object
        obj, name = name, None
        return decorator(obj)
    return decorator


def unregister(kind: str, name: str) -> None:
    """Remove an in-process plugin (tests)."""
    _in_process[kind].pop(name, None)


register_reward = functools.partial(register, "rewards")
register_task = functools.partial(register, "tasks")
register_scheduler = functools.partial(register, "schedulers")
register_episode = functools.partial(register, "episodes")
