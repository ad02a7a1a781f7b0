"""The real swapper per module on the real engine (tests/support/swapper_fixtures.py)."""
from tests.support.swapper_fixtures import (  # noqa: F401 (fixtures)
    _unload_between_tests, docker_client, invariant, swapper)
