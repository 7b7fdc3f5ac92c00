#!/usr/bin/env bash
# Where pacegate's CPU goes per request: a sampled profile (perf, call graphs by DWARF) of one
# pacegate process forwarding plain http at c=32 (wrk) to a local nginx upstream (1 KiB), a
# destination at rate = 1000000 and the request log on, as shipped. Each sample is put in the
# first of the categories below found on its stack from the leaf up, so a category holds its
# own work and what it calls; the figures are microseconds of CPU per request.
#
#   benches/profile.sh [BINARY] [ROUNDS]   # target/release/pacegate (built if missing), 1 round
#
# The CPU per request moves by 15% and more from run to run on a busy 2-core machine; a
# category's share of the samples moves much less, so compare shares, and alternate binaries.
# Needs perf (linux-perf), wrk, nginx and python3; as root on Debian it installs them.
# Loopback only.
set -euo pipefail
cd "$(dirname "$0")/.."
bin=${1:-target/release/pacegate}
rounds=${2:-1}

# shellcheck source=benches/need.sh
. benches/need.sh
need profile perf:linux-perf wrk:wrk nginx:nginx-light
nginx=$(command -v nginx || echo /usr/sbin/nginx)
proxy_limits="max_connections = 20000"
# shellcheck source=benches/local-setup.sh
. benches/local-setup.sh
cat > "$work/proxy.lua" <<EOF
wrk.path = "http://localhost:$upstream_port/"
wrk.headers["Host"] = "localhost:$upstream_port"
EOF

# Categories, most specific first: pacegate's own steps, then the stack under them.
cat > "$work/categories.py" <<'EOF'
import collections, sys
CATEGORIES = [
    ("request log", "tracing_core::event::Event::dispatch"),
    ("metrics", "prometheus::"),
    ("upstream send (hyper client)", "pacegate::upstream::Upstream::send"),
    ("request rewrite", "forward::prepare"),
    ("hop-by-hop strip", "strip_hop_by_hop"),
    ("pacing: admission", "Pacer>::enter"),
    ("pacing: reading", "Pacer::read"),
    ("pacing: verdict", "Pacer::observe"),
    ("routing", "Proxy::target_of"),
    ("connection ahead", "Upstream::expect"),
    ("request copy", "Outgoing::copy"),
    ("class", "Proxy::class_of"),
    ("rest of the request path", "Proxy::handle"),
    ("upstream socket", "warm::Counted"),
    ("client connection (hyper server)", "pacegate::server::serve"),
]
OWN = {n for n, _ in CATEGORIES[:13]} - {"upstream send (hyper client)"}
samples, requests = sys.argv[1], float(sys.argv[2])
counts, stack = collections.Counter(), []
def flush():
    if not stack:
        return
    kernel = stack[0][0].startswith("ffff")
    counts["(all: kernel)" if kernel else "(all: user)"] += 1
    for _, frame in stack:
        for name, pattern in CATEGORIES:
            if pattern in frame:
                counts[name] += 1
                return
    counts["other (runtime, allocator, ...)"] += 1
for line in open(samples, errors="replace"):
    if not line.startswith(("\t", " ")):
        flush(); stack.clear(); continue
    parts = line.strip().split(" ", 1)
    if len(parts) == 2:
        stack.append(parts)
flush()
us = lambda n: n * 1000.0 / requests  # samples are 1 ms of CPU at 1000 Hz
total = counts["(all: kernel)"] + counts["(all: user)"]
print(f"  {us(total):6.2f} us CPU per request ({us(counts['(all: user)']):.2f} user, {us(counts['(all: kernel)']):.2f} kernel)")
for name, _ in CATEGORIES + [("other (runtime, allocator, ...)", "")]:
    print(f"  {us(counts[name]):6.2f} us  {100.0 * counts[name] / total:5.1f}%  {name}")
own = sum(counts[n] for n in OWN)
print(f"  {us(own):6.2f} us  {100.0 * own / total:5.1f}%  pacegate's own steps (the first rows but the client send)")
EOF

for round in $(seq "$rounds"); do
    "$bin" serve --config "$work/pacegate.toml" 2>"$work/pacegate.log" &
    pid=$!
    ready=
    for _ in $(seq 100); do
        curl -s -o /dev/null -x "http://127.0.0.1:$proxy_port" "http://localhost:$upstream_port/" && ready=1 && break
        sleep 0.1
    done
    [ -n "$ready" ] || { echo "profile: pacegate did not answer:" >&2; cat "$work/pacegate.log" >&2; exit 1; }
    wrk -t 2 -c 32 -d 1s -s "$work/proxy.lua" "http://127.0.0.1:$proxy_port" >/dev/null
    perf record -F 1000 --call-graph dwarf,16384 -p "$pid" -o "$work/perf.data" -- sleep 3 \
        >/dev/null 2>&1 &
    rec=$!
    rps=$(wrk -t 2 -c 32 -d 3s -s "$work/proxy.lua" "http://127.0.0.1:$proxy_port" |
        awk '/Requests\/sec/ {print $2}')
    wait "$rec" || true
    kill "$pid"; wait "$pid" 2>/dev/null || true
    perf script -i "$work/perf.data" -F comm,tid,ip,sym 2>/dev/null > "$work/samples.txt"
    echo "round $round: $rps req/s at c=32"
    python3 "$work/categories.py" "$work/samples.txt" "$(python3 -c "print($rps * 3)")"
done
