"""ar_torchrl.checks: the shared argument checks (light: no torch import)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from ar_torchrl.checks import check_choice, check_clip_epsilon, check_grad_clip, check_number


def test_check_number_bounds_types_and_messages():
    assert check_number("o", "x", 3, ge=1, integer=True) == 3
    assert check_number("o", "x", None, allow_none=True) is None
    with pytest.raises(TypeError, match=r"o: x must be an integer, got True \(bool\)"):
        check_number("o", "x", True, integer=True)
    with pytest.raises(TypeError, match=r"o: x must be a number, got 'abc' \(str\)"):
        check_number("o", "x", "abc")
    with pytest.raises(ValueError, match=r"o: x must be finite, got nan"):
        check_number("o", "x", float("nan"))
    with pytest.raises(ValueError, match=r"o: x must be >= 0 and <= 1, got 1.5"):
        check_number("o", "x", 1.5, ge=0, le=1)
    with pytest.raises(ValueError, match=r"o: x must be > 0, got 0"):
        check_number("o", "x", 0, gt=0)


def test_clip_epsilon_and_grad_clip():
    assert check_clip_epsilon("o", 0.2) == 0.2
    assert check_clip_epsilon("o", (0.2, 1.5)) == (0.2, 1.5)  # a large eps_high is legal
    for bad in (0.0, 1.0, (0.0, 0.2), (0.2, 0.0), (0.1, 0.2, 0.3), "0.2", (True, 0.2)):
        with pytest.raises(ValueError, match="clip_epsilon must be"):
            check_clip_epsilon("o", bad)
    assert check_grad_clip("o", None) is None and check_grad_clip("o", 2) == 2.0
    for bad in (0, -1.0, float("inf")):
        with pytest.raises(ValueError, match="grad_clip must be"):
            check_grad_clip("o", bad)
    with pytest.raises(ValueError, match=r"o: mode='x' is not one of \['a', 'b'\]"):
        check_choice("o", "mode", "x", ["a", "b"])


def test_checks_module_does_not_import_torch():
    code = "import sys, ar_torchrl.checks; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
