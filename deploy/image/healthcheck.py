"""Container liveness check that also restarts: Docker marks a container unhealthy but never restarts it
(only Swarm and Kubernetes act on health), so after `KILL_AFTER` failed checks in a row this check stops
the replica itself and the restart policy (`restart: unless-stopped`) brings up a fresh one.

    python deploy/image/healthcheck.py      # exit 0: live; exit 1: not live (Docker counts it)

Stdlib only, one short process per check. It asks the replica's `/health/live` on $PORT (8000 by
default). A failure counts only once the container is older than $HEALTHCHECK_START_PERIOD seconds
(a replica still loading its models is not dead). On the `KILL_AFTER`th failure in a row it sends
SIGTERM to PID 1 (the init process, which passes it on: the replica drains what it can and exits); if
the replica is still there `KILL_AFTER` checks later (a hung event loop ignores SIGTERM), SIGKILL to
every process of the container but PID 1 (the init then exits with its child). That last step needs an
init as PID 1 (compose `init: true`, `docker run --init`): without one the server is PID 1, which no
process of its own namespace can SIGKILL. HEALTHCHECK_KILL_AFTER=0: only report, never stop.
"""

import os
import signal
import sys
import time
import urllib.request
from pathlib import Path

COUNTER = Path(os.environ.get("HEALTHCHECK_STATE", "/tmp/pagedserve-healthcheck-failures"))
KILL_AFTER = int(os.environ.get("HEALTHCHECK_KILL_AFTER", "3"))  # failures in a row; 0: never kill
START_PERIOD_S = float(os.environ.get("HEALTHCHECK_START_PERIOD", "120"))
TIMEOUT_S = float(os.environ.get("HEALTHCHECK_TIMEOUT", "2"))


def is_live(port: str) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health/live", timeout=TIMEOUT_S) as response:
            return response.status == 200
    except OSError:  # refused, timed out, or an HTTPError (a 503 from a dead engine)
        return False


def init_start_ticks() -> int:
    """When PID 1 started, in clock ticks after boot (/proc/1/stat field 22): names this container run."""
    try:
        return int(Path("/proc/1/stat").read_text().rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return 0


def container_age_s(start_ticks: int) -> float:
    try:
        return float(Path("/proc/uptime").read_text().split()[0]) - start_ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return float("inf")


def read_failures(start_ticks: int) -> int:
    """Failures in a row counted for this run of the container: the file survives a restart, the count not."""
    try:
        run, failures = COUNTER.read_text().split()
        return int(failures) if int(run) == start_ticks else 0
    except (OSError, ValueError):
        return 0


def act_on(failures: int) -> None:
    if not KILL_AFTER or failures < KILL_AFTER:
        return
    if failures < 2 * KILL_AFTER:
        os.kill(1, signal.SIGTERM)  # again at each check: harmless while the replica drains
    else:
        os.kill(-1, signal.SIGKILL)  # all but PID 1 and this process (Linux's kill(-1) skips the caller)


def main() -> int:
    start_ticks = init_start_ticks()
    if is_live(os.environ.get("PORT") or "8000"):
        COUNTER.write_text(f"{start_ticks} 0")
        return 0
    if container_age_s(start_ticks) < START_PERIOD_S:
        return 1
    failures = read_failures(start_ticks) + 1
    COUNTER.write_text(f"{start_ticks} {failures}")
    print(f"pagedserve healthcheck: /health/live failed {failures} time(s) in a row at {time.ctime()}")
    act_on(failures)
    return 1


if __name__ == "__main__":
    sys.exit(main())
