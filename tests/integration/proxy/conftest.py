import pytest

from proxy.settings import Settings
from tests.support.chat import ScriptedChat
from tests.support.proxyproc import inprocess
from tests.support.searxng import FakeSearxng


@pytest.fixture
def searx():
    with FakeSearxng() as s:
        yield s


@pytest.fixture
def chat():
    with ScriptedChat() as c:
        yield c


@pytest.fixture
def make_proxy(chat, searx):
    """make_proxy(**settings) -> base URL of the proxy app on a real socket (in-process)."""
    servers = []

    def make(**overrides):
        base = dict(BACKEND_URL=chat.url, SEARXNG_URL=searx.url, KEEPALIVE_INTERVAL=0.2,
                    SYSTEM_PROMPT="", MODELS_TTL=0.0)
        base.update(overrides)
        srv = inprocess(Settings.from_env({}, **base)).__enter__()
        servers.append(srv)
        return srv.url

    yield make
    for s in servers:
        s.__exit__(None, None, None)


@pytest.fixture
def proxy(make_proxy):
    return make_proxy()
