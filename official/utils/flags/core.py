"""Flags generated from frozen config dataclasses, so that each default is written once.

A table row (`FlagSpec`) names a flag, the config field it sets (a dotted path such as
``model.mf_dim``), its help, short name and checks. `define_flags` defines the absl
flags of a table with the defaults of a config instance, and `config_from_flags` builds
the config back from the parsed flags: the config dataclass is the one source of every
default, and the table the one place a flag is described. A flag's type is its field's
(``bool``, ``int``, ``float``, ``str``, or a tuple, which becomes a comma-separated list)
unless the row says otherwise.
"""

from __future__ import annotations

import dataclasses
import functools
import sys
import types
import typing
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from absl import flags


@dataclasses.dataclass(frozen=True)
class Check:
    """A validator of one flag's value; ``{flag}`` in `message` becomes its name."""

    test: Callable[[Any], bool]
    message: str


POSITIVE = Check(
    lambda value: value is not None and value > 0, "--{flag} must be a positive number"
)
POSITIVE_OR_UNSET = Check(
    lambda value: value is None or value > 0, "--{flag} must be a positive number"
)
NON_NEGATIVE = Check(
    lambda value: value is not None and value >= 0, "--{flag} must not be negative"
)
NON_NEGATIVE_OR_UNSET = Check(
    lambda value: value is None or value >= 0, "--{flag} must not be negative"
)


def _is_step_range(value: list[str] | None) -> bool:
    try:
        steps = [int(step) for step in value or ()]
    except ValueError:
        return False
    return not steps or (len(steps) == 2 and 0 < steps[0] <= steps[1])


# A list flag of two steps, FIRST,LAST (from 1), or unset.
STEP_RANGE_OR_UNSET = Check(_is_step_range, "--{flag} must be FIRST,LAST with 0 < FIRST <= LAST")


@dataclasses.dataclass(frozen=True)
class Rule:
    """A validator of several flags together (absl's multi-flag validator)."""

    flags: tuple[str, ...]
    test: Callable[[dict], bool]
    message: str


@dataclasses.dataclass(frozen=True)
class FieldRule:
    """A rule on fields of a config dataclass, written once: its ``__post_init__``
    checks it (`check_fields`), and a table whose flags set those fields checks it as a
    `Rule` (`flag_rules`), so a command line that breaks it gets a flag error.

    Attributes:
        fields: The fields, by name.
        test: Whether their values (keyword arguments by field name) are fine.
        message: What is wrong; ``{field}`` becomes the field's name in a config's
            error and ``--flag`` in a flag error.
    """

    fields: tuple[str, ...]
    test: Callable[..., bool]
    message: str


def check_fields(config: Any, rules: Sequence[FieldRule]) -> None:
    """Raises ValueError for the first of `rules` that `config`'s fields break."""
    for rule in rules:
        values = {name: getattr(config, name) for name in rule.fields}
        if not rule.test(**values):
            message = rule.message.format(**{name: name for name in rule.fields})
            got = ", ".join(f"{name}={value!r}" for name, value in values.items())
            raise ValueError(f"{message} (got {got})")


def flag_rules(rules: Sequence[FieldRule], table: Table, owner: str, config: Any) -> tuple:
    """`rules` on the fields of the config at `owner` (``model``; `config` is one) as
    `Rule`s of the flags of `table` that set them; a rule on a field no flag sets is
    left to the config. A value that does not parse passes: its flag's check says so."""
    by_path = {spec.path: spec for spec in specs(table)}
    converted = []
    for rule in rules:
        paths = [f"{owner}.{name}" for name in rule.fields]
        if not all(path in by_path for path in paths):
            continue
        row = {name: by_path[path] for name, path in zip(rule.fields, paths, strict=True)}

        def test(values: dict, rule: FieldRule = rule, row: dict = row) -> bool:
            try:
                fields = {
                    name: _field_value(
                        dataclasses.replace(spec, field=name), config, values[spec.name]
                    )
                    for name, spec in row.items()
                }
            except (TypeError, ValueError):
                return True
            return rule.test(**fields)

        message = rule.message.format(**{name: f"--{spec.name}" for name, spec in row.items()})
        converted.append(Rule(tuple(spec.name for spec in row.values()), test, message))
    return tuple(converted)


@dataclasses.dataclass(frozen=True)
class FlagSpec:
    """One flag and the config field it sets; its default is that field's default.

    Attributes:
        name: The flag (Model Garden name).
        help: What it means.
        field: Dotted path of the field in the config ("" = the flag's name).
        short_name: absl short name (``-bs``).
        choices: An enum flag's values.
        checks: Validators of its value.
        kind: The flag's type where it is not the field's (a ``str`` flag for a number).
        parse: Flag value -> field value (default: lists become tuples of the element type).
        format: Field value -> flag default (default: tuples become lists of strings).
    """

    name: str
    help: str
    field: str = ""
    short_name: str | None = None
    choices: tuple[str, ...] = ()
    checks: tuple[Check, ...] = ()
    kind: type | None = None
    parse: Callable[[Any], Any] | None = None
    format: Callable[[Any], Any] | None = None

    @property
    def path(self) -> str:
        return self.field or self.name


Table = Sequence[FlagSpec | Rule]

# For a text field where "" means unset: the flag's default is None, as absl shows unset.
EMPTY_AS_UNSET: dict[str, Callable[[Any], Any]] = {
    "format": lambda value: value or None,
    "parse": lambda value: value or "",
}


def specs(table: Table) -> list[FlagSpec]:
    """The flag rows of `table` (without its rules)."""
    return [row for row in table if isinstance(row, FlagSpec)]


def at(table: Table, **fields: str) -> tuple[FlagSpec | Rule, ...]:
    """`table` with the named flags setting other fields (``dtype="model.dtype"``): for
    a config that keeps a shared concept elsewhere."""
    unknown = set(fields) - {spec.name for spec in specs(table)}
    if unknown:
        raise KeyError(f"no such flags in the table: {sorted(unknown)}")
    return tuple(
        dataclasses.replace(row, field=fields[row.name])
        if isinstance(row, FlagSpec) and row.name in fields
        else row
        for row in table
    )


def under(table: Table, owner: str) -> tuple[FlagSpec | Rule, ...]:
    """`table`, written for a config of its own, setting the fields of the config at
    `owner` (``redis``) in a larger one."""
    return at(table, **{spec.name: f"{owner}.{spec.path}" for spec in specs(table)})


def get_field(config: Any, path: str) -> Any:
    """The value at dotted `path` in `config`."""
    return functools.reduce(getattr, path.split("."), config)


def replace_fields(config: Any, values: Mapping[str, Any]) -> Any:
    """`config` with the fields at the dotted paths of `values` replaced: one
    `dataclasses.replace` per dataclass, so its ``__post_init__`` checks see them together."""
    direct: dict[str, Any] = {}
    nested: dict[str, dict[str, Any]] = {}
    for path, value in values.items():
        head, _, rest = path.partition(".")
        if rest:
            nested.setdefault(head, {})[rest] = value
        else:
            direct[head] = value
    for head, inner in nested.items():
        direct[head] = replace_fields(getattr(config, head), inner)
    return dataclasses.replace(config, **direct)


def flag_default(spec: FlagSpec, config: Any) -> Any:
    """The default of `spec`'s flag: its field's value in `config`, written as a flag."""
    return as_flag_value(spec, get_field(config, spec.path))


def as_flag_value(spec: FlagSpec, value: Any) -> Any:
    """A field value as `spec`'s flag holds it."""
    if spec.format is not None:
        return spec.format(value)
    if isinstance(value, tuple):
        return [str(item) for item in value] or None
    return value


def define_flags(table: Table, defaults: Any, flag_values: flags.FlagValues = flags.FLAGS) -> None:
    """Defines the flags of `table` with the defaults of config `defaults`, then their
    checks and rules, in table order. The flags count as defined by the caller's module
    (``--help`` lists the main module's)."""
    module_name = _module_name(sys._getframe(1))
    for row in table:
        if isinstance(row, Rule):
            flags.register_multi_flags_validator(
                list(row.flags), row.test, message=row.message, flag_values=flag_values
            )
            continue
        _define(row, defaults, flag_values, module_name)
        for check in row.checks:
            flags.register_validator(
                row.name,
                check.test,
                message=check.message.format(flag=row.name),
                flag_values=flag_values,
            )


def config_from_flags(table: Table, config: Any, flag_values: flags.FlagValues) -> Any:
    """`config` with every field of `table` set from its parsed flag."""
    return replace_fields(
        config,
        {
            spec.path: _field_value(spec, config, flag_values[spec.name].value)
            for spec in specs(table)
        },
    )


def _define(spec: FlagSpec, defaults: Any, flag_values: flags.FlagValues, module: str) -> None:
    kind = spec.kind or _field_type(defaults, spec.path)
    options = dict(flag_values=flag_values, short_name=spec.short_name, module_name=module)
    default = flag_default(spec, defaults)
    if spec.choices:
        flags.DEFINE_enum(spec.name, default, list(spec.choices), spec.help, **options)
    elif typing.get_origin(kind) is tuple:
        flags.DEFINE_list(spec.name, default, spec.help, **options)
    else:
        define = {
            bool: flags.DEFINE_boolean,
            int: flags.DEFINE_integer,
            float: flags.DEFINE_float,
            str: flags.DEFINE_string,
        }[kind]
        define(spec.name, default, spec.help, **options)


def _field_value(spec: FlagSpec, config: Any, value: Any) -> Any:
    """A flag value as its field holds it (`config` gives the field's type)."""
    if spec.parse is not None:
        return spec.parse(value)
    kind = _field_type(config, spec.path)
    if typing.get_origin(kind) is tuple:
        return tuple(typing.get_args(kind)[0](item) for item in value or ())
    return value


def _field_type(config: Any, path: str) -> Any:
    """The annotated type of the field at `path`, without ``| None``."""
    owner_path, _, name = path.rpartition(".")
    owner = get_field(config, owner_path) if owner_path else config
    hint = _type_hints(type(owner))[name]
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        (hint,) = (arg for arg in typing.get_args(hint) if arg is not type(None))
    return hint


@functools.cache
def _type_hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _module_name(frame: types.FrameType) -> str:
    """The module of `frame` as absl names it: the main module by its file."""
    name = frame.f_globals["__name__"]
    return sys.argv[0] if name == "__main__" else name
