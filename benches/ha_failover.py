#!/usr/bin/env python3
"""A switchover and a failover of the Patroni store under load (docs/benchmarks.md).

Three `pacegate serve` instances share `rate = 20` through the two servers of
`scripts/ha-store up` (a multi-host URL with target_session_attrs=read-write); six clients per
instance keep the ceiling busy. At 5 s the store switches over (`scripts/ha-store switchover`),
at 20 s its leader is killed (`scripts/ha-store failover`). Every arrival at a local upstream
is timed; the report gives the busiest 1 s window, the longest gap without an arrival around
each event, and the refusals the clients saw.

With a number N, it runs the store's return instead: two instances share `rate = 10` with
three clients each, and the leader is killed N times, 30 s apart, each time brought back
(`scripts/ha-store rejoin`) 20 s later so that the next failover has a candidate. The
instances lose the store together and find the new leader within milliseconds of each other,
where the slots each handed out alone meet the shared schedule; the report gives the busiest
1 s window after each failover.

Run (from the repository, after `cargo build` and `scripts/ha-store up`):
    python3 benches/ha_failover.py [N]
"""

import http.server
import os
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request

RATE = 20
INSTANCES = 3
CLIENTS = 6
RUN = 40.0
EVENTS = [(5.0, "switchover"), (20.0, "failover")]
FAILOVERS = int(sys.argv[1]) if len(sys.argv) > 1 else 0
if FAILOVERS:
    RATE, INSTANCES, CLIENTS = 10, 2, 3
    EVENTS = []
    for k in range(FAILOVERS):
        EVENTS += [(5.0 + 30 * k, "failover"), (25.0 + 30 * k, "rejoin")]
    RUN = 5.0 + 30 * FAILOVERS
URL = "postgres://postgres@127.0.0.1:5441,127.0.0.1:5442/postgres?target_session_attrs=read-write"

arrivals = []
lock = threading.Lock()


class Upstream(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        with lock:
            arrivals.append(time.monotonic())
        self.send_response(200)
        self.send_header("Content-Length", "2")
        self.end_headers()
        self.wfile.write(b"ok")

    def log_message(self, *args):
        pass


def main():
    upstream = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Upstream)
    threading.Thread(target=upstream.serve_forever, daemon=True).start()
    port = upstream.server_address[1]
    binary = os.environ.get("PACEGATE", "target/debug/pacegate")
    procs, proxies = [], []
    workdir = tempfile.mkdtemp(prefix="pacegate-ha-bench.")
    for i in range(INSTANCES):
        proxy, admin = 38121 + i, 38131 + i
        os.makedirs(os.path.join(workdir, f"p{i}"))
        config = os.path.join(workdir, f"p{i}", "pacegate.toml")
        with open(config, "w") as f:
            f.write(
                f'[proxy]\nlisten = "127.0.0.1:{proxy}"\nallow_private_upstreams = true\n'
                f'ports = ["1024-65535"]\n[admin]\nlisten = "127.0.0.1:{admin}"\n'
                f'[tls]\ngenerate_ca = true\n'
                f'[store]\nbackend = "postgres"\nurl = "{URL}"\n'
                f'[destinations.local]\nhosts = ["localhost"]\nrate = {RATE}\nmax_wait = "60s"\n'
            )
        log = open(os.path.join(workdir, f"p{i}.log"), "w")
        procs.append(subprocess.Popen([binary, "serve", "--config", config], stderr=log, stdout=log))
        proxies.append(proxy)
    time.sleep(3)
    refusals = []
    start = time.monotonic()

    def client(proxy):
        opener = urllib.request.build_opener(
            urllib.request.ProxyHandler({"http": f"http://127.0.0.1:{proxy}"})
        )
        while time.monotonic() - start < RUN:
            try:
                opener.open(f"http://localhost:{port}/x", timeout=70).read()
            except Exception as e:  # a refusal or a reset: counted, and the client goes on
                with lock:
                    refusals.append((time.monotonic() - start, str(e)[:80]))
                time.sleep(0.1)

    threads = [
        threading.Thread(target=client, args=(p,), daemon=True)
        for p in proxies
        for _ in range(CLIENTS)
    ]
    for t in threads:
        t.start()
    for at, what in EVENTS:
        time.sleep(max(0.0, at - (time.monotonic() - start)))
        out = subprocess.run(["scripts/ha-store", what], capture_output=True, text=True)
        print(f"{time.monotonic() - start:5.1f} s: {what} ({'done' if out.returncode == 0 else out.stderr.strip()})")
    for t in threads:
        t.join()
    for p in procs:
        p.terminate()
    at = sorted(t - start for t in arrivals if t >= start)
    busiest = max(
        (sum(1 for b in at[i:] if b - a < 1.0) for i, a in enumerate(at)), default=0
    )
    print(f"{len(at)} arrivals in {RUN:.0f} s at rate {RATE}: busiest 1 s window {busiest} (ceiling {RATE + 1})")
    ends = [e[0] for e in EVENTS[1:]] + [RUN]
    for (when, what), until in zip(EVENTS, ends):
        near = [a for a in at if when - 1 <= a < until]
        gaps = [(b - a, a) for a, b in zip(near, near[1:])]
        gap, since = max(gaps, default=(0.0, when))
        print(f"{what} at {when:.0f} s: longest gap without an arrival {gap:.2f} s (from {since:.1f} s)")
    for when, what in EVENTS:
        if what == "failover":
            near = [a for a in at if when <= a < when + 20]
            most = max((sum(1 for b in near[i:] if b - a < 1.0) for i, a in enumerate(near)), default=0)
            print(f"failover at {when:.0f} s: busiest 1 s window in the 20 s after {most}")
    print(f"refusals or errors seen by clients: {len(refusals)}")
    for t, e in refusals[:10]:
        print(f"  {t:5.1f} s {e}")
    print("per second:", " ".join(str(sum(1 for a in at if s <= a < s + 1)) for s in range(int(RUN))))
    print(f"instance logs: {workdir}")
    sys.exit(0 if busiest <= RATE + 1 else 1)


if __name__ == "__main__":
    main()
