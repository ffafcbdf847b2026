"""Loading a benchmark script (``benchmarks/<name>.py``) as a module, the way it runs as a script."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"


def load_benchmark(name: str) -> ModuleType:
    """Execute ``benchmarks/<name>.py`` as module ``name``; its folder goes on ``sys.path`` first,
    as when it runs as a script, so its shared helpers (``_common``, ``_compare``) import."""
    if str(BENCH) not in sys.path:
        sys.path.insert(0, str(BENCH))
    spec = importlib.util.spec_from_file_location(name, BENCH / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
