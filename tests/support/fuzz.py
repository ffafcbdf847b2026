"""Settings of the property-based (hypothesis) suites: bounded to seconds for the fast tier and
reproducible (``derandomize``: the examples are a function of the test, no example database)."""

from __future__ import annotations

from hypothesis import HealthCheck, settings


def fuzz(max_examples: int) -> settings:
    """``@fuzz(n)``: ``n`` examples, no deadline (a loaded CI machine is slow, not wrong), the same
    examples on every run."""
    return settings(
        max_examples=max_examples,
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )
