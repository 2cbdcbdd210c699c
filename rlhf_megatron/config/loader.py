r"""YAML + `key=value` overrides -> a typed TrainConfig, with one-line errors naming the key.

    cfg = load_config("configs/quickstart_cpu.yaml", ["trainer.total_steps=5", "actor.layout.tp=1"])

Values are type-checked against the schema's annotations: an unknown key (with a "did you mean"),
a wrong type or a value a section rejects raises ConfigError naming the dotted key.

Interpolation: a string value may refer to another key as `${section.key}` (the OmegaConf syntax
verl and Hydra users know), also inside text (`"runs/${trainer.seed}"`) and in overrides
(`rollout.seed=${trainer.seed}`), and may use OmegaConf's resolvers (`${oc.env:VAR,default}`).
A key left at its default can be referred to. `\${...}` is a literal `${...}`. Interpolations are
resolved by OmegaConf after the overrides, before the typed checks, so a resolved value is checked
like a written one; an interpolation that names no key is a one-line error with a suggestion.

Relative paths are relative to the working directory, except the file of `reward.custom_function`
written in the YAML file: it is relative to the YAML file's directory (code that ships with it).
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import types
import typing
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

from rlhf_megatron.config.schema import TrainConfig
from rlhf_megatron.errors import ConfigError


def load_config(path: str | Path | None, overrides: Sequence[str] = ()) -> TrainConfig:
    """Read `path` (YAML mapping; None = all defaults), apply overrides, build the schema."""
    data: dict[str, Any] = {}
    if path is not None:
        data = read_yaml(Path(path))
        _anchor_reward_file(data, Path(path))
    for override in overrides:
        key, value = parse_override(override)
        set_dotted(data, key, value)
    if _has_interpolation(data):
        data = resolve_interpolations(with_defaults(TrainConfig, data))
    return build_dataclass(TrainConfig, data, "")


def _anchor_reward_file(data: dict[str, Any], config_path: Path) -> None:
    """A relative file in the YAML file's `reward.custom_function` ("file.py:function") is code
    that ships with the config: it is resolved against the config file's directory, so the config
    works from any working directory. Overrides, data and model paths stay relative to the
    working directory (the quickstarts' `prepare` writes their assets there)."""
    reward = data.get("reward")
    spec = reward.get("custom_function") if isinstance(reward, dict) else None
    if not isinstance(spec, str) or "${" in spec or ":" not in spec:
        return
    file, _, function = spec.rpartition(":")
    if file and not Path(file).expanduser().is_absolute():
        anchored = os.path.normpath(config_path.parent.absolute() / file)
        reward["custom_function"] = f"{anchored}:{function}"


def _has_interpolation(value: Any) -> bool:
    if isinstance(value, str):
        return "${" in value
    if isinstance(value, Mapping):
        return any(_has_interpolation(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return any(_has_interpolation(v) for v in value)
    return False


def with_defaults(cls: type, data: Any) -> Any:
    """`data` with every schema field it leaves out filled with its default (plain values),
    section by section, so interpolations can refer to defaults. Unknown keys are kept (the typed
    build reports them)."""
    if not isinstance(data, Mapping):
        return data
    hints = typing.get_type_hints(cls)
    defaults = cls()
    merged = dict(data)
    for field in dataclasses.fields(cls):
        if not field.init:
            continue
        section = hints[field.name]
        if field.name in data:
            if dataclasses.is_dataclass(section):
                merged[field.name] = with_defaults(section, data[field.name])
        else:
            merged[field.name] = _plain(_as_plain(getattr(defaults, field.name)))
    return merged


def _as_plain(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _as_plain(getattr(value, f.name)) for f in dataclasses.fields(value)
                if f.init}
    return value


def resolve_interpolations(data: dict[str, Any]) -> dict[str, Any]:
    """Resolve `${...}` with OmegaConf; its errors become one-line ConfigErrors naming the key."""
    from omegaconf import OmegaConf
    from omegaconf.errors import InterpolationKeyError, OmegaConfBaseException

    try:
        resolved = OmegaConf.to_container(OmegaConf.create(data), resolve=True)
    except InterpolationKeyError as exc:
        missing = str(exc.msg).split("'")[1] if exc.msg.count("'") >= 2 else ""
        raise ConfigError(f"config key '{exc.full_key}': the interpolation ${{{missing}}} names "
                          f"no key{_suggest_path(data, missing)}") from None
    except OmegaConfBaseException as exc:
        where = f"config key '{exc.full_key}': " if getattr(exc, "full_key", None) else ""
        raise ConfigError(f"{where}{str(exc.msg).splitlines()[0]}") from None
    assert isinstance(resolved, dict)
    return resolved


def _suggest_path(data: Mapping[str, Any], dotted: str) -> str:
    """' (did you mean ...)' for the first part of `dotted` that `data` does not have."""
    node: Any = data
    for depth, part in enumerate(dotted.split(".")):
        if not isinstance(node, Mapping):
            return ""
        if part not in node:
            close = difflib.get_close_matches(part, [str(k) for k in node], n=1)
            prefix = ".".join(dotted.split(".")[:depth] + close[:1])
            return f" (did you mean '{prefix}'?)" if close else ""
        node = node[part]
    return ""


def read_yaml(path: Path) -> dict[str, Any]:
    if path.is_dir():
        raise ConfigError(f"config file {path} is a directory, not a YAML file")
    if not path.is_file():
        raise ConfigError(f"config file {path} does not exist")
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark is not None else ""
        raise ConfigError(f"{path}{where}: invalid YAML ({getattr(exc, 'problem', exc)})") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of sections, got "
                          f"{type(data).__name__}")
    return data


def parse_override(text: str) -> tuple[str, Any]:
    """'a.b=3' -> ('a.b', 3); the value is parsed as YAML ('[1, 2]', 'null', 'true', '1e-6')."""
    key, sep, raw = text.partition("=")
    key = key.strip()
    if not sep or not key or any(not part for part in key.split(".")):
        raise ConfigError(f"override {text!r} is not of the form section.key=value")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        value = raw
    return key, value


def set_dotted(data: dict[str, Any], key: str, value: Any) -> None:
    parts = key.split(".")
    node = data
    for i, part in enumerate(parts[:-1]):
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"override {key}: {'.'.join(parts[:i + 1])} is not a section")
        node = child
    node[parts[-1]] = value


def build_dataclass(cls: type, data: Any, prefix: str) -> Any:
    """Instantiate dataclass `cls` from a mapping, checking keys and types recursively."""
    where = prefix.rstrip(".") or "config"
    if isinstance(data, cls):
        return data
    if not isinstance(data, Mapping):
        raise ConfigError(f"{where} must be a mapping, got {_describe(data)}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    for key in data:
        if key not in fields:
            raise ConfigError(f"unknown config key '{prefix}{key}'{_suggest(str(key), fields)}")
    kwargs = {name: _coerce(hints[name], data[name], f"{prefix}{name}")
              for name in fields if name in data}
    try:
        return cls(**kwargs)
    except ConfigError:
        raise
    except (ValueError, TypeError) as exc:
        raise ConfigError(f"{where}: {exc}") from None


def _coerce(annotation: Any, value: Any, key: str) -> Any:
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        options = [a for a in args if a is not type(None)]
        errors = []
        for option in options:
            try:
                return _coerce(option, value, key)
            except ConfigError as exc:
                errors.append(str(exc))
        raise ConfigError(errors[0] if len(errors) == 1 else
                          f"{key}={value!r} matches none of {_type_name(annotation)}")
    if origin is typing.Literal:  # a mode field: one of its spelled-out values
        if value in args:
            return value
        raise ConfigError(f"{key}={value!r}: expected one of {', '.join(map(str, args))}")
    if dataclasses.is_dataclass(annotation):
        return build_dataclass(annotation, value, f"{key}.")
    if annotation is Any:
        return value
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{key} must be a list, got {_describe(value)}")
        item_type = args[0] if args else Any
        items = [_coerce(item_type, v, f"{key}[{i}]") for i, v in enumerate(value)]
        return tuple(items) if origin is tuple else items
    if origin is dict:
        if not isinstance(value, Mapping):
            raise ConfigError(f"{key} must be a mapping, got {_describe(value)}")
        value_type = args[1] if len(args) == 2 else Any
        return {str(k): _coerce(value_type, v, f"{key}.{k}") for k, v in value.items()}
    return _scalar(annotation, value, key)


def _scalar(annotation: Any, value: Any, key: str) -> Any:
    if annotation is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{key} must be true or false, got {_describe(value)}")
    if annotation is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise ConfigError(f"{key} must be an integer, got {_describe(value)}")
    if annotation is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):  # YAML 1.1 reads '1e-6' as a string
            try:
                return float(value)
            except ValueError:
                pass
        raise ConfigError(f"{key} must be a number, got {_describe(value)}")
    if annotation is str:
        if isinstance(value, str):
            return value
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return str(value)
        raise ConfigError(f"{key} must be a string, got {_describe(value)}")
    raise ConfigError(f"{key}: unsupported schema type {_type_name(annotation)}")


def _describe(value: Any) -> str:
    text = repr(value)
    return f"{type(value).__name__} {text[:60]}"


def _type_name(annotation: Any) -> str:
    return getattr(annotation, "__name__", str(annotation))


def _suggest(key: str, fields: Mapping[str, Any]) -> str:
    close = difflib.get_close_matches(key, list(fields), n=1)
    if close:
        return f" (did you mean '{close[0]}'?)"
    return f" (known: {', '.join(sorted(fields))})"


def config_to_dict(config: Any) -> dict[str, Any]:
    """Plain dict of a config tree (for config.yaml in the run dir and W&B)."""
    return dataclasses.asdict(config)


def config_to_yaml(config: TrainConfig) -> str:
    """The resolved config as YAML text (what config.yaml in the run dir holds)."""
    return yaml.safe_dump(_plain(config_to_dict(config)), sort_keys=False)


def save_config(config: TrainConfig, path: Path) -> None:
    """Write the resolved config as YAML (atomically)."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(config_to_yaml(config))
    tmp.replace(path)


def _plain(value: Any) -> Any:
    """Plain YAML values; a literal `${` is written escaped, so that reading it back (where it
    would be an interpolation) gives the same string."""
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, str):
        return value.replace("${", "\\${")
    return value
