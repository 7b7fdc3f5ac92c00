#!/usr/bin/env bash
# System calls per request of one pacegate process, counted with `strace -c -f` while 8
# keep-alive clients send 4,000 plain-http GETs (1 KiB answers) through it to a local
# upstream. Loopback only. Needs strace and python3.
#
#   benches/syscalls.sh [BINARY]      (default: target/release/pacegate, built if missing)
set -euo pipefail
cd "$(dirname "$0")/.."
bin=${1:-target/release/pacegate}
# shellcheck source=benches/local-setup.sh
. benches/local-setup.sh
cat > "$work/load.py" <<'PY'
import http.client, sys, threading
total, clients, proxy, upstream = (int(a) for a in sys.argv[1:])
def worker():
    c = http.client.HTTPConnection("127.0.0.1", proxy)
    for _ in range(total // clients):
        c.request("GET", f"http://localhost:{upstream}/", headers={"Host": f"localhost:{upstream}"})
        r = c.getresponse(); r.read()
        assert r.status == 200, r.status
threads = [threading.Thread(target=worker) for _ in range(clients)]
[t.start() for t in threads]; [t.join() for t in threads]
PY
"$bin" serve --config "$work/pacegate.toml" 2>"$work/log" &
pacegate=$!
sleep 1
python3 "$work/load.py" 400 8 "$proxy_port" "$upstream_port"   # warm-up, not counted
strace -f -c -o "$work/counts" -p "$pacegate" &
tracer=$!
sleep 1
python3 "$work/load.py" 4000 8 "$proxy_port" "$upstream_port"
kill -INT "$tracer"; wait "$tracer" 2>/dev/null || true
awk 'NR > 2 && $NF != "------" && NF >= 5 { printf "%-14s %6d calls  %5.2f per request\n", $NF, $4, $4 / 4000 }' "$work/counts" | sort -k2 -n -r | head -12
