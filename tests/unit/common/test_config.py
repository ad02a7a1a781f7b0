"""The one settings loader (common.config) through both services' Settings."""
import pytest

from common.config import ConfigError
from proxy.settings import Settings as ProxySettings
from swapper.settings import Settings as SwapperSettings


def test_proxy_types_and_defaults():
    s = ProxySettings.from_env({"WEB_SEARCH": "0", "PROXY_PORT": "1234", "SEARXNG_TIMEOUT": "2.5",
                                "BACKEND_URL": "http://x:1/", "INJECT_SYSTEM": " Off ",
                                "SEARCH_SOURCES": "yes", "MAX_SEARCH_ITER": ""})
    assert s.WEB_SEARCH is False and s.INJECT_SYSTEM is False and s.SEARCH_SOURCES is True
    assert s.PROXY_PORT == 1234 and s.SEARXNG_TIMEOUT == 2.5 and s.MAX_SEARCH_ITER == 10  # empty: default
    assert s.BACKEND_URL == "http://x:1"


def test_swapper_reads_its_variable_names():
    s = SwapperSettings.from_env({"SWAPPER_PORT": "9100", "PULL_IMAGES": "false",
                                  "DOCKER_NETWORK": "", "DEFAULT_MODEL": "m", "CRASH_BACKOFF": "0.5",
                                  "OTHER": "x"})
    assert s.SWAPPER_PORT == 9100 and s.PULL_IMAGES is False and s.CRASH_BACKOFF == 0.5
    assert s.DOCKER_NETWORK is None and s.DEFAULT_MODEL == "m"
    assert s.env["OTHER"] == "x"          # backends/ interpolates from the whole environment


@pytest.mark.parametrize("env, named", [
    ({"PROXY_PORT": "abc"}, "PROXY_PORT must be an integer, got 'abc'"),
    ({"PROXY_PORT": "70000"}, "PROXY_PORT must be at most 65535"),
    ({"PROXY_WORKERS": "0"}, "PROXY_WORKERS must be at least 1"),
    ({"SEARXNG_TIMEOUT": "soon"}, "SEARXNG_TIMEOUT must be a number"),
    ({"SEARXNG_TIMEOUT": "inf"}, "SEARXNG_TIMEOUT must be a number"),
    ({"LOG_LEVEL": "chatty"}, "LOG_LEVEL must be one of"),
    ({"BACKEND_URL": "swapper:9000"}, "BACKEND_URL must be an http:// or https:// URL"),
    # The old loader took any word but 0/false/no/off for "on".
    ({"WEB_SEARCH": "maybe"}, "WEB_SEARCH must be a boolean"),
    ({"WEB_SEARCH": "disabled"}, "WEB_SEARCH must be a boolean"),
    ({"INJECT_SYSTEM": "2"}, "INJECT_SYSTEM must be a boolean"),
])
def test_proxy_bad_values_name_the_variable(env, named):
    with pytest.raises(ConfigError, match=named):
        ProxySettings.from_env(env)


@pytest.mark.parametrize("env, named", [
    ({"SWAPPER_PORT": "abc"}, "SWAPPER_PORT must be an integer"),
    ({"PULL_IMAGES": "maybe"}, "PULL_IMAGES must be a boolean"),
    ({"MAX_QUEUE": "0"}, "MAX_QUEUE must be at least 1"),
    ({"WATCH_INTERVAL": "x"}, "WATCH_INTERVAL must be a number"),
])
def test_swapper_bad_values_name_the_variable(env, named):
    with pytest.raises(ConfigError, match=named):
        SwapperSettings.from_env(env)


def test_overrides_are_typed_values_and_unknown_ones_fail():
    assert ProxySettings.from_env({"MAX_SEARCH_ITER": "3"}, MAX_SEARCH_ITER=5).MAX_SEARCH_ITER == 5
    with pytest.raises(TypeError, match="NOPE"):
        ProxySettings.from_env({}, NOPE=1)
