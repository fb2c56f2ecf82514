"""Render the nginx config for a pool of pagedserve replicas (stdlib only).

    python -m deploy.nginx.render --primary 127.0.0.1:8001 --primary 127.0.0.1:8002 \\
        --backup 127.0.0.1:8003 --listen 127.0.0.1:8080 --prefix /tmp/pagedserve-nginx > nginx.conf
    mkdir -p /tmp/pagedserve-nginx && nginx -p /tmp/pagedserve-nginx -c "$PWD/nginx.conf" -g 'daemon off;'

Tests, the compose file and users all render through `render()`, so they run the same config.
"""

import argparse
import ipaddress
import re
import sys
from dataclasses import dataclass
from pathlib import Path

TEMPLATE = Path(__file__).with_name("nginx.conf.template")
# loopback and the private ranges a Prometheus or an operator scrapes from
DEFAULT_METRICS_ALLOW = ("127.0.0.1", "::1", "10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16")

_PLACEHOLDER = re.compile(r"\{\{(\w+)\}\}")
_HOST_PORT = re.compile(r"^(\[[0-9a-fA-F:.]+\]|[A-Za-z0-9_.-]+):(\d{1,5})$")
_TIME = re.compile(r"^\d+(ms|s|m|h|d)?$")  # nginx time syntax: 300s, 500ms, 5m
_SIZE = re.compile(r"^\d+[kKmMgG]?$")  # nginx size syntax: 8m, 512k
_RATE = re.compile(r"^[1-9]\d*r/[sm]$")  # nginx rate syntax: 50r/s, 600r/m


@dataclass(frozen=True)
class NginxOptions:
    """Everything but the addresses; nginx time (`10s`, `500ms`) and size (`8m`) syntax."""

    max_fails: int = 3  # failures within fail_timeout that take a replica out for fail_timeout
    fail_timeout: str = "10s"
    next_upstream_tries: int = 3  # attempts in all, first included; 0 would mean unlimited
    next_upstream_timeout: str = "15s"  # no replay once this long has passed since the first attempt
    connect_timeout: str = "2s"
    read_timeout: str = "300s"  # between two reads from a replica: above the worst TTFT or token gap
    keepalive: int = 32  # idle upstream connections kept per worker
    worker_processes: int | str = "auto"
    worker_connections: int = 4096
    max_body_size: str = "8m"
    metrics_allow: tuple[str, ...] = DEFAULT_METRICS_ALLOW
    # per client address on /v1/: far above what one client of a 64-96 user load test sends (a few
    # requests per second in all), low enough that one runaway script cannot take the whole pool
    rate_limit: str = "50r/s"  # nginx rate, or "off"
    rate_burst: int = 100  # requests above the rate served at once before nginx answers 429
    max_conns_per_client: int = 128  # requests in flight at once (an SSE stream is one throughout); 0: off

    def __post_init__(self) -> None:
        for name in ("fail_timeout", "next_upstream_timeout", "connect_timeout", "read_timeout"):
            value = getattr(self, name)
            _check(
                bool(_TIME.match(value)), f"{name} must be an nginx time such as 10s or 500ms, got {value!r}"
            )
        _check(
            bool(_SIZE.match(self.max_body_size)),
            f"max_body_size must be an nginx size such as 8m, got {self.max_body_size!r}",
        )
        _check(self.max_fails >= 1, f"max_fails must be at least 1, got {self.max_fails}")
        _check(
            self.next_upstream_tries >= 1,
            f"next_upstream_tries must be at least 1 (0 is unlimited), got {self.next_upstream_tries}",
        )
        _check(self.keepalive >= 1, f"keepalive must be at least 1, got {self.keepalive}")
        _check(
            self.worker_connections >= 16,
            f"worker_connections must be at least 16, got {self.worker_connections}",
        )
        wp = self.worker_processes
        _check(
            wp == "auto" or (isinstance(wp, int) and wp >= 1),
            f"worker_processes must be 'auto' or a positive int, got {wp!r}",
        )
        _check(
            self.rate_limit == "off" or bool(_RATE.match(self.rate_limit)),
            f"rate_limit must be an nginx rate such as 50r/s, or 'off', got {self.rate_limit!r}",
        )
        _check(self.rate_burst >= 0, f"rate_burst must be non-negative, got {self.rate_burst}")
        _check(
            self.max_conns_per_client >= 0,
            f"max_conns_per_client must be non-negative (0 is off), got {self.max_conns_per_client}",
        )
        for net in self.metrics_allow:
            _check(
                net == "all" or _is_network(net),
                f"metrics_allow entries must be addresses, CIDRs or 'all', got {net!r}",
            )


def render(
    primaries: list[str],
    backups: list[str],
    listen: str,
    prefix_dir: str,
    options: NginxOptions | None = None,
) -> str:
    """The nginx.conf text. Addresses are `host:port` (or `unix:/path`); `prefix_dir` must be absolute."""
    _check(bool(primaries), "at least one primary replica is needed, got none")
    for address in [*primaries, *backups]:
        _check_upstream(address)
    _check_listen(listen)
    _check(Path(prefix_dir).is_absolute(), f"prefix_dir must be an absolute path, got {prefix_dir!r}")
    o = options or NginxOptions()
    values = {
        "prefix": prefix_dir.rstrip("/") or "/",
        "listen": listen,
        "servers": _server_lines(primaries, backups, o.max_fails, o.fail_timeout),
        "keepalive": str(o.keepalive),
        "next_upstream_tries": str(o.next_upstream_tries),
        "next_upstream_timeout": o.next_upstream_timeout,
        "connect_timeout": o.connect_timeout,
        "read_timeout": o.read_timeout,
        "worker_processes": str(o.worker_processes),
        "worker_connections": str(o.worker_connections),
        "max_body_size": o.max_body_size,
        "metrics_allow": "\n".join(f"            allow {net};" for net in o.metrics_allow),
        # the zone needs a valid rate even when limit_req is off
        "rate_limit": "1r/s" if o.rate_limit == "off" else o.rate_limit,
        "client_limits": _client_limits(o),
    }
    return _PLACEHOLDER.sub(lambda m: values[m.group(1)], TEMPLATE.read_text())


def _server_lines(primaries: list[str], backups: list[str], max_fails: int, fail_timeout: str) -> str:
    # A backup gets traffic only while every primary is down. With one server and no backup nginx
    # ignores max_fails (it never marks a lone server down); a backup makes the group "not single".
    health = f"max_fails={max_fails} fail_timeout={fail_timeout}"
    lines = [f"        server {a} {health};" for a in primaries]
    lines += [f"        server {a} {health} backup;" for a in backups]
    return "\n".join(lines)


def _client_limits(o: NginxOptions) -> str:
    # nodelay: a burst is served at once, not paced out (pacing would add latency to every burst)
    lines = []
    if o.rate_limit != "off":
        lines.append(f"            limit_req zone=pagedserve_rate burst={o.rate_burst} nodelay;")
    if o.max_conns_per_client:
        lines.append(f"            limit_conn pagedserve_conns {o.max_conns_per_client};")
    return "\n".join(lines) or "            # no per-client limits (rate_limit off, max_conns_per_client 0)"


def _is_network(text: str) -> bool:
    try:
        ipaddress.ip_network(text, strict=False)
    except ValueError:
        return False
    return True


def _check_upstream(address: str) -> None:
    if address.startswith("unix:/"):
        return
    match = _HOST_PORT.match(address)
    _check(
        bool(match) and 1 <= int(match.group(2)) <= 65535,
        f"an upstream must be host:port or unix:/path, got {address!r}",
    )


def _check_listen(listen: str) -> None:
    port = listen.rsplit(":", 1)[-1] if ":" in listen else listen
    _check(
        port.isdigit() and 1 <= int(port) <= 65535 and (listen == port or bool(_HOST_PORT.match(listen))),
        f"listen must be port or host:port, got {listen!r}",
    )


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--primary", action="append", required=True, help="replica host:port (repeat)")
    p.add_argument(
        "--backup", action="append", default=[], help="standby host:port, used when all primaries are down"
    )
    p.add_argument("--listen", default="127.0.0.1:8080", help="[host:]port nginx listens on")
    p.add_argument("--prefix", default="/tmp/pagedserve-nginx", help="directory for pid, logs and temp files")
    p.add_argument("--max-fails", type=int, default=3)
    p.add_argument("--fail-timeout", default="10s")
    p.add_argument("--next-upstream-tries", type=int, default=3)
    p.add_argument("--next-upstream-timeout", default="15s")
    p.add_argument("--connect-timeout", default="2s")
    p.add_argument("--read-timeout", default="300s")
    p.add_argument("--keepalive", type=int, default=32)
    p.add_argument("--worker-processes", default="auto")
    p.add_argument("--max-body-size", default="8m")
    p.add_argument(
        "--metrics-allow", action="append", help="address or CIDR allowed to GET /metrics (repeat)"
    )
    p.add_argument("--rate-limit", default="50r/s", help="requests per client address on /v1/, or off")
    p.add_argument("--rate-burst", type=int, default=100, help="requests above --rate-limit served at once")
    p.add_argument(
        "--max-conns-per-client",
        type=int,
        default=128,
        help="requests in flight per client address on /v1/ (0: no limit)",
    )
    args = p.parse_args(argv)
    workers = args.worker_processes if args.worker_processes == "auto" else int(args.worker_processes)
    try:
        options = NginxOptions(
            max_fails=args.max_fails,
            fail_timeout=args.fail_timeout,
            next_upstream_tries=args.next_upstream_tries,
            next_upstream_timeout=args.next_upstream_timeout,
            connect_timeout=args.connect_timeout,
            read_timeout=args.read_timeout,
            keepalive=args.keepalive,
            worker_processes=workers,
            max_body_size=args.max_body_size,
            metrics_allow=tuple(args.metrics_allow or DEFAULT_METRICS_ALLOW),
            rate_limit=args.rate_limit,
            rate_burst=args.rate_burst,
            max_conns_per_client=args.max_conns_per_client,
        )
        text = render(args.primary, args.backup, args.listen, str(Path(args.prefix).absolute()), options)
    except ValueError as e:
        p.error(str(e))
    sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
