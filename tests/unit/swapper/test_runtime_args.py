"""What the Docker runtime asks the engine for, without an engine: the client
is made on first use, so building the arguments needs none; the start call
against a stand-in engine API."""
from types import SimpleNamespace

import docker.errors
import docker.types
import pytest

import swapper.runtime as runtime_module
from swapper.registry import ModelSpec
from swapper.runtime import (LABEL_MODEL, LABEL_ROLE, LABEL_STACK, Backend, BackendError,
                             DockerRuntime)
from swapper.settings import Settings


def spec(**kw) -> ModelSpec:
    base = dict(id="m", kind="llamacpp", image="img:1", port=8080, health_path="/health",
                start_timeout=60, slots=1, source="t", args=("-m", "/models/x.gguf"))
    base.update(kw)
    return ModelSpec(**base)


def runtime(**settings) -> DockerRuntime:
    s = Settings(STACK_NAME="st", HOST_DIR="/srv/stack", BACKEND_PUBLISH_PORT=18080,
                 BACKEND_BIND="127.0.0.1", **settings)
    return DockerRuntime(s, SimpleNamespace(models={}))


def test_labels_ports_command_and_no_gpu():
    args = runtime()._create_args(spec(), "st-backend-m")
    assert args["labels"] == {LABEL_STACK: "st", LABEL_MODEL: "m", LABEL_ROLE: "backend"}
    assert args["ports"] == {"8080/tcp": ("127.0.0.1", 18080)}
    assert args["command"] == ["-m", "/models/x.gguf"]
    assert args["name"] == "st-backend-m"
    assert "device_requests" not in args and "network" not in args


def test_gpu_ids_become_one_nvidia_device_request():
    (req,) = runtime()._create_args(spec(gpus=("0", "1")), "n")["device_requests"]
    assert isinstance(req, docker.types.DeviceRequest)
    assert (req.driver, req.device_ids, req.capabilities) == ("nvidia", ["0", "1"], [["gpu"]])


def test_all_gpus_is_count_minus_one():
    (req,) = runtime()._create_args(spec(gpus=("all",)), "n")["device_requests"]
    assert req.count == -1 and not req.device_ids


def test_relative_volumes_resolve_against_host_dir_and_named_volumes_stay():
    rt = runtime()
    vols = rt._create_args(spec(volumes=("./models:/models:ro", "../x:/x", "hf-cache:/root/.cache",
                                         "/abs:/abs")), "n")["volumes"]
    assert vols == ["/srv/stack/models:/models:ro", "/srv/x:/x", "hf-cache:/root/.cache",
                    "/abs:/abs"]


def test_network_shm_ipc_and_healthcheck():
    args = runtime(DOCKER_NETWORK="stacknet")._create_args(
        spec(shm_size="8g", ipc_mode="host", healthcheck=("CMD", "curl", "-f", "x")), "n")
    assert args["network"] == "stacknet"
    assert (args["shm_size"], args["ipc_mode"]) == ("8g", "host")
    assert args["healthcheck"]["test"] == ["CMD", "curl", "-f", "x"]
    assert args["healthcheck"]["start_period"] == 60 * 10**9


def test_no_engine_needed_to_build_a_runtime():
    rt = DockerRuntime(Settings(), SimpleNamespace(models={}))
    assert rt._client is None


class StartAPI:
    """The engine's start call, failing with the given errors first."""

    def __init__(self, *errors):
        self.errors = list(errors)
        self.starts = 0

    def start(self, container_id):
        self.starts += 1
        if self.errors:
            raise self.errors.pop(0)

    def logs(self, container_id, tail=None):
        return b"last line"


def started(api: StartAPI):
    rt = runtime()
    rt._client = SimpleNamespace(api=api)
    rt._start_container(spec(), Backend("m", "cid", "st-backend-m-1", "http://x"))


PORT_BUSY = docker.errors.APIError(
    "driver failed programming external connectivity: Bind for 127.0.0.1:18080 failed: "
    "port is already allocated")


def test_start_waits_for_the_port_of_the_container_stopped_just_before():
    api = StartAPI(PORT_BUSY, PORT_BUSY)
    started(api)
    assert api.starts == 3


def test_a_port_that_stays_taken_is_the_clear_error(monkeypatch):
    monkeypatch.setattr(runtime_module, "PORT_WAIT_SECONDS", 0.2)
    api = StartAPI(*[PORT_BUSY] * 100)
    with pytest.raises(BackendError, match="host port 127.0.0.1:18080 is already in use"):
        started(api)
    assert 2 <= api.starts < 100


def test_other_start_errors_are_not_retried():
    api = StartAPI(docker.errors.APIError("could not select device driver nvidia"))
    with pytest.raises(BackendError, match="last line"):
        started(api)
    assert api.starts == 1


# --------------------------------------------- issue 28: the backends' own key
def test_a_backend_gets_its_own_key_in_its_environment_never_its_command():
    rt = runtime()
    args = rt._create_args(spec(), "n")
    key = args["environment"]["LLAMA_API_KEY"]
    assert len(key) >= 32 and key not in " ".join(args["command"])
    assert runtime()._create_args(spec(), "n")["environment"]["LLAMA_API_KEY"] != key  # per run
    vllm = rt._create_args(spec(kind="vllm", args=("/m",)), "n")["environment"]
    assert vllm["VLLM_API_KEY"] == key
    fixed = runtime(BACKEND_API_KEY="chosen")._create_args(spec(env={"X": "1"}), "n")
    assert fixed["environment"] == {"X": "1", "LLAMA_API_KEY": "chosen"}
    assert "chosen" not in repr(runtime(BACKEND_API_KEY="chosen").settings)


def test_the_key_is_never_shown_and_replaces_the_clients_credentials():
    b = Backend("m", "id", "name", "http://x", "secret-key")
    assert "secret-key" not in repr(b)
    assert runtime_module.auth_headers(b) == {"Authorization": "Bearer secret-key"}
    fwd = runtime_module.with_backend_key(
        {"Authorization": "Bearer the-proxy-key", "X-Api-Key": "the-proxy-key", "A": "b"}, b)
    assert dict(fwd) == {"A": "b", "Authorization": "Bearer secret-key"}
    keyless = Backend("m", "id", "name", "http://x")
    assert runtime_module.auth_headers(keyless) == {}


class _C:
    def __init__(self, env, name="old"):
        self.attrs = {"Config": {"Env": env}}
        self.name = name


def test_adoption_takes_a_backend_only_with_a_key_it_may_use():
    rt = runtime()
    assert not rt._key_fits(spec(), _C(["PATH=/bin"]))                 # an open door
    assert rt._key_fits(spec(), _C(["LLAMA_API_KEY=earlier"]))          # this run's is random
    fixed = runtime(BACKEND_API_KEY="chosen")
    assert not fixed._key_fits(spec(), _C(["LLAMA_API_KEY=earlier"]))
    assert fixed._key_fits(spec(), _C(["LLAMA_API_KEY=chosen"]))
    assert runtime_module.container_key({"Config": {"Env": ["LLAMA_API_KEY=k=1"]}},
                                        "llamacpp") == "k=1"
