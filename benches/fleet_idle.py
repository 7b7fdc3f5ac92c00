#!/usr/bin/env python3
"""What a large idle fleet costs its store (docs/benchmarks.md, "A fleet of sidecars").

N `pacegate serve` instances (default 50) share one PostgreSQL, each with one destination, two
store connections and no traffic: all they do is heartbeat. After they settle, the bench
samples for SECONDS (default 20): the statements the database commits a second (from
pg_stat_database), the CPU of every PostgreSQL process together, and each instance's own CPU.
Then it kills a fifth of the instances with SIGKILL, starts as many new ones (a crash loop
gives each start a new identity), and reports the rows left in pacegate_instances once the
dead ones' leases have run out.

Run (from the repository, after `cargo build --release`), against a server where it may create
a database (scripts/test-postgres starts a throwaway one):
    PACEGATE_BENCH_DATABASE_URL=postgres://USER@127.0.0.1:PORT/postgres \\
        python3 benches/fleet_idle.py [N] [SECONDS]
Loopback only.
"""

import os
import signal
import subprocess
import sys
import tempfile
import time

N = int(sys.argv[1]) if len(sys.argv) > 1 else 50
SECONDS = float(sys.argv[2]) if len(sys.argv) > 2 else 20.0
BINARY = os.environ.get("PACEGATE_BINARY", "target/release/pacegate")
ADMIN = os.environ.get("PACEGATE_BENCH_DATABASE_URL")
TICK = os.sysconf("SC_CLK_TCK")


def psql(url, sql):
    out = subprocess.run(["psql", "-XAtq", url, "-c", sql], check=True, capture_output=True, text=True)
    return out.stdout.strip()


def cpu_seconds(pid):
    """User and system time of `pid` so far, in seconds (0 once it is gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / TICK
    except (FileNotFoundError, ProcessLookupError):
        return 0.0


def postgres_pids():
    out = subprocess.run(["pgrep", "-x", "postgres"], capture_output=True, text=True).stdout
    return [int(p) for p in out.split()]


def start(work, i, url):
    config = os.path.join(work, f"pacegate-{i}.toml")
    with open(config, "w") as f:
        f.write(f"""
[proxy]
listen = "127.0.0.1:0"
[admin]
listen = "127.0.0.1:0"
[tls]
generate_ca = true
ca_cert = "{work}/ca-{i}.pem"
ca_key = "{work}/ca-{i}.key"
[store]
backend = "postgres"
url = "{url}"
connections = 2
[destinations.api]
hosts = ["api.example.com"]
rate = 5
""")
    log = open(os.path.join(work, f"pacegate-{i}.log"), "w")
    return subprocess.Popen([BINARY, "serve", "--config", config], stdout=subprocess.DEVNULL, stderr=log)


def main():
    if not ADMIN:
        sys.exit("set PACEGATE_BENCH_DATABASE_URL to a server where this bench may create a database")
    name = f"pacegate_fleet_idle_{os.getpid()}"
    psql(ADMIN, f"CREATE DATABASE {name}")
    url = ADMIN.rsplit("/", 1)[0] + "/" + name
    work = tempfile.mkdtemp(prefix="pacegate-fleet-")
    procs = []
    try:
        # The first one migrates; the rest find the schema in place.
        procs.append(start(work, 0, url))
        time.sleep(3)
        procs += [start(work, i, url) for i in range(1, N)]
        time.sleep(15)
        live = int(psql(url, "SELECT count(*) FROM pacegate_instances"))
        stat = f"SELECT xact_commit + xact_rollback FROM pg_stat_database WHERE datname = '{name}'"
        pg = postgres_pids()
        before = (int(psql(ADMIN, stat)), sum(cpu_seconds(p) for p in pg), [cpu_seconds(p.pid) for p in procs])
        t0 = time.monotonic()
        time.sleep(SECONDS)
        took = time.monotonic() - t0
        after = (int(psql(ADMIN, stat)), sum(cpu_seconds(p) for p in pg), [cpu_seconds(p.pid) for p in procs])
        # Each psql call above is one transaction of its own.
        statements = (after[0] - before[0] - 1) / took
        store_cpu = 100 * (after[1] - before[1]) / took
        each = sorted(100 * (a - b) / took for a, b in zip(after[2], before[2]))
        print(f"{N} idle instances ({live} rows live), over {took:.0f} s:")
        print(f"  statements committed by the store: {statements:.0f}/s ({statements / N:.1f} per instance)")
        print(f"  the store's CPU: {store_cpu:.1f}% of one core")
        print(f"  each instance's CPU: median {each[len(each) // 2]:.2f}%, max {each[-1]:.2f}% of one core")
        # A crash loop: a fifth killed, as many started anew.
        killed = N // 5
        for p in procs[-killed:]:
            p.send_signal(signal.SIGKILL)
            p.wait()
        procs = procs[:-killed] + [start(work, N + i, url) for i in range(killed)]
        at = time.monotonic()
        while True:
            rows = int(psql(url, "SELECT count(*) FROM pacegate_instances"))
            if rows <= N or time.monotonic() - at > 60:
                break
            time.sleep(1)
        print(f"  {killed} killed and {killed} started: {rows} rows {time.monotonic() - at:.0f} s later")
    finally:
        for p in procs:
            p.send_signal(signal.SIGTERM)
        for p in procs:
            try:
                p.wait(timeout=15)
            except subprocess.TimeoutExpired:
                p.kill()
        time.sleep(1)
        psql(ADMIN, f"DROP DATABASE IF EXISTS {name}")


if __name__ == "__main__":
    main()
