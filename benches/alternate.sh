#!/usr/bin/env bash
# CPU a request of builds of pacegate beside the floor (examples/hyper_floor.rs), alternated:
# each build and the floor start once, on their own ports, and wrk drives them in turn (plain
# http, absolute-form, 1 KiB from a local nginx, pacegate as shipped at rate = 1000000), ROUNDS
# times. A round prints, for each, the CPU it spent a request (user + system, and each) and its
# requests a second, then each build ÷ the floor. On a machine whose load moves from minute
# to minute, builds measured in the same minutes can be compared where separate runs cannot;
# and a round whose floor is far from the others' is a round to leave out.
#
#   benches/alternate.sh BINARY...          # C=256 ROUNDS=3 SECONDS_EACH=5 by default
#
# PIN=1 runs the proxies on CPU 0 and wrk and the upstream on CPU 1 (as benches/peers.sh
# does): the figures move less from round to round, and leave out what a second core costs.
#
# CONTROL=1 adds a second floor process, measured as a build is ("control ÷ floor"): how far
# two runs of the same program move apart here, against which a build's spread is read
# (docs/benchmarks.md, "Eleventh pass"). CONTROL=PATH runs that floor instead, started as
# `PATH ADDR` (examples/own_pool_floor.rs: the floor with a pool of its own).
#
# DELAY=MS has each connection wait MS milliseconds between its requests (wrk's `delay`): the
# proxies then serve the same requests a second, neither of them flat out, where without it
# each serves as many as it can.
#
# Needs wrk and nginx (installed as root on Debian) and python3. Loopback only.
set -euo pipefail
cd "$(dirname "$0")/.."
C=${C:-256}
ROUNDS=${ROUNDS:-3}
SECONDS_EACH=${SECONDS_EACH:-5}
[ $# -gt 0 ] || { echo "usage: benches/alternate.sh BINARY..." >&2; exit 64; }
floor=target/release/examples/hyper_floor

# shellcheck source=benches/need.sh
. benches/need.sh
need alternate wrk:wrk nginx:nginx-light
[ -x "$floor" ] || cargo build --release --quiet --example hyper_floor
on_proxy=() on_load=()
if [ "${PIN:-0}" = 1 ]; then on_proxy=(taskset -c 0) on_load=(taskset -c 1); fi
nginx=$(command -v nginx || echo /usr/sbin/nginx)
bin=$1
# shellcheck source=benches/local-setup.sh
. benches/local-setup.sh
cat > "$work/proxy.lua" <<EOF
wrk.path = "http://localhost:$upstream_port/"
wrk.headers["Host"] = "localhost:$upstream_port"
EOF
if [ -n "${DELAY:-}" ]; then
    echo "function delay() return $DELAY end" >> "$work/proxy.lua"
fi

names=() ports=() pids=()
start() { # name, port, command...
    local name=$1 port=$2
    shift 2
    "${on_proxy[@]}" "$@" 2>/dev/null &
    pids+=($!) names+=("$name") ports+=("$port")
    for _ in $(seq 100); do
        (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null && return
        sleep 0.1
    done
    echo "alternate: $name did not listen on $port" >&2
    exit 1
}
i=0
for b in "$@"; do
    port=$(free_port)
    sed "s/127.0.0.1:$proxy_port/127.0.0.1:$port/" "$work/pacegate.toml" > "$work/p$i.toml"
    start "$i:$(basename "$b")" "$port" "$b" serve --config "$work/p$i.toml"
    i=$((i + 1))
done
case "${CONTROL:-0}" in
    0) ;;
    1) port=$(free_port) && start control "$port" "$floor" "127.0.0.1:$port" ;;
    *) port=$(free_port) && start "control:$(basename "$CONTROL")" "$port" "$CONTROL" "127.0.0.1:$port" ;;
esac
port=$(free_port)
start floor "$port" "$floor" "127.0.0.1:$port"
# The upstream (nginx, its worker forked by now) beside the load.
if [ "${PIN:-0}" = 1 ]; then
    for p in $(pgrep -f "$work/nginx.conf"); do taskset -pc 1 "$p" >/dev/null; done
fi
# Each warmed up first: its upstream connections open, its caches fill.
for port in "${ports[@]}"; do
    "${on_load[@]}" wrk -t 2 -c "$C" -d 1s -s "$work/proxy.lua" "http://127.0.0.1:$port" >/dev/null
done

ticks=$(getconf CLK_TCK)
times() { awk '{print $14, $15}' "/proc/$1/stat"; }
for round in $(seq "$ROUNDS"); do
    declare -A us=()
    for j in "${!names[@]}"; do
        read -r u0 s0 < <(times "${pids[$j]}")
        out=$("${on_load[@]}" wrk -t 2 -c "$C" -d "${SECONDS_EACH}s" -s "$work/proxy.lua" "http://127.0.0.1:${ports[$j]}")
        read -r u1 s1 < <(times "${pids[$j]}")
        n=$(echo "$out" | awk '/requests in/ {print $1}')
        rps=$(echo "$out" | awk '/Requests\/sec/ {printf "%d", $2}')
        us[$j]=$(echo "$u0 $u1 $s0 $s1 $n $ticks" | awk '{printf "%.1f", (($2-$1)+($4-$3))*1e6/$6/$5}')
        echo "$u0 $u1 $s0 $s1 $n $ticks" | awk -v r="$round" -v c="$C" -v name="${names[$j]}" -v rps="$rps" \
            '{printf "round %s c=%-4s %-24s %5.1f us CPU/request (user %4.1f, system %4.1f)  %6d req/s\n", r, c, name, (($2-$1)+($4-$3))*1e6/$6/$5, ($2-$1)*1e6/$6/$5, ($4-$3)*1e6/$6/$5, rps}'
    done
    last=$((${#names[@]} - 1))
    for j in $(seq 0 $((last - 1))); do
        echo "${us[$j]} ${us[$last]}" | awk -v r="$round" -v name="${names[$j]}" \
            '$2 > 0 {printf "round %s %-24s ÷ floor %.2f×\n", r, name, $1 / $2}'
    done
done
