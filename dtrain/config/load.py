"""Loading a run configuration: a recipe (TOML) and dotted CLI overrides, each value checked against
its field's type and range.

``load_config`` reads a recipe, applies overrides such as ``--training.steps 100`` or
``--parallel.tp=2``, checks every value and returns a ``Config``. What a config means for the world
size it runs on (degrees, divisibility, feature compatibility) is checked by
``dtrain.checks.validate`` before any process group exists.
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import inspect
import tomllib
import types
import typing
from importlib import resources
from pathlib import Path
from typing import Any, Literal

from dtrain.config.fields import ConfigError, finite
from dtrain.config.sections import Config, FP8Config, toml_value

SECTIONS: dict[str, type] = {f.name: f.default_factory for f in dataclasses.fields(Config)}

def load_config(recipe: str | Path | None = None,
                overrides: typing.Sequence[str] | dict[str, Any] = ()) -> Config:
    """Reads a recipe (a name from ``dtrain/recipes/`` or a path; None for the defaults), applies
    overrides (``["training.steps=10"]``, ``["--training.steps", "10"]`` or
    ``{"training.steps": 10}``) and returns the validated ``Config``. Raises ``ConfigError``."""
    raw: dict[str, Any] = {}
    if recipe is not None:
        path = find_recipe(recipe)
        try:
            raw = tomllib.loads(path.read_text())
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"recipe {path} is not valid TOML: {e}") from None
    cfg = Config()
    for section, values in raw.items():
        if not isinstance(values, dict):
            raise ConfigError(f"recipe key '{section}' must be a [section] table; "
                              f"valid sections: {', '.join(SECTIONS)}")
        for key, value in values.items():
            _set(cfg, section, key, value, from_cli=False)
    items = overrides.items() if isinstance(overrides, dict) else _pair_overrides(overrides)
    for dotted, value in items:
        section, _, key = dotted.partition(".")
        _set(cfg, section, key, value, from_cli=isinstance(value, str))
    check_ranges(cfg)
    return cfg


def check_ranges(cfg: Config) -> None:
    """Every field's value against its range (``sections.ranged``) and every number against
    infinity and NaN, which no field takes. Raises ConfigError naming the key, the value and what
    is allowed."""
    for section in dataclasses.fields(cfg):
        values = getattr(cfg, section.name)
        for f in dataclasses.fields(values):
            value = getattr(values, f.name)
            ok, allowed = f.metadata.get("range", (lambda v: True, "a finite number"))
            if not finite(value):
                ok, allowed = (lambda v: False), allowed.replace("a number", "a finite number")
            if not ok(value):
                raise ConfigError(f"{section.name}.{f.name} = {value!r} is out of range: use "
                                  f"{allowed}")
    _check_fp8(cfg.fp8)


FP8_RECIPES = {"torchao": ("tensorwise", "rowwise", "blockwise"), "te": ("delayed", "current")}


def _check_fp8(cfg: FP8Config) -> None:
    """The recipe must be one of the backend's."""
    recipes = FP8_RECIPES[cfg.backend]
    if cfg.recipe == "blockwise" and cfg.backend == "te":
        raise ConfigError("fp8.recipe = 'blockwise' is torchao's (Transformer Engine's "
                          "Float8BlockScaling is not wired in): set fp8.backend = 'torchao', or "
                          f"use one of {', '.join(recipes)}")
    if cfg.recipe not in recipes:
        raise ConfigError(f"fp8.recipe = '{cfg.recipe}' is not a recipe of fp8.backend = "
                          f"'{cfg.backend}': use one of {', '.join(recipes)}")


def find_recipe(recipe: str | Path) -> Path:
    """A path as given, else ``NAME[.toml]`` from the recipes shipped in ``dtrain.recipes``."""
    path = Path(recipe)
    if path.is_file():
        return path
    name = path.name if path.suffix == ".toml" else path.name + ".toml"
    shipped = Path(str(resources.files("dtrain.recipes")))  # a folder: dtrain is not zipped
    if (shipped / name).is_file():
        return shipped / name
    known = sorted(p.stem for p in shipped.glob("*.toml"))
    raise ConfigError(f"recipe '{recipe}' not found: give a path to a .toml file or one of "
                      f"{', '.join(known)}")


def _pair_overrides(args: typing.Sequence[str]) -> list[tuple[str, Any]]:
    """``--a.b=1``, ``--a.b 1``, ``a.b=1`` and a bare ``--a.b`` (boolean true)."""
    pairs, i = [], 0
    while i < len(args):
        arg = args[i].removeprefix("--")
        if "=" in arg:
            key, value = arg.split("=", 1)
            pairs.append((key, value))
        elif i + 1 < len(args) and not args[i + 1].startswith("--"):
            pairs.append((arg, args[i + 1]))
            i += 1
        else:
            pairs.append((arg, "true"))
        i += 1
    return pairs


def _set(cfg: Config, section: str, key: str, value: Any, from_cli: bool) -> None:
    if section not in SECTIONS:
        raise ConfigError(f"unknown section '{section}'{_suggest(section, SECTIONS)}; "
                          f"valid sections: {', '.join(SECTIONS)}")
    obj = getattr(cfg, section)
    fields = {f.name: f for f in dataclasses.fields(obj)}
    if key not in fields:
        raise ConfigError(f"unknown key '{section}.{key}'{_suggest(key, fields, section)}; "
                          f"valid keys in [{section}]: {', '.join(fields)}")
    hint = typing.get_type_hints(type(obj))[key]
    setattr(obj, key, _coerce(f"{section}.{key}", value, hint, from_cli))


def _suggest(name: str, choices: typing.Iterable[str], prefix: str = "") -> str:
    close = difflib.get_close_matches(name, list(choices), n=1, cutoff=0.6)
    return f" (did you mean '{prefix + '.' if prefix else ''}{close[0]}'?)" if close else ""


def _coerce(key: str, value: Any, hint: Any, from_cli: bool) -> Any:
    """Checks (and for CLI strings, parses) ``value`` against the field's type."""
    origin = typing.get_origin(hint)
    if origin is types.UnionType:  # X | None: None is only the default (unset)
        (hint,) = (h for h in typing.get_args(hint) if h is not type(None))
        origin = typing.get_origin(hint)
    if origin is Literal:
        choices = typing.get_args(hint)
        if value not in choices:
            raise ConfigError(f"{key} = {value!r} is not a valid choice: use one of "
                              f"{', '.join(map(str, choices))}")
        return value
    if origin is list:
        (item,) = typing.get_args(hint) or (str,)
        if from_cli and isinstance(value, str):
            # "a,b" or a TOML list as typed in a shell: '["a", "b"]'
            items = (v.strip().strip("'\"") for v in value.strip().strip("[]").split(","))
            value = [v for v in items if v]
        if not isinstance(value, list):
            raise ConfigError(f"{key} = {value!r} has the wrong type: expected a list of "
                              f"{item.__name__}")
        return [_coerce(key, v, item, from_cli) for v in value]
    if hint is bool:
        if from_cli and isinstance(value, str) and value.lower() in ("true", "1", "yes"):
            return True
        if from_cli and isinstance(value, str) and value.lower() in ("false", "0", "no"):
            return False
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{key} = {value!r} has the wrong type: expected true or false")
    if hint is int:
        if from_cli and isinstance(value, str):
            try:
                value = int(value)
            except ValueError:
                pass
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise ConfigError(f"{key} = {value!r} has the wrong type: expected an integer")
    if hint is float:
        if from_cli and isinstance(value, str):
            try:
                value = float(value)
            except ValueError:
                pass
        if isinstance(value, int | float) and not isinstance(value, bool):
            return float(value)
        raise ConfigError(f"{key} = {value!r} has the wrong type: expected a number")
    if hint is str:
        if isinstance(value, str):
            return value
        raise ConfigError(f"{key} = {value!r} has the wrong type: expected a string")
    raise TypeError(f"unsupported config field type {hint} for {key}")


def field_docs(section_cls: type) -> dict[str, str]:
    """The docstring written under each field of a config dataclass (for ``--help``)."""
    tree = ast.parse(inspect.getsource(section_cls))
    body = tree.body[0].body
    docs = {}
    for node, nxt in zip(body, body[1:], strict=False):
        if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
                and isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant)):
            docs[node.target.id] = " ".join(str(nxt.value.value).split())
    return docs


def help_text() -> str:
    """Every section and field with its type, default and docstring."""
    lines = []
    for section, cls in SECTIONS.items():
        lines.append(f"[{section}]")
        docs = field_docs(cls)
        defaults = dataclasses.asdict(cls())
        hints = typing.get_type_hints(cls)
        for name, doc in docs.items():
            kind = hints[name]
            if typing.get_origin(kind) is types.UnionType:
                (kind,) = (h for h in typing.get_args(kind) if h is not type(None))
            kind = ("|".join(map(str, typing.get_args(kind)))
                    if typing.get_origin(kind) is Literal else getattr(kind, "__name__", kind))
            default = "unset: the preset's" if defaults[name] is None \
                else f"default {toml_value(defaults[name])}"
            lines.append(f"  --{section}.{name} ({kind}, {default})")
            lines.append(f"      {doc}")
    return "\n".join(lines)
