"""The settings both services read: one name, one meaning, one declaration
(common.config). Each service's Settings extends `Shared`; under compose both
get the one value `.env` holds."""
from __future__ import annotations

from dataclasses import dataclass

from common.config import setting


@dataclass(frozen=True)
class Shared:
    CONNECT_TIMEOUT: float = setting(
        10.0, "seconds to connect to the next hop (the proxy to the swapper, the swapper to "
              "a backend); reads are unbounded (cold starts take minutes)", min=0.001,
        group="both")
    ALLOWED_HOSTS: str = setting(
        "", "host names the proxy and the swapper answer for besides loopback names "
            "(`localhost`, `*.localhost`) and IP addresses, comma-separated (`gpu1,stack.lan`; "
            "`*`: any); a request for any other `Host` is a 421 (a DNS-rebinding page). Set "
            "it when clients reach the proxy by a name (the fleet's router: `gpu1`). The "
            "swapper always answers for `swapper`, its compose name", group="both")
    # One meaning since issue 34 (it was the proxy's search interval and the
    # swapper's wait interval, under one name with two bounds).
    KEEPALIVE_INTERVAL: float = setting(
        5.0, "seconds between SSE comments while a streamed request waits: in the swapper "
             "for a load, a swap, a drain or a slot (`: loading model …`), in the proxy "
             "for its upstream's first answer or a search round (`: keep-alive`)", min=0.05,
        group="both")
