"""Hostile-input and reliability tests. Hypothesis runs derandomized and without
an example database, so CI sees the same examples on every run."""
from hypothesis import HealthCheck, settings

settings.register_profile(
    "ci", derandomize=True, database=None, deadline=None, print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
settings.load_profile("ci")

# The swapper integration fixtures: a real swapper per module on the real engine.
from tests.support.swapper_fixtures import (  # noqa: F401
    _unload_between_tests, docker_client, invariant, swapper)
