"""Typed dataclass configs and their command-line options.

Configuration flows one way: click options -> ``make_config(cls, given)`` -> a validated dataclass -> a builder.
Every field of a component config becomes an option: ``encoder_layers`` is ``--encoder-layers``; a bool field
is a ``--flag/--no-flag`` pair; a ``tuple`` field takes a Python literal such as ``'(0.9, 0.98)'``; a ``Literal``
field takes one of its values. A field's help text is ``field(metadata={"help": ...})``.

Options are created with ``default=None`` so that only what the user typed overrides the defaults (and the
``--arch`` preset).
"""

from __future__ import annotations

import ast
import dataclasses
import math
import types
import typing
from typing import Any, Literal, get_args, get_origin, get_type_hints

import click

from attnmt.errors import UserError


def option_name(field_name: str) -> str:
    return "--" + field_name.replace("_", "-")


def _unwrap_optional(tp):
    origin = get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in get_args(tp) if a is not type(None)]
        if len(args) == 1:
            return args[0], True
    return tp, False


def coerce(value: Any, tp, name: str) -> Any:
    """Convert ``value`` (from the CLI or a checkpoint) to type ``tp``; raise UserError with the valid form."""
    opt = option_name(name)
    base, optional = _unwrap_optional(tp)
    if value is None:
        if optional:
            return None
        raise UserError(f"{opt} must not be empty; give a {getattr(base, '__name__', base)}")
    origin = get_origin(base)
    if origin is Literal:
        allowed = get_args(base)
        if value not in allowed:
            raise UserError(f"invalid value {value!r} for {opt}; valid choices: {', '.join(map(str, allowed))}")
        return value
    if base is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "1", "yes", "false", "0", "no"):
            return value.lower() in ("true", "1", "yes")
        raise UserError(f"invalid value {value!r} for {opt}; expected true or false")
    if base is int:
        if isinstance(value, bool):
            raise UserError(f"invalid value {value!r} for {opt}; expected an integer")
        if isinstance(value, int):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        try:
            return int(str(value).replace("_", ""))
        except ValueError:
            raise UserError(f"invalid value {value!r} for {opt}; expected an integer") from None
    if base is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        try:
            return float(value)
        except ValueError:
            raise UserError(f"invalid value {value!r} for {opt}; expected a number") from None
    if base is str:
        return str(value)
    if origin is tuple:
        if isinstance(value, str):
            try:
                value = ast.literal_eval(value)
            except (ValueError, SyntaxError):
                raise UserError(f"invalid value {value!r} for {opt}; expected a tuple such as '(0.9, 0.98)'") from None
        if not isinstance(value, (tuple, list)):
            raise UserError(f"invalid value {value!r} for {opt}; expected a tuple such as '(0.9, 0.98)'")
        args = get_args(base)
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(coerce(v, args[0], name) for v in value)
        if len(args) != len(value):
            raise UserError(f"invalid value {value!r} for {opt}; expected {len(args)} values")
        return tuple(coerce(v, a, name) for v, a in zip(value, args))
    return value


def check_bounds(value: Any, f: dataclasses.Field, name: str) -> Any:
    """``value`` checked against its field's bounds; a UserError naming the option and its range otherwise.

    Every number must be finite (nan would switch a limit off or make every comparison false, inf make every
    length or product unbounded). A field's metadata may bound it further: ``"min"`` and ``"max"`` (inclusive),
    ``"above"`` (exclusive lower bound). The bounds hold for options typed by a user and for configs read from a
    checkpoint alike (a hostile file's sizes are refused before anything is built from them).
    """
    opt = option_name(name)
    for v in value if isinstance(value, tuple) else (value,):
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            continue
        if isinstance(v, float) and not math.isfinite(v):
            raise UserError(f"{opt} {v}: give a finite number{_range(f.metadata)}")
        lo, hi, above = f.metadata.get("min"), f.metadata.get("max"), f.metadata.get("above")
        if (lo is not None and v < lo) or (hi is not None and v > hi) or (above is not None and v <= above):
            raise UserError(f"{opt} {v}: out of range; give a number{_range(f.metadata)}")
    return value


def _range(metadata) -> str:
    lo, hi, above = metadata.get("min"), metadata.get("max"), metadata.get("above")
    parts = [f">= {lo}" if lo is not None else "", f"> {above}" if above is not None else "",
             f"<= {hi}" if hi is not None else ""]
    parts = [p for p in parts if p]
    return f" {' and '.join(parts)}" if parts else ""


def fields_of(cls) -> dict[str, tuple[dataclasses.Field, Any]]:
    hints = get_type_hints(cls)
    return {f.name: (f, hints[f.name]) for f in dataclasses.fields(cls)}


def make_config(cls, given: dict[str, Any] | None = None, what: str | None = None):
    """Build ``cls`` from its defaults plus ``given``; unknown keys and badly typed values fail at once."""
    given = dict(given or {})
    fs = fields_of(cls)
    unknown = [k for k in given if k not in fs]
    if unknown:
        where = f" for {what}" if what else ""
        raise UserError(
            f"unknown option{'s' if len(unknown) > 1 else ''} {', '.join(option_name(k) for k in unknown)}{where}; "
            f"valid: {', '.join(option_name(k) for k in fs)}"
        )
    kwargs = {k: check_bounds(coerce(v, fs[k][1], k), fs[k][0], k) for k, v in given.items()}
    try:
        return cls(**kwargs)
    except (ValueError, TypeError) as e:
        raise UserError(str(e)) from None


def config_from_dict(cls, d: dict[str, Any]):
    """Rebuild a config saved with ``dataclasses.asdict`` (e.g. from a checkpoint), ignoring unknown keys."""
    fs = fields_of(cls)
    return make_config(cls, {k: v for k, v in d.items() if k in fs})


def _click_type(tp):
    base, _ = _unwrap_optional(tp)
    if get_origin(base) is Literal:
        return click.Choice([str(a) for a in get_args(base)])
    return {int: click.INT, float: click.FLOAT, str: click.STRING}.get(base, click.STRING)


def _help(f: dataclasses.Field, default_source: str | None) -> str:
    text = f.metadata.get("help", "")
    if f.default is not dataclasses.MISSING and f.default is not None:
        d = f.default
        text += f" [default: {d if default_source is None else default_source}]"
    return text.strip()


def click_options(cls, skip: tuple[str, ...] = ()) -> list[click.Option]:
    """One click option per dataclass field, all defaulting to None ("not given")."""
    opts = []
    for name, (f, tp) in fields_of(cls).items():
        if name in skip or f.metadata.get("cli") is False:
            continue
        base, _ = _unwrap_optional(tp)
        decls = [option_name(name)] + list(f.metadata.get("aliases", ()))
        if base is bool and name.startswith("no_"):
            # a negative field (no_scale_embedding) is a plain flag: --no-scale-embedding
            opts.append(click.Option([option_name(name), name], is_flag=True, flag_value=True, default=None,
                                     help=_help(f, None)))
        elif base is bool:
            decls = [f"{option_name(name)}/--no-{name.replace('_', '-')}", name]
            opts.append(click.Option(decls, default=None, help=_help(f, None)))
        elif "flag_value" in f.metadata:  # an option whose value may be left out: --remove-bpe [SYMBOL]
            opts.append(click.Option([*decls, name], type=_click_type(tp), is_flag=False,
                                     flag_value=f.metadata["flag_value"], default=None, help=_help(f, None),
                                     metavar=f.metadata.get("metavar")))
        else:
            opts.append(click.Option([*decls, name], type=_click_type(tp), default=None, help=_help(f, None),
                                     metavar=f.metadata.get("metavar")))
    return opts


def given_options(params: dict[str, Any]) -> dict[str, Any]:
    """The options the user typed (click gives None for the rest)."""
    return {k: v for k, v in params.items() if v is not None}


def add_options(command: click.Command, classes, skip: tuple[str, ...] = ()) -> click.Command:
    """Append options for all fields of ``classes`` to ``command``; a field shared by two classes appears once."""
    seen = {p.name for p in command.params}
    for cls in classes:
        for opt in click_options(cls, skip):
            if opt.name not in seen:
                command.params.append(opt)
                seen.add(opt.name)
    return command


def split_given(given: dict[str, Any], classes: dict[str, type]) -> tuple[dict[str, dict[str, Any]], list[str]]:
    """Distribute typed options to the components they belong to; return (per-component, leftovers)."""
    out: dict[str, dict[str, Any]] = {k: {} for k in classes}
    used = set()
    for key, cls in classes.items():
        if cls is None:
            continue
        names = fields_of(cls)
        for k, v in given.items():
            if k in names:
                out[key][k] = v
                used.add(k)
    return out, [k for k in given if k not in used]


def to_dict(cfg) -> dict[str, Any]:
    """A config as plain Python containers (what a checkpoint stores)."""
    d = dataclasses.asdict(cfg)
    return {k: list(v) if isinstance(v, tuple) else v for k, v in d.items()}
