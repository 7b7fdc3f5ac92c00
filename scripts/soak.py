"""The soak run's orchestra (see scripts/soak): upstream, instances, load, restarts, samples."""

import argparse
import collections
import http.server
import json
import os
import random
import shlex
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request

RATE = 20
INSTANCES = 3
WORKERS = 4

arrivals = []  # monotonic seconds of every request that reached the upstream
lock = threading.Lock()


class Upstream(http.server.BaseHTTPRequestHandler):
    """Mixed verdicts: mostly clean, some 429 with Retry-After, some 503, vendor headers."""

    protocol_version = "HTTP/1.1"

    def do_GET(self):
        with lock:
            arrivals.append(time.monotonic())
        roll = random.random()
        headers = {}
        if roll < 0.01:
            status, headers = 429, {"Retry-After": "1"}
        elif roll < 0.02:
            status = 503
        else:
            status = 200
            # A vendor's budget far above the configured rate: read, shared, never the limit.
            headers = {"X-RateLimit-Limit": "1000000", "X-RateLimit-Remaining": "900000",
                       "X-RateLimit-Reset": str(int(time.time()) + 60)}
        body = b"ok"
        self.send_response(status)
        for k, v in headers.items():
            self.send_header(k, v)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


def start_instance(binary, db, port, workdir, i):
    d = os.path.join(workdir, f"i{i}")
    os.makedirs(d)
    cfg = os.path.join(d, "pacegate.toml")
    with open(cfg, "w") as f:
        f.write(f"""
[proxy]
listen = "127.0.0.1:0"
allow_private_upstreams = true
ports = ["1024-65535"]
[admin]
listen = "127.0.0.1:0"
[tls]
generate_ca = true
[store]
backend = "postgres"
url = "{db}"
[destinations.local]
hosts = ["127.0.0.1"]
rate = {RATE}
max_wait = "30s"
retry_throttled = 0
# About 2% of answers are throttles: decaying after 10 clean ones keeps the pace moving.
decay_after = 10
""")
    log = open(os.path.join(d, "log.jsonl"), "w+")
    p = subprocess.Popen([binary, "--log-format", "json", "serve", "--config", cfg],
                         stdout=subprocess.DEVNULL, stderr=log)
    deadline = time.time() + 30
    while time.time() < deadline:
        log.seek(0)
        for line in log:
            try:
                v = json.loads(line)
            except ValueError:
                continue
            if v.get("message") == "pacegate listening":
                return p, v["proxy"], log
        time.sleep(0.1)
    sys.exit(f"instance {i} did not start")


def worker(proxy, upstream_port, stop, answers):
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({"http": f"http://{proxy}"}))
    while not stop.is_set():
        try:
            with opener.open(f"http://127.0.0.1:{upstream_port}/", timeout=60) as r:
                status = r.status
        except urllib.error.HTTPError as e:
            # pacegate's own answers carry Proxy-Status; the upstream's do not.
            status = f"{e.code} pacegate" if e.headers.get("Proxy-Status") else e.code
        except Exception:
            status = "error"
        with lock:
            answers[status] += 1


def busiest(at, lo, hi):
    """The most arrivals within 1 s of one that came in [lo, hi); `at` sorted."""
    best, j = 0, 0
    for i, t in enumerate(at):
        if not lo <= t < hi:
            continue
        j = max(j, i)
        while j < len(at) and at[j] < t + 1.0:
            j += 1
        best = max(best, j - i)
    return best


def sample(pid):
    rss = 0
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                rss = int(line.split()[1]) // 1024
    return rss, len(os.listdir(f"/proc/{pid}/fd"))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--minutes", type=float, default=10)
    ap.add_argument("--db", required=True)
    ap.add_argument("--restart", required=True)
    a = ap.parse_args()
    binary = os.path.abspath("target/release/pacegate")
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Upstream)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    port = server.server_address[1]
    work = tempfile.mkdtemp(prefix="pacegate-soak.")
    instances = [start_instance(binary, a.db, port, work, i) for i in range(INSTANCES)]
    stop = threading.Event()
    answers = collections.Counter()
    for _, proxy, _ in instances:
        for _ in range(WORKERS):
            threading.Thread(target=worker, args=(proxy, port, stop, answers), daemon=True).start()
    start = time.monotonic()
    end = start + a.minutes * 60
    samples, restarts = [], []
    next_restart = start + 120
    while time.monotonic() < end:
        time.sleep(10)
        now = time.monotonic()
        samples.append((now - start, [sample(p.pid) for p, _, _ in instances]))
        if now >= next_restart and now < end - 10:
            subprocess.run(shlex.split(a.restart), check=True, stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL)
            restarts.append(now - start)
            next_restart += 120
    stop.set()
    time.sleep(2)
    for p, _, log in instances:
        p.terminate()
        p.wait(timeout=30)
    with lock:
        at = sorted(t - start for t in arrivals)
    print(f"# Soak: {a.minutes:g} min, {INSTANCES} instances at rate {RATE}, "
          f"PostgreSQL restarted at {', '.join(f'{r:.0f}s' for r in restarts)}\n")
    print("| minute | arrivals | achieved /s | busiest 1 s window |")
    print("|---|---|---|---|")
    worst = 0
    for m in range(int(a.minutes + 0.999)):
        inside = [t for t in at if m * 60 <= t < (m + 1) * 60]
        most = busiest(at, m * 60, (m + 1) * 60)
        worst = max(worst, most)
        print(f"| {m + 1} | {len(inside)} | {len(inside) / 60:.1f} | {most} |")
    print(f"\nBusiest 1 s window over the run: {worst} (ceiling {RATE + 1}). "
          f"Answers: {dict(answers)}.\n")
    print("| t (s) | " + " | ".join(f"instance {i} RSS MB / fds" for i in range(INSTANCES)) + " |")
    print("|---|" + "---|" * INSTANCES)
    for t, s in samples[::3]:
        print(f"| {t:.0f} | " + " | ".join(f"{r} / {n}" for r, n in s) + " |")
    errors = 0
    for _, _, log in instances:
        log.seek(0)
        errors += sum(1 for line in log if '"level":"ERROR"' in line)
    print(f"\nERROR lines over all instances: {errors} (store outages and their recovery).")
    sys.exit(0 if worst <= RATE + 1 else 1)


if __name__ == "__main__":
    main()
