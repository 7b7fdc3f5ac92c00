#!/usr/bin/env bash
# Memory of one pacegate process: its RSS idle after start, then with N idle keep-alive client
# connections open (each has sent one plain-http GET through pacegate and waits). Prints
# the RSS at each step and the bytes per connection. Loopback only. Needs python3, and
# N + 1000 open files per process.
#
#   benches/idle_memory.sh [CONNECTIONS] [BINARY]   (default 10000, target/release/pacegate)
set -euo pipefail
cd "$(dirname "$0")/.."
n=${1:-10000}
bin=${2:-target/release/pacegate}
need=$((n + 1000))
[ "$(ulimit -n)" -ge "$need" ] || ulimit -n "$need" || { echo "needs $need open files: raise the hard limit (ulimit -Hn)" >&2; exit 1; }
proxy_limits="max_connections = $((n + 100))"
# shellcheck source=benches/local-setup.sh
. benches/local-setup.sh
rss() { awk '/^VmRSS/ { print $2 }' "/proc/$1/status"; }
"$bin" serve --config "$work/pacegate.toml" 2>"$work/log" &
pacegate=$!
sleep 2
idle=$(rss "$pacegate")
echo "idle after start: $((idle / 1024)) MiB RSS"
python3 - "$n" "$proxy_port" "$upstream_port" "$pacegate" <<'PY'
import socket, sys, time
n, proxy, upstream, pid = (int(a) for a in sys.argv[1:])
def rss():
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmRSS"):
            return int(line.split()[1])
request = f"GET http://localhost:{upstream}/ HTTP/1.1\r\nHost: localhost:{upstream}\r\n\r\n".encode()
before = rss()
held = []
for i in range(n):
    s = socket.create_connection(("127.0.0.1", proxy))
    s.sendall(request)
    got = b""
    while not got.endswith(b"x" * 1024):
        chunk = s.recv(4096)
        assert chunk, "closed"
        got += chunk
    assert got.startswith(b"HTTP/1.1 200"), got[:40]
    held.append(s)
    if (i + 1) % 1000 == 0:
        print(f"{i + 1} open, {rss() // 1024} MiB RSS", flush=True)
time.sleep(5)
open_now = sum(1 for s in held if s.fileno() != -1)
after = rss()
print(f"{n} idle keep-alive connections: {after // 1024} MiB RSS, "
      f"{(after - before) * 1024 // n} bytes per connection (RSS {before // 1024} MiB before them)")
time.sleep(10)
later = rss()
print(f"10 s later: {later // 1024} MiB RSS")
PY
