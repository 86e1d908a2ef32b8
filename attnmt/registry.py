"""One small registry for everything pluggable.

Built-ins and plugins register the same way::

    from attnmt.registry import register

    @register("criterion", "my_loss", config=MyLossConfig)
    class MyLoss: ...

Named architectures are presets over a registered model (as fairseq's ``--arch``)::

    @register_arch("transformer_big", model="transformer")
    def transformer_big() -> dict:
        "Vaswani et al. 2017, Table 3 'big'."
        return dict(encoder_embed_dim=1024, ...)

Third-party packages expose a module through the entry-point group ``attnmt.plugins``;
``--user-dir PATH`` imports a local module or package. Importing it runs its decorators.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.machinery
import importlib.util
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any

from attnmt.errors import UserError
from attnmt.signals import Terminated

KINDS = ("model", "arch", "task", "criterion", "optimizer", "lr_scheduler", "tokenizer", "bpe", "search")


@dataclass
class Entry:
    kind: str
    name: str
    obj: Any
    config: type | None
    description: str
    model: str | None = None  # for kind == "arch": the model the preset applies to


@dataclass
class Registry:
    kind: str
    entries: dict[str, Entry] = field(default_factory=dict)

    def add(self, entry: Entry) -> None:
        if entry.name in self.entries and self.entries[entry.name].obj is not entry.obj:
            raise ValueError(f"{self.kind} '{entry.name}' is already registered by {self.entries[entry.name].obj!r}")
        if entry.config is not None and not dataclasses.is_dataclass(entry.config):
            raise TypeError(f"{self.kind} '{entry.name}': config must be a dataclass, got {entry.config!r}")
        self.entries[entry.name] = entry

    def get(self, name: str) -> Entry:
        if name not in self.entries:
            foreign = _foreign_family(self.kind, name)
            if foreign:
                raise UserError(f"--{self.kind.replace('_', '-')} {name}: {foreign}, which attnmt does not implement; "
                                f"attnmt has: {', '.join(self.choices())}")
            raise UserError(
                f"unknown {self.kind.replace('_', ' ')} '{name}'; valid choices: {', '.join(self.choices()) or '(none registered)'}"
            )
        return self.entries[name]

    def choices(self) -> list[str]:
        return sorted(self.entries)


REGISTRIES: dict[str, Registry] = {k: Registry(k) for k in KINDS}

# fairseq's other model families and tasks, named when a fairseq command line asks for one
_FAIRSEQ_FAMILIES = {
    "arch": (("fconv", "a fairseq convolutional model (Gehring et al. 2017)"),
             ("lightconv", "a fairseq lightweight-convolution model"), ("dynamicconv", "a fairseq dynamic-convolution model"),
             ("lstm", "a fairseq LSTM model"), ("multilingual_transformer", "a fairseq multilingual model"),
             ("transformer_align", "a fairseq alignment model"), ("transformer_lm", "a fairseq language model"),
             ("bart", "a fairseq pretrained BART model"), ("mbart", "a fairseq pretrained mBART model"),
             ("roberta", "a fairseq RoBERTa model"), ("wav2vec", "a fairseq speech model"),
             ("s2t", "a fairseq speech-to-text model")),
    "task": (("multilingual_translation", "fairseq's multilingual task"),
             ("translation_multi_simple_epoch", "fairseq's multilingual task"),
             ("language_modeling", "fairseq's language-modelling task")),
    "optimizer": (("nag", "fairseq's Nesterov SGD for convolutional models"),),
}


def _foreign_family(kind: str, name: str) -> str | None:
    if kind == "arch" and name.endswith("_align"):
        return "a fairseq alignment model"
    for prefix, what in _FAIRSEQ_FAMILIES.get(kind, ()):
        if name.startswith(prefix):
            return what
    return None


def _first_line(obj: Any) -> str:
    doc = getattr(obj, "__doc__", None) or ""
    doc = doc.strip()
    return doc.splitlines()[0].strip() if doc else ""


def register(kind: str, name: str, config: type | None = None, description: str | None = None) -> Callable:
    """Decorator: register ``obj`` (a class or a builder function) under ``kind``/``name``."""
    if kind not in REGISTRIES:
        raise ValueError(f"unknown registry kind '{kind}'; valid: {', '.join(KINDS)}")

    def deco(obj):
        REGISTRIES[kind].add(Entry(kind, name, obj, config, description or _first_line(obj)))
        return obj

    return deco


def register_arch(name: str, model: str, description: str | None = None) -> Callable:
    """Decorator for a named architecture: a function returning field overrides for ``model``'s config."""

    def deco(fn):
        REGISTRIES["arch"].add(Entry("arch", name, fn, None, description or _first_line(fn), model=model))
        return fn

    return deco


def get(kind: str, name: str) -> Entry:
    return REGISTRIES[kind].get(name)


def choices(kind: str) -> list[str]:
    return REGISTRIES[kind].choices()


def arch_config(arch: str, overrides: dict[str, Any] | None = None):
    """The model config for ``--arch``: the model's defaults, then the preset, then ``overrides``."""
    from attnmt.config import make_config

    a = get("arch", arch)
    model = get("model", a.model)
    preset = a.obj()
    return make_config(model.config, {**preset, **(overrides or {})}, what=f"--arch {arch}")


# ----------------------------------------------------------------------------------------- plugins

_loaded_user_dirs: set[str] = set()
_user_modules: set[str] = set()


def load_entry_point_plugins() -> None:
    for ep in entry_points(group="attnmt.plugins"):
        try:
            ep.load()
        except (KeyboardInterrupt, Terminated):
            raise
        except BaseException as e:  # a broken third-party plugin must not hide behind a traceback
            raise UserError(f"plugin '{ep.name}' ({ep.value}) failed to load: {type(e).__name__}: {e}; "
                            f"fix or uninstall the package that provides it") from e


def import_user_dir(path: str | Path, option: str = "--user-dir") -> None:
    """Import a local plugin: a ``.py`` file or a package directory (fairseq's ``--user-dir``); ``option`` names
    where the path came from in error messages (``--user-dir`` or ``ATTNMT_USER_DIR``)."""
    p = Path(path).expanduser().resolve()
    key = str(p)
    if key in _loaded_user_dirs:
        return
    if not p.exists():
        raise UserError(f"{option} {path}: no such file or directory; pass a plugin .py file or package directory")
    if p.is_dir():
        init = p / "__init__.py"
        if not init.exists():
            raise UserError(f"{option} {path}: directory has no __init__.py; make it a package or pass a .py file")
        modname, location = p.name, init
        search = [str(p)]
    else:
        modname, location, search = p.stem, p, None
    if not modname.isidentifier():
        raise UserError(f"{option} {path}: '{modname}' is not a Python module name; rename the plugin (letters, "
                        f"digits and underscores)")
    if modname in sys.stdlib_module_names or (modname in sys.modules and modname not in _user_modules):
        raise UserError(f"{option} {path}: its module name '{modname}' is already taken by "
                        f"{'a standard module' if modname in sys.stdlib_module_names else 'an imported module'}, "
                        f"which it would replace; rename the plugin")
    if modname not in _user_modules:  # an installed module of that name, found anywhere but beside the plugin
        home = p.parent.resolve()  # the directory holding the plugin file or package
        elsewhere = [d for d in sys.path if Path(d or ".").resolve() != home]
        try:
            installed = importlib.machinery.PathFinder.find_spec(modname, elsewhere)
        except (ImportError, ValueError):
            installed = None
        origin = getattr(installed, "origin", None)
        if origin and origin not in ("built-in", "frozen") and Path(origin).resolve() != location.resolve():
            raise UserError(f"{option} {path}: its module name '{modname}' is that of an installed module "
                            f"({origin}), which it would hide; rename the plugin")
    spec = importlib.util.spec_from_file_location(modname, location, submodule_search_locations=search)
    module = importlib.util.module_from_spec(spec)
    sys.modules[modname] = module
    try:
        spec.loader.exec_module(module)
    except UserError:
        raise
    except SystemExit as e:
        del sys.modules[modname]
        raise UserError(f"{option} {path}: the plugin called sys.exit({e.code}) while being imported; a plugin "
                        f"should only register components") from None
    except (KeyboardInterrupt, Terminated):
        del sys.modules[modname]
        raise
    except BaseException as e:  # Exception, and anything else a plugin raises (BaseException itself included)
        del sys.modules[modname]
        raise UserError(f"{option} {path}: importing the plugin failed: {type(e).__name__}: {e}") from None
    _loaded_user_dirs.add(key)
    _user_modules.add(modname)


def load_plugins(user_dirs: list[str] | tuple[str, ...] = (), env_dirs: list[str] | tuple[str, ...] = ()) -> None:
    """Entry-point plugins, ``--user-dir`` paths, then ``ATTNMT_USER_DIR`` ones (the built-in components register
    when their packages are imported: ``attnmt.cli.load_components``)."""
    load_entry_point_plugins()
    for d in user_dirs:
        import_user_dir(d)
    for d in env_dirs:
        import_user_dir(d, "ATTNMT_USER_DIR")
