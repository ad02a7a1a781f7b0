# The swapper integration fixtures: a real swapper per module on the real engine.
from tests.integration.swapper.conftest import (  # noqa: F401
    _unload_between_tests, docker_client, invariant, swapper)
