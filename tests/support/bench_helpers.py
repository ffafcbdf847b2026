"""Loading a benchmark script (``benchmarks/<name>.py`` or ``benchmarks/experiments/<name>.py``) as a
module, the way it runs as a script."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"


def benchmark_path(name: str) -> Path:
    """The script ``name``: a speed benchmark (``benchmarks/``) or an experiment
    (``benchmarks/experiments/``)."""
    for folder in (BENCH, BENCH / "experiments"):
        if (folder / f"{name}.py").is_file():
            return folder / f"{name}.py"
    raise FileNotFoundError(f"no benchmark {name!r} under {BENCH} or {BENCH / 'experiments'}")


def load_benchmark(name: str) -> ModuleType:
    """Execute the script ``name`` as module ``name``. Its shared helpers (``_common``, ``_compare``)
    import because pytest puts ``benchmarks/`` and ``benchmarks/experiments/`` on the path
    (``pythonpath`` in pyproject.toml), as running the script does."""
    spec = importlib.util.spec_from_file_location(name, benchmark_path(name))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
