"""swapper/hostdir.py: where `./` of backends/ is on the host (the e2e test runs it for
real: compose started from another folder)."""
from __future__ import annotations

from types import SimpleNamespace

from swapper import hostdir
from swapper.settings import Settings

CID = "4f" * 32
MOUNTINFO = (
    "1021 1000 0:52 / / rw,relatime - overlay overlay rw,lowerdir=/x\n"
    f"1030 1021 254:1 /var/lib/docker/containers/{CID}/resolv.conf /etc/resolv.conf rw - ext4 /dev/vda1 rw\n"
    f"1031 1021 254:1 /var/lib/docker/containers/{CID}/hostname /etc/hostname rw - ext4 /dev/vda1 rw\n"
)


class FakeApi:
    def __init__(self, attrs=None, error=None):
        self.attrs, self.error, self.asked = attrs, error, []

    def inspect_container(self, cid):
        self.asked.append(cid)
        if self.error:
            raise self.error
        return self.attrs


def client(**kw):
    """What makes the engine's client (the runtime's lazy `client` property); its
    `api` is the fake engine the tests read."""
    made = SimpleNamespace(api=FakeApi(**kw))

    def make():
        return made
    make.api = made.api
    return make


def settings(**env):
    return Settings.from_env({"BACKENDS_DIR": "/app/backends", **env})


def test_own_container_id_from_mountinfo(tmp_path):
    f = tmp_path / "mountinfo"
    f.write_text(MOUNTINFO)
    assert hostdir.own_container_id(str(f)) == CID
    f.write_text(MOUNTINFO.splitlines()[0] + "\n")
    assert hostdir.own_container_id(str(f)) is None
    assert hostdir.own_container_id(str(tmp_path / "none")) is None


def test_the_compose_label_wins_then_the_registry_mount():
    attrs = {"Config": {"Labels": {hostdir.COMPOSE_DIR_LABEL: "/srv/stack"}},
             "Mounts": [{"Type": "bind", "Source": "/elsewhere/backends",
                         "Destination": "/app/backends"}]}
    c = client(attrs=attrs)
    assert hostdir.host_dir(settings(), c, CID) == "/srv/stack"
    assert c.api.asked == [CID]
    attrs["Config"]["Labels"] = {}
    assert hostdir.host_dir(settings(), c, CID) == "/elsewhere"


def test_host_dir_set_is_used_as_is_and_empty_means_derived():
    c = client(attrs={"Config": {"Labels": {hostdir.COMPOSE_DIR_LABEL: "/srv/stack"}}})
    assert hostdir.host_dir(settings(HOST_DIR="/mine"), c, CID) == "/mine"
    assert c.api.asked == []
    assert hostdir.host_dir(settings(HOST_DIR=""), c, CID) == "/srv/stack"


def test_outside_a_container_or_unreadable_falls_back_to_the_default():
    s = settings(HOST_DIR="")
    default = Settings().HOST_DIR
    assert hostdir.host_dir(s, client(error=RuntimeError("no such container")), CID) == default
    assert hostdir.host_dir(s, client(attrs={}), CID) == default
    assert hostdir.host_dir(settings(HOST_DIR="/x"), client()) == "/x"
