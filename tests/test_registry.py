"""The plugin registry and typed configs: decorators, --user-dir plugins, validation messages, `attnmt list`."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from dataclasses import dataclass, field
from typing import Literal

import pytest

from attnmt import registry
from attnmt.cli import load_components
from attnmt.config import make_config
from attnmt.errors import UserError


@dataclass
class ToyConfig:
    size: int = field(default=4, metadata={"help": "how big"})
    rate: float = 0.5
    betas: tuple[float, float] = (0.9, 0.98)
    mode: Literal["fast", "exact"] = "fast"
    flag: bool = False


def test_register_and_get_roundtrip():
    @registry.register("criterion", "toy_criterion_for_test", config=ToyConfig)
    class Toy:
        """A toy criterion used by the registry test."""

    entry = registry.get("criterion", "toy_criterion_for_test")
    assert entry.obj is Toy and entry.config is ToyConfig
    assert entry.description == "A toy criterion used by the registry test."
    assert "toy_criterion_for_test" in registry.choices("criterion")
    del registry.REGISTRIES["criterion"].entries["toy_criterion_for_test"]


def test_duplicate_name_is_refused():
    @registry.register("optimizer", "dup_for_test")
    class A:
        pass

    with pytest.raises(ValueError, match="already registered"):
        @registry.register("optimizer", "dup_for_test")
        class B:
            pass

    del registry.REGISTRIES["optimizer"].entries["dup_for_test"]


def test_unknown_name_lists_choices():
    load_components()
    with pytest.raises(UserError) as e:
        registry.get("arch", "transformer_huge")
    msg = str(e.value)
    assert "unknown arch 'transformer_huge'" in msg
    for name in registry.choices("arch"):
        assert name in msg


def test_make_config_coerces_cli_strings():
    cfg = make_config(ToyConfig, {"size": "8", "rate": "0.25", "betas": "(0.9, 0.997)", "mode": "exact", "flag": True})
    assert cfg == ToyConfig(size=8, rate=0.25, betas=(0.9, 0.997), mode="exact", flag=True)


@pytest.mark.parametrize(
    "given, expected",
    [
        ({"size": "eight"}, "invalid value 'eight' for --size; expected an integer"),
        ({"rate": "fast"}, "invalid value 'fast' for --rate; expected a number"),
        ({"mode": "slow"}, "invalid value 'slow' for --mode; valid choices: fast, exact"),
        ({"betas": "0.9"}, "expected a tuple"),
        ({"betas": "(0.9, 0.98, 0.7)"}, "expected 2 values"),
        ({"colour": "red"}, "unknown option --colour; valid: --size, --rate, --betas, --mode, --flag"),
    ],
)
def test_make_config_rejects_bad_values_with_the_valid_form(given, expected):
    with pytest.raises(UserError) as e:
        make_config(ToyConfig, given)
    assert expected in str(e.value)


PLUGIN = textwrap.dedent(
    '''
    """A third-party criterion registered the same way the built-ins are."""
    from dataclasses import dataclass, field
    from attnmt.registry import register

    @dataclass
    class WeirdLossConfig:
        weirdness: float = field(default=0.5, metadata={"help": "how weird"})

    @register("criterion", "weird_loss", config=WeirdLossConfig)
    class WeirdLoss:
        """Cross-entropy, but weird (plugin test)."""
        def __init__(self, cfg):
            self.cfg = cfg
    '''
)


def test_user_dir_plugin_registers_like_a_builtin(tmp_path):
    plugin_dir = tmp_path / "my_plugin"
    plugin_dir.mkdir()
    (plugin_dir / "__init__.py").write_text(PLUGIN)
    registry.import_user_dir(plugin_dir)
    entry = registry.get("criterion", "weird_loss")
    cfg = make_config(entry.config, {"weirdness": "0.75"})
    assert entry.obj(cfg).cfg.weirdness == 0.75
    del registry.REGISTRIES["criterion"].entries["weird_loss"]


def test_user_dir_missing_path_is_a_clear_error(tmp_path):
    with pytest.raises(UserError, match="no such file or directory"):
        registry.import_user_dir(tmp_path / "nope")


def _attnmt(*args):
    return subprocess.run([sys.executable, "-m", "attnmt.cli", *args], capture_output=True, text=True)


def test_cli_list_shows_user_dir_plugin_with_description(tmp_path):
    plugin = tmp_path / "weird.py"
    plugin.write_text(PLUGIN)
    r = _attnmt("--user-dir", str(plugin), "list", "criterion")
    assert r.returncode == 0, r.stderr
    assert "weird_loss" in r.stdout and "Cross-entropy, but weird (plugin test)." in r.stdout


def test_cli_list_prints_every_kind():
    r = _attnmt("list")
    assert r.returncode == 0, r.stderr
    for kind in registry.KINDS:
        assert f"{kind}:" in r.stdout


def test_cli_broken_plugin_is_one_line_error(tmp_path):
    plugin = tmp_path / "broken.py"
    plugin.write_text("import does_not_exist_anywhere\n")
    r = _attnmt("--user-dir", str(plugin), "list")
    assert r.returncode == 1
    assert "Traceback" not in r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "importing the plugin failed" in lines[0] and "does_not_exist_anywhere" in lines[0]


def test_entry_point_plugin_is_loaded(tmp_path, monkeypatch):
    """A pip-installed package exposing `attnmt.plugins` registers its components without --user-dir."""
    site = tmp_path / "site"
    (site / "weird_pkg").mkdir(parents=True)
    (site / "weird_pkg" / "__init__.py").write_text(PLUGIN)
    dist = site / "weird_pkg-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: weird-pkg\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text("[attnmt.plugins]\nweird = weird_pkg\n")
    monkeypatch.syspath_prepend(str(site))
    registry.load_entry_point_plugins()
    assert registry.get("criterion", "weird_loss").description == "Cross-entropy, but weird (plugin test)."
    del registry.REGISTRIES["criterion"].entries["weird_loss"]
    sys.modules.pop("weird_pkg", None)


def test_click_options_map_fields_to_flags():
    import click
    from click.testing import CliRunner

    from attnmt.config import add_options, given_options

    @dataclass
    class FlagConfig:
        share_all_embeddings: bool = False
        no_scale_embedding: bool = False
        encoder_layers: int = 6

    seen = {}

    @click.command()
    def cmd(**kw):
        seen.update(given_options(kw))

    add_options(cmd, [FlagConfig])
    r = CliRunner().invoke(cmd, ["--no-share-all-embeddings", "--no-scale-embedding", "--encoder-layers", "3"])
    assert r.exit_code == 0, r.output
    assert seen == {"share_all_embeddings": False, "no_scale_embedding": True, "encoder_layers": 3}
    seen.clear()
    assert CliRunner().invoke(cmd, []).exit_code == 0 and seen == {}  # nothing typed, nothing overridden


def test_every_registering_module_is_loaded_by_the_components():
    """A module whose decorators register a built-in component is one of ``COMPONENTS`` or imported by the
    ``__init__`` of one of them (a module left off would silently not register); and importing the components
    in a fresh interpreter registers every built-in name that ``attnmt list`` shows."""
    import ast
    from pathlib import Path

    from attnmt.cli import COMPONENTS

    root = Path(registry.__file__).resolve().parent

    def name_of(path: Path) -> str:
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)

    def registers(tree: ast.AST) -> bool:
        return any(isinstance(n, ast.Call) and getattr(n.func, "id", getattr(n.func, "attr", "")) in
                   ("register", "register_arch") for n in ast.walk(tree))

    def imported_by_init(module: str) -> bool:
        package, _, leaf = module.rpartition(".")
        if package not in COMPONENTS:
            return False
        tree = ast.parse((root.parent / Path(*package.split(".")) / "__init__.py").read_text())
        return any(isinstance(n, ast.ImportFrom) and n.module == package and leaf in [a.name for a in n.names]
                   for n in ast.walk(tree))

    missing = []
    for path in sorted(root.rglob("*.py")):
        module = name_of(path)
        if module == "attnmt.registry" or not registers(ast.parse(path.read_text())):
            continue
        if module not in COMPONENTS and not imported_by_init(module):
            missing.append(module)
    assert missing == []
    code = ("from attnmt.cli import load_components\nfrom attnmt import registry\nload_components()\n"
            "print(sorted((k, n) for k, r in registry.REGISTRIES.items() for n in r.entries))")
    fresh = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert "('search', 'constrained')" in fresh and "('arch', 'transformer_big')" in fresh
    assert "('bpe', 'sentencepiece')" in fresh and "('task', 'translation')" in fresh
