"""ar_torchrl.registry: every registry of the package shares one decorator shape (a dataclass schema
with ``build``), the old factory shape still registers for one release with a warning naming the
new one, and ``_component_`` paths resolve to registered schemas."""

from __future__ import annotations

import dataclasses
import importlib
import pkgutil
import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

import ar_torchrl
from ar_torchrl.registry import Registry, closest, registries, resolve_component

PACKAGE = Path(ar_torchrl.__file__).parent

#: registry -> (its module, its register_<kind> name)
EXPECTED = {
    "ADVANTAGES": ("ar_torchrl.objectives.registry", "register_advantage"),
    "POLICY_LOSSES": ("ar_torchrl.objectives.policy_loss", "register_policy_loss"),
    "TASKS": ("ar_torchrl.data.registry", "register_task"),
    "REWARDS": ("ar_torchrl.rewards.registry", "register_reward"),
    "TOOLS": ("ar_torchrl.tools.registry", "register_tool"),
    "PARSERS": ("ar_torchrl.tools.registry", "register_parser"),
    "MODELS": ("ar_torchrl.models.config", "register_model"),
    "BACKENDS": ("ar_torchrl.backends.registry", "register_backend"),
    "SYNC_METHODS": ("ar_torchrl.weight_sync.registry", "register_sync_method"),
    "ENV_KINDS": ("ar_torchrl.envs.registry", "register_env_kind"),
}


def package_registries() -> dict[str, Registry]:
    """Every module-level ``Registry`` of the package, found by reading the sources (so that a
    registry added later cannot hide from this test) and importing their modules."""
    found = {}
    for path in PACKAGE.rglob("*.py"):
        for name in re.findall(r"^(\w+) = Registry\(", path.read_text(), flags=re.M):
            module = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts)
            found[name] = getattr(importlib.import_module(module), name)
    return found


@pytest.fixture
def scratch():
    """Names registered by a test are removed afterwards (built-ins loaded first)."""
    before = {r: dict(zip(r.names(), r.entries())) for r in registries()}
    yield
    for registry, entries in before.items():
        registry._entries.clear()
        registry._entries.update(entries)


def test_every_registry_shares_one_decorator_shape():
    found = package_registries()
    assert set(found) == set(EXPECTED), sorted(found)
    for name, registry in found.items():
        module, decorator = EXPECTED[name]
        assert isinstance(registry, Registry) and registry in registries()
        register = getattr(importlib.import_module(module), decorator)
        assert register.__func__ is Registry.register and register.__self__ is registry, decorator
        assert registry.decorator == decorator
        assert registry.names(), f"{name} has no built-in entry"
        for entry in registry.entries():
            where = f"{name}[{entry.name!r}]"
            assert entry.factory is None, f"{where} was registered as a factory (the old shape)"
            assert dataclasses.is_dataclass(entry.config), where
            assert callable(entry.config.build), where
            assert entry.help, f"{where} has no help line"


def test_every_builtin_schema_builds_from_its_defaults():
    """Torch-free registries build without arguments; the others are built by their tests."""
    from ar_torchrl.data.registry import TASKS
    from ar_torchrl.rewards.registry import REWARDS
    from ar_torchrl.tools.registry import PARSERS, TOOLS

    assert {n: type(TOOLS.build(n)).__name__ for n in TOOLS.names()} == {"calculator": "Calculator"}
    assert {n: type(PARSERS.build(n)).__name__ for n in PARSERS.names()} == {
        "tag": "TagParser",
        "hermes": "HermesParser",
    }
    assert sorted(type(REWARDS.build(n)).__name__ for n in REWARDS.names()) == [
        "ArithmeticReward",
        "TaskReward",
    ]
    train, held_out = TASKS.build("arithmetic", {"num_rows": 20, "holdout": 4})
    assert (len(train), len(held_out)) == (16, 4)


def test_register_a_schema(scratch):
    shapes = Registry("shape", decorator="register_shape", meta={"sides": 0})

    @shapes.register("square", help="four equal sides", sides=4)
    @dataclasses.dataclass
    class Square:
        side: float = 1.0

        def build(self, *, scale: float) -> float:
            return scale * self.side**2

    assert shapes.build("square", {"side": 3.0}, scale=2.0) == 18.0
    assert (shapes["square"].sides, shapes["square"].help) == (4, "four equal sides")
    assert shapes.entry_for(Square()).name == "square"
    shapes.register("square", help="again", sides=4)(Square)  # the same schema again: fine
    with pytest.raises(ValueError, match=r"shape 'square' is already registered to .*Square"):

        @shapes.register("square")
        @dataclasses.dataclass
        class Other:
            def build(self) -> None: ...

    with pytest.raises(ValueError, match=r"register a @dataclass whose build\(self, \*\*context\)"):
        shapes.register("circle")(type("Circle", (), {"build": lambda self: 0}))
    with pytest.raises(ValueError, match=r"register a @dataclass"):
        shapes.register("triangle")(dataclasses.dataclass(type("Triangle", (), {})))


def test_the_old_factory_shape_warns_with_the_new_one_and_still_works(scratch):
    from ar_torchrl.objectives import make_advantage, needs_critic, register_advantage

    @dataclasses.dataclass
    class Options:
        scale: float = 1.0

    with pytest.warns(DeprecationWarning) as caught:

        @register_advantage("scaled_reward", config=Options, needs_critic=False)
        def make(options, *, critic, gamma):
            return lambda td: options.scale * td

    message = str(caught[0].message)
    assert (
        "registering a factory function as advantage estimator 'scaled_reward' is deprecated"
        in message
    )
    assert (
        "@register_advantage('scaled_reward') on a @dataclass whose build(self, *, critic: bool, gamma: float)"
        in message
    )
    assert make_advantage("scaled_reward", scale=3.0)(2.0) == 6.0 and not needs_critic(
        "scaled_reward"
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        register_advantage("no_options")(lambda *, critic: lambda td: td)  # no schema at all
    assert make_advantage("no_options")(5) == 5


def test_a_sync_method_needs_its_engine():
    from ar_torchrl.backends.registry import BACKENDS
    from ar_torchrl.weight_sync.registry import SYNC_METHODS, register_sync_method, sync_methods

    with pytest.raises(ValueError, match=r"weight sync method 'x': give \['engine'\]"):
        register_sync_method("x", help="no engine")
    assert {e.engine for e in SYNC_METHODS.entries()} <= set(BACKENDS.names())
    assert {n: sync_methods(n) for n in BACKENDS.names()} == {
        "trainside": ["copy", "share"],
        "sglang": ["disk", "tensor", "distributed"],
        "torchrl": ["strategy", "double_buffer"],
    }


def test_registries_list_their_builtins_first_whatever_was_imported_first():
    """The SGLang client imports its config module (which registers ``sglang``) before anything
    asks the backend registry: the built-ins still come in the registry's order."""
    code = (
        "import ar_torchrl.backends.sglang.client\n"
        "from ar_torchrl.backends.registry import BACKENDS\n"
        "from ar_torchrl.weight_sync.registry import SYNC_METHODS\n"
        "print(BACKENDS.names(), SYNC_METHODS.names())"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == (
        "('trainside', 'sglang', 'torchrl') "
        "('copy', 'share', 'disk', 'tensor', 'distributed', 'strategy', 'double_buffer')"
    )


def test_component_paths_resolve_to_registered_schemas():
    from ar_torchrl.data.registry import TASKS
    from ar_torchrl.objectives.registry import ADVANTAGES

    assert resolve_component("ar_torchrl.objectives.config.RLOOConfig", ADVANTAGES)[0] == "rloo"
    with pytest.raises(ValueError, match=r"cannot import 'my_pkg.Task' \(ModuleNotFoundError"):
        resolve_component("my_pkg.Task", TASKS)
    with pytest.raises(ValueError, match=r"RLOOConfig is not a registered task schema"):
        resolve_component("ar_torchrl.objectives.config.RLOOConfig", TASKS)


def test_closest():
    assert closest("lr_typo", ["grpo", "lr", "value_lr"]) == " (did you mean 'lr'?)"
    assert closest("calculater", ["calculator"]) == " (did you mean 'calculator'?)"
    assert closest("zzz", ["lr"]) == ""


def test_every_module_imports():
    """No registry is left behind in a module nobody imports (and no module is broken)."""
    for info in pkgutil.walk_packages([str(PACKAGE)], prefix="ar_torchrl."):
        if ".sglang.schema" in info.name or info.name.endswith("_math_verify_worker"):
            continue
        importlib.import_module(info.name)
    assert {r.kind for r in registries()} >= {
        "advantage estimator",
        "policy loss",
        "task",
        "reward",
        "tool",
        "tool call parser",
        "model",
        "rollout backend",
        "weight sync method",
        "environment kind",
    }
