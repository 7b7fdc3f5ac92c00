#!/usr/bin/env bash
# Instructions per request, pacegate and the floor under it (examples/hyper_floor.rs): each
# runs under valgrind's callgrind, forwarding plain http at c=32 (wrk) to a local nginx (1 KiB),
# pacegate as shipped (request log on, a destination at rate = 1000000). Counting starts after
# a 3 s warm-up (callgrind_control -z) and covers SECONDS of load. Instructions, unlike CPU
# time, do not move with what else the machine is doing: the way to compare two builds of
# pacegate on a busy machine. They leave out the kernel, and how requests batch under
# callgrind (which runs one thread at a time) moves them by a few percent.
#
#   benches/instructions.sh [PACEGATE_BINARY] [SECONDS]   # target/release/pacegate, 10
#
# The profiles stay in target/instructions/ (callgrind_annotate --inclusive=yes FILE).
#
# C=256 drives 256 connections instead of 32. CACHE_SIM=1 also simulates the first-level
# caches (32 KiB for code, 32 KiB for data, as callgrind's --cache-sim=yes takes them from
# the machine) and prints each side's misses a request: at c=256, where each connection's
# state is cold when its turn comes, they tell builds apart where CPU time on a busy
# machine cannot (docs/benchmarks.md, "Eighth pass"). The simulation runs about twice as slow.
# LL=SIZE,WAYS,LINE with CACHE_SIM=1 sets the last level simulated, whose misses it prints
# too: LL=1048576,8,64 is these machines' 1 MiB L2 a core, the level whose misses c=256 pays
# for (docs/benchmarks.md, "Ninth pass").
# Needs valgrind, wrk, nginx and python3; as root on Debian it installs them. Loopback only.
set -euo pipefail
cd "$(dirname "$0")/.."
bin=${1:-target/release/pacegate}
seconds=${2:-10}
C=${C:-32}
cache=()
[ "${CACHE_SIM:-0}" = 1 ] && cache=(--cache-sim=yes)
[ "${CACHE_SIM:-0}" = 1 ] && [ -n "${LL:-}" ] && cache+=("--LL=$LL")
floor=target/release/examples/hyper_floor

# shellcheck source=benches/need.sh
. benches/need.sh
need instructions valgrind:valgrind wrk:wrk nginx:nginx-light
nginx=$(command -v nginx || echo /usr/sbin/nginx)
[ -x "$floor" ] || cargo build --release --quiet --example hyper_floor
out=target/instructions
mkdir -p "$out"
# shellcheck source=benches/local-setup.sh
. benches/local-setup.sh
cat > "$work/proxy.lua" <<EOF
wrk.path = "http://localhost:$upstream_port/"
wrk.headers["Host"] = "localhost:$upstream_port"
EOF

count() { # name, command...
    local name=$1
    shift
    rm -f "$out/$name".*
    valgrind --tool=callgrind "${cache[@]}" --callgrind-out-file="$out/$name.%p" "$@" 2>"$work/$name.log" &
    local pid=$!
    local ready=
    for _ in $(seq 300); do
        curl -s -o /dev/null -x "http://127.0.0.1:$proxy_port" "http://localhost:$upstream_port/" && ready=1 && break
        sleep 0.2
    done
    [ -n "$ready" ] || { echo "instructions: $name did not answer:" >&2; cat "$work/$name.log" >&2; exit 1; }
    wrk -t 2 -c "$C" -d 3s -s "$work/proxy.lua" "http://127.0.0.1:$proxy_port" >/dev/null
    callgrind_control -z "$pid" >/dev/null 2>&1
    local requests
    requests=$(wrk -t 2 -c "$C" -d "${seconds}s" -s "$work/proxy.lua" "http://127.0.0.1:$proxy_port" |
        awk '/requests in/ {print $1}')
    callgrind_control -d "$pid" >/dev/null 2>&1
    sleep 1
    local file
    file=$(ls -t "$out/$name".* | head -1)
    local total
    total=$(callgrind_annotate "$file" 2>/dev/null | awk '/PROGRAM TOTALS/ {gsub(",", "", $1); print $1}')
    kill "$pid"
    wait "$pid" 2>/dev/null || true
    echo "$name $requests $total" | awk '{printf "%-9s %8d requests  %6.0f instructions a request\n", $1, $2, $3 / $2}'
    if [ ${#cache[@]} -gt 0 ]; then
        # events: Ir Dr Dw I1mr D1mr D1mw ILmr DLmr DLmw
        awk -v n="$requests" -v name="$name" '/^summary:/ {
            printf "%-9s L1 misses a request: code %.0f, data read %.0f, data write %.0f\n", name, $5 / n, $6 / n, $7 / n
            printf "%-9s LL misses a request: code %.0f, data read %.0f, data write %.0f\n", name, $8 / n, $9 / n, $10 / n}' "$file"
    fi
    eval "per_$name=$((total / requests))"
}

per_floor=0
per_pacegate=0
count floor "$floor" "127.0.0.1:$proxy_port"
count pacegate "$bin" serve --config "$work/pacegate.toml"
echo "$per_pacegate $per_floor" |
    awk '{printf "pacegate ÷ floor: %.2f× instructions a request; pacegate'"'"'s own: %d\n", $1 / $2, $1 - $2}'
