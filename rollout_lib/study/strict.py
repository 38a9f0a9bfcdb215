"""Strict mapping -> frozen dataclass conversion with errors that name the key path.

A small, explicit converter (standard library only, so it also runs on the offline GPU machine):
every key must be known, every required key present, every value of the declared type, and every
constrained value in range. Constraints live in field metadata: `min`, `max`, `min_exclusive`,
`choices`, `pattern`, `min_items`.
"""

from __future__ import annotations

import dataclasses
import math
import re
import types
import typing
from typing import Any, Literal, TypeVar, Union, get_args, get_origin, get_type_hints

import yaml

T = TypeVar("T")

MESSAGE_CAP_CHARS = 400  # an error names the key and shows a bounded excerpt of the value, never a flood
# No number in a study is anywhere near this; a larger one is a typo or an attack, not a setting.
PLAUSIBLE_MAGNITUDE = 1e15


def _cap(text: str, limit: int = MESSAGE_CAP_CHARS) -> str:
    return text if len(text) <= limit else text[:limit] + f"... [{len(text) - limit} more chars]"


class StrictLoadError(ValueError):
    """A value does not fit the schema; `key_path` names where (e.g. `workload.prompt_tokens[1]`)."""

    def __init__(self, key_path: str, message: str):
        self.key_path = _cap(key_path or "<root>", 200)
        self.message = _cap(message)
        super().__init__(f"{self.key_path}: {self.message}")


def _join(path: str, key: str | int) -> str:
    if isinstance(key, int):
        return f"{path}[{key}]"
    return f"{path}.{key}" if path else key


def describe_type(tp: Any) -> str:
    origin = get_origin(tp)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in get_args(tp))
    if origin in (Union, types.UnionType):
        return " or ".join(describe_type(a) for a in get_args(tp))
    if origin is tuple:
        args = get_args(tp)
        if len(args) == 2 and args[1] is Ellipsis:
            return f"list of {describe_type(args[0])}"
        return "list [" + ", ".join(describe_type(a) for a in args) + "]"
    if origin is dict:
        return f"mapping of {describe_type(get_args(tp)[1])}"
    if tp is type(None):
        return "null"
    if dataclasses.is_dataclass(tp):
        return f"mapping ({tp.__name__})"
    return getattr(tp, "__name__", str(tp))


def _check_constraints(value: Any, meta: typing.Mapping[str, Any], path: str) -> None:
    if value is None:
        return
    if "choices" in meta and value not in meta["choices"]:
        allowed = ", ".join(repr(c) for c in meta["choices"])
        raise StrictLoadError(path, f"{value!r} is not allowed; allowed: {allowed}")
    if "pattern" in meta and not re.fullmatch(meta["pattern"], value):
        raise StrictLoadError(path, f"{value!r} does not match {meta['pattern']!r}"
                              + (f" ({meta['pattern_help']})" if "pattern_help" in meta else ""))
    items = value if isinstance(value, tuple) else (value,)
    if "min_items" in meta and isinstance(value, tuple) and len(value) < meta["min_items"]:
        raise StrictLoadError(path, f"needs at least {meta['min_items']} item(s), got {len(value)}")
    if "exact_items" in meta and isinstance(value, tuple) and len(value) != meta["exact_items"]:
        raise StrictLoadError(path, f"needs exactly {meta['exact_items']} item(s), got {len(value)}")
    for index, item in enumerate(items):
        item_path = _join(path, index) if isinstance(value, tuple) else path
        if not isinstance(item, (int, float)) or isinstance(item, bool):
            continue
        if "min" in meta and item < meta["min"]:
            raise StrictLoadError(item_path, f"{item!r} is below the minimum {meta['min']!r}")
        if "min_exclusive" in meta and item <= meta["min_exclusive"]:
            raise StrictLoadError(item_path, f"{item!r} must be greater than {meta['min_exclusive']!r}")
        if "max" in meta and item > meta["max"]:
            raise StrictLoadError(item_path, f"{item!r} is above the maximum {meta['max']!r}")


def convert(tp: Any, value: Any, path: str) -> Any:
    """Convert `value` to type `tp` strictly (no str->int coercion, no bool as int)."""
    origin = get_origin(tp)
    if tp is Any:
        return value
    if origin is Literal:
        allowed = get_args(tp)
        if value not in allowed or type(value) is not type(allowed[allowed.index(value)]):
            raise StrictLoadError(path, f"{value!r} is not allowed; allowed: "
                                  + ", ".join(repr(a) for a in allowed))
        return value
    if origin in (Union, types.UnionType):
        options = get_args(tp)
        if value is None:
            if type(None) in options:
                return None
            raise StrictLoadError(path, f"must not be null; expected {describe_type(tp)}")
        errors = []
        for option in options:
            if option is type(None):
                continue
            try:
                return convert(option, value, path)
            except StrictLoadError as exc:
                errors.append(exc)
        if len(errors) == 1:
            raise errors[0]
        raise StrictLoadError(path, f"expected {describe_type(tp)}, got {type(value).__name__} {value!r}")
    if origin is tuple:
        if not isinstance(value, list):
            raise StrictLoadError(path, f"expected {describe_type(tp)}, got {type(value).__name__} {value!r}")
        args = get_args(tp)
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(convert(args[0], item, _join(path, i)) for i, item in enumerate(value))
        if len(value) != len(args):
            raise StrictLoadError(path, f"expected {len(args)} items ({describe_type(tp)}), got {len(value)}")
        return tuple(convert(a, item, _join(path, i)) for i, (a, item) in enumerate(zip(args, value, strict=True)))
    if origin is dict:
        key_type, value_type = get_args(tp)
        if not isinstance(value, dict):
            raise StrictLoadError(path, f"expected a mapping, got {type(value).__name__} {value!r}")
        return types.MappingProxyType({convert(key_type, k, path): convert(value_type, v, _join(path, str(k)))
                                       for k, v in value.items()})
    if dataclasses.is_dataclass(tp):
        return from_mapping(tp, value, path)
    if tp is bool:
        if not isinstance(value, bool):
            raise StrictLoadError(path, f"expected true or false, got {type(value).__name__} {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise StrictLoadError(path, f"expected an integer, got {type(value).__name__} {value!r}")
        _check_magnitude(value, path)
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise StrictLoadError(path, f"expected a number, got {type(value).__name__} {value!r}")
        if not math.isfinite(value):
            raise StrictLoadError(path, f"{value!r} is not allowed; expected a finite number")
        _check_magnitude(value, path)
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise StrictLoadError(path, f"expected a string, got {type(value).__name__} {value!r}")
        return value
    raise TypeError(f"schema error: unsupported type {tp!r} at {path}")


def _check_magnitude(value: float, path: str) -> None:
    if abs(value) > PLAUSIBLE_MAGNITUDE:
        raise StrictLoadError(path, f"{value!r} is implausibly large (|value| > {PLAUSIBLE_MAGNITUDE:g})")


def from_mapping(cls: type[T], data: Any, path: str = "") -> T:
    """Build dataclass `cls` from a mapping; unknown/missing keys and bad values raise StrictLoadError."""
    if not isinstance(data, dict):
        raise StrictLoadError(path, f"expected a mapping ({cls.__name__}), got {type(data).__name__} {data!r}")
    hints = get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    unknown = sorted(set(data) - set(fields), key=str)
    if unknown:
        raise StrictLoadError(_join(path, str(unknown[0])),
                              f"unknown key; allowed keys here: {', '.join(sorted(fields))}")
    values: dict[str, Any] = {}
    for name, field in fields.items():
        key_path = _join(path, name)
        if name not in data:
            has_default = field.default is not dataclasses.MISSING or field.default_factory is not dataclasses.MISSING
            if has_default:
                continue
            raise StrictLoadError(key_path, f"missing required key ({describe_type(hints[name])})")
        converted = convert(hints[name], data[name], key_path)
        _check_constraints(converted, field.metadata, key_path)
        values[name] = converted
    return cls(**values)


class _StrictYAMLLoader(yaml.SafeLoader):
    """safe_load without aliases (an 8 KB alias bomb expands to gigabytes) and without duplicate keys
    (YAML would silently keep the last one); both are refused with the full key path."""

    def compose_node(self, parent: Any, index: Any) -> Any:
        if self.check_event(yaml.events.AliasEvent):
            event = self.peek_event()
            raise StrictLoadError(_node_path_hint(event), f"YAML aliases (*{event.anchor}) are not allowed in a "
                                  f"study file (line {event.start_mark.line + 1}); write the value out")
        return super().compose_node(parent, index)


def _node_path_hint(event: Any) -> str:
    return f"<line {event.start_mark.line + 1}>"


def _check_duplicate_keys(node: yaml.Node, path: str) -> None:
    if isinstance(node, yaml.MappingNode):
        seen: dict[Any, int] = {}
        for key_node, value_node in node.value:
            key = key_node.value if isinstance(key_node, yaml.ScalarNode) else repr(key_node)
            key_path = _join(path, str(key))
            if key in seen:
                raise StrictLoadError(key_path, f"duplicate key (lines {seen[key]} and {key_node.start_mark.line + 1})")
            seen[key] = key_node.start_mark.line + 1
            _check_duplicate_keys(value_node, key_path)
    elif isinstance(node, yaml.SequenceNode):
        for index, item in enumerate(node.value):
            _check_duplicate_keys(item, _join(path, index))


def load_yaml(text: str) -> Any:
    loader = _StrictYAMLLoader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        _check_duplicate_keys(node, "")
        return loader.construct_document(node)
    finally:
        loader.dispose()
