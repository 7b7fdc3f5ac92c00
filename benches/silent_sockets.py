#!/usr/bin/env python3
"""1,000 silent sockets beside real traffic: the real clients' success rate and p99, and the
proxy's file descriptors back to the baseline once the silent ones have been closed.

Loopback only. Usage (after `cargo build --release`):

    python3 benches/silent_sockets.py [target/release/pacegate]

The proxy runs with max_connections = 1024 and header_read_timeout = idle_timeout = 15s. The
same load runs twice, alone and then beside 1,000 sockets that connect and send nothing and 10
more that send only the HTTP/2 preface: 4 clients, 250 requests each, through the proxy to a
local upstream.
"""

import http.client
import http.server
import json
import os
import resource
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time

SILENT = 1000
PREFACE_ONLY = 10
CLIENTS = 4
REQUESTS = 250
HEADER_TIMEOUT = 15


class Quiet(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    # The head and body go out in separate writes: without this, Nagle and delayed ACKs
    # would add 40 ms to every answer.
    disable_nagle_algorithm = True

    def do_GET(self):
        body = b"x" * 1024
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


def fds(pid):
    return len(os.listdir(f"/proc/{pid}/fd"))


def load(host, port, up_port):
    """The real clients' run: (answered, total, seconds, median, p99)."""
    latencies, failures = [], [0]
    lock = threading.Lock()

    def client():
        conn = http.client.HTTPConnection(host, port, timeout=10)
        for _ in range(REQUESTS):
            start = time.perf_counter()
            try:
                conn.request("GET", f"http://127.0.0.1:{up_port}/", headers={"Host": f"127.0.0.1:{up_port}"})
                resp = conn.getresponse()
                resp.read()
                ok = resp.status == 200
            except Exception:
                ok = False
                conn.close()
                conn = http.client.HTTPConnection(host, port, timeout=10)
            elapsed = time.perf_counter() - start
            with lock:
                if ok:
                    latencies.append(elapsed)
                else:
                    failures[0] += 1
        conn.close()

    threads = [threading.Thread(target=client) for _ in range(CLIENTS)]
    started = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    took = time.perf_counter() - started

    latencies.sort()
    p99 = latencies[int(len(latencies) * 0.99) - 1] if latencies else float("nan")
    median = statistics.median(latencies) if latencies else float("nan")
    return len(latencies), CLIENTS * REQUESTS, took, median, p99


def main():
    binary = sys.argv[1] if len(sys.argv) > 1 else "target/release/pacegate"
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, 8192), hard))
    upstream = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Quiet)
    threading.Thread(target=upstream.serve_forever, daemon=True).start()
    up_port = upstream.server_address[1]
    work = tempfile.mkdtemp(prefix="pacegate-silent.")
    config = os.path.join(work, "pacegate.toml")
    with open(config, "w") as f:
        f.write(f"""[proxy]
listen = "127.0.0.1:0"
allow_private_upstreams = true
ports = ["{up_port}"]
[proxy.limits]
max_connections = 1024
header_read_timeout = "{HEADER_TIMEOUT}s"
idle_timeout = "{HEADER_TIMEOUT}s"
[admin]
listen = "127.0.0.1:0"
[tls]
generate_ca = true
[destinations.local]
hosts = ["127.0.0.1"]
rate = 1000000
throttle_statuses = []
lockout_statuses = []
""")
    proc = subprocess.Popen(
        [binary, "serve", "--config", config, "--log-format", "json"],
        stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True,
        preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (8192, 8192)),
    )
    proxy = None
    for line in proc.stderr:
        try:
            event = json.loads(line)
        except ValueError:
            continue
        if event.get("message") == "pacegate listening":
            proxy = event["proxy"]
            break
    threading.Thread(target=lambda: [None for _ in proc.stderr], daemon=True).start()
    host, port = proxy.rsplit(":", 1)
    port = int(port)
    time.sleep(0.5)
    alone = load(host, port, up_port)
    time.sleep(0.5)
    baseline = fds(proc.pid)

    silent = []
    for i in range(SILENT + PREFACE_ONLY):
        s = socket.create_connection((host, port))
        if i >= SILENT:
            s.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n")
        silent.append(s)
    time.sleep(0.5)
    with_silent = fds(proc.pid)

    beside = load(host, port, up_port)
    # The silent sockets are closed by the proxy at the header timeout.
    deadline = time.time() + HEADER_TIMEOUT + 10
    closed = 0
    for s in silent:
        try:
            # An HTTP/2 one gets the proxy's SETTINGS first: read to the end.
            while True:
                s.settimeout(max(0.1, deadline - time.time()))
                if s.recv(4096) == b"":
                    closed += 1
                    break
        except ConnectionResetError:
            # Closed with the client's bytes unread: a reset, closed all the same.
            closed += 1
        except (socket.timeout, OSError):
            pass
        s.close()
    time.sleep(0.5)
    after = fds(proc.pid)
    proc.terminate()
    proc.wait(timeout=30)
    upstream.shutdown()

    print(f"silent sockets: {SILENT} + {PREFACE_ONLY} preface-only, closed by the proxy: {closed}")
    for name, (ok, total, took, median, p99) in [("alone", alone), ("beside them", beside)]:
        print(f"real requests {name}: {ok}/{total} answered 200 in {took:.1f} s; "
              f"median {median * 1e3:.2f} ms, p99 {p99 * 1e3:.2f} ms")
    print(f"proxy file descriptors: baseline {baseline}, with the silent sockets {with_silent}, after {after}")


if __name__ == "__main__":
    main()
