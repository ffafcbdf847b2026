"""Loading a benchmark script (``benchmarks/<name>.py``) as a module, the way it runs as a script."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"


def load_benchmark(name: str) -> ModuleType:
    """Execute ``benchmarks/<name>.py`` as module ``name``. Its shared helpers (``_common``,
    ``_compare``) import because pytest puts ``benchmarks/`` on the path (``pythonpath`` in
    pyproject.toml), as running the script does."""
    spec = importlib.util.spec_from_file_location(name, BENCH / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
