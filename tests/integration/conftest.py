"""Fixtures of the integration tests in more than one folder or module."""
import resource

import pytest


@pytest.fixture
def nofile():
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = 4096           # this process's sockets, and the proxy's (it inherits the limit)
    if soft < want:     # a hard limit below it is raised too (root; else this fails)
        raised = hard if hard == resource.RLIM_INFINITY else max(hard, want)
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, raised))
    yield
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
