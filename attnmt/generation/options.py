"""The search and generation configs from the options a user gave: shared by the commands and the Python API.

The options are the fields of :class:`~attnmt.generation.search.SearchConfig`, of the chosen strategy's registered
config, and of :class:`~attnmt.generation.generator.GenerationConfig`; each is checked as the command line checks
it, so a bad value gives the same one-line :class:`~attnmt.errors.UserError` wherever it came from.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from attnmt import registry
from attnmt.config import fields_of, make_config, option_name, split_given
from attnmt.errors import UserError
from attnmt.generation.generator import GenerationConfig
from attnmt.generation.search import SearchConfig


def search_option_classes() -> list[type]:
    """The search options: the shared ones and those of every registered strategy (plugins included)."""
    return [SearchConfig, *(e.config for e in registry.REGISTRIES["search"].entries.values() if e.config is not None)]


def search_config(given: dict[str, Any]) -> SearchConfig:
    """The typed search config, with the chosen strategy's own options; an option of another strategy is an error."""
    if given.get("sampling") and given.get("search", "sampling") != "sampling":
        raise UserError(f"--sampling and --search {given['search']} disagree (--sampling means --search sampling); "
                        f"give one of them")
    name = "sampling" if given.get("sampling") else given.get("search", "beam")
    strategy = registry.get("search", name)
    per, leftovers = split_given(given, {"search": SearchConfig, "options": strategy.config})
    if leftovers:
        owners = {k: [n for n, e in registry.REGISTRIES["search"].entries.items()
                      if e.config is not None and k in fields_of(e.config)] for k in leftovers}
        raise UserError("; ".join(f"{option_name(k)} is an option of --search {' or '.join(owners[k]) or '?'}, not of "
                                  f"--search {name}" for k in leftovers) + "; remove it or choose that search")
    options = make_config(strategy.config, per["options"], what=f"--search {name}") if strategy.config else None
    return dataclasses.replace(make_config(SearchConfig, per["search"]), options=options)


def generation_configs(given: dict[str, Any]) -> tuple[SearchConfig, GenerationConfig]:
    """The typed search and generation configs from the options given (unset ones left out)."""
    gen_names = fields_of(GenerationConfig)
    gen = make_config(GenerationConfig, {k: v for k, v in given.items() if k in gen_names})
    return search_config({k: v for k, v in given.items() if k not in gen_names}), gen


def _option_names(cls) -> set[str]:
    return {k for k, (f, _) in fields_of(cls).items() if f.metadata.get("cli", True)}


def search_option_names() -> set[str]:
    """The search options (Python spelling): the shared ones and every registered strategy's."""
    names: set[str] = set()
    for cls in search_option_classes():
        names |= _option_names(cls)
    return names


def known_options() -> set[str]:
    """Every option name ``generation_configs`` takes (Python spelling)."""
    return _option_names(GenerationConfig) | search_option_names()
