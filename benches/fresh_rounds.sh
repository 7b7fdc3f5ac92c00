#!/usr/bin/env bash
# Proxies started afresh for every round, in turn (where benches/alternate.sh starts each
# once): each round prints the futex calls, context switches (all, and the involuntary ones)
# and CPU a request, at C over plain http (absolute-form, 1 KiB from a local nginx). On two
# cores these move together from round to round; see docs/benchmarks.md, "Seventh pass".
#
#   benches/fresh_rounds.sh [KIND...]    # KIND: pacegate (as shipped, rate = 1000000),
#                                        # floor (examples/hyper_floor.rs), served (the floor
#                                        # serving as pacegate serves); all three by default.
#   C=256 ROUNDS=3 SECONDS_EACH=5 PACEGATE_BIN=target/release/pacegate by default.
#
# Needs wrk, nginx and perf (installed as root on Debian) and python3. Loopback only.
set -euo pipefail
cd "$(dirname "$0")/.."
C=${C:-256}
ROUNDS=${ROUNDS:-3}
SECONDS_EACH=${SECONDS_EACH:-5}
kinds=("$@")
[ ${#kinds[@]} -gt 0 ] || kinds=(pacegate floor served)
floor=target/release/examples/hyper_floor
bin=${PACEGATE_BIN:-target/release/pacegate}

# shellcheck source=benches/need.sh
. benches/need.sh
need fresh_rounds wrk:wrk nginx:nginx-light perf:linux-perf
[ -x "$floor" ] || cargo build --release --quiet --example hyper_floor
nginx=$(command -v nginx || echo /usr/sbin/nginx)
# shellcheck source=benches/local-setup.sh
. benches/local-setup.sh
cat > "$work/proxy.lua" <<EOF
wrk.path = "http://localhost:$upstream_port/"
wrk.headers["Host"] = "localhost:$upstream_port"
EOF

switches() { # pid, field: summed over its threads
    cat /proc/"$1"/task/*/status 2>/dev/null | awk -v f="$2" '$1 == f":" {n += $2} END {print n + 0}'
}
for round in $(seq "$ROUNDS"); do
    for kind in "${kinds[@]}"; do
        port=$(free_port)
        case $kind in
            pacegate)
                sed "s/127.0.0.1:$proxy_port/127.0.0.1:$port/" "$work/pacegate.toml" > "$work/p.toml"
                "$bin" serve --config "$work/p.toml" 2>/dev/null &
                ;;
            floor) "$floor" "127.0.0.1:$port" &;;
            served) "$floor" "127.0.0.1:$port" served &;;
            *) echo "fresh_rounds: unknown kind $kind (pacegate, floor, served)" >&2; exit 64;;
        esac
        pid=$!
        for _ in $(seq 100); do
            (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null && break
            sleep 0.1
        done
        # Warmed up: its upstream connections open, its caches filled.
        wrk -t 2 -c "$C" -d 2s -s "$work/proxy.lua" "http://127.0.0.1:$port" >/dev/null
        read -r u0 s0 < <(awk '{print $14, $15}' "/proc/$pid/stat")
        v0=$(switches "$pid" voluntary_ctxt_switches)
        i0=$(switches "$pid" nonvoluntary_ctxt_switches)
        perf stat -e syscalls:sys_enter_futex -p "$pid" -o "$work/perf.txt" &
        perf_pid=$!
        out=$(wrk -t 2 -c "$C" -d "${SECONDS_EACH}s" -s "$work/proxy.lua" "http://127.0.0.1:$port")
        kill -INT "$perf_pid"
        wait "$perf_pid" 2>/dev/null || true
        read -r u1 s1 < <(awk '{print $14, $15}' "/proc/$pid/stat")
        v1=$(switches "$pid" voluntary_ctxt_switches)
        i1=$(switches "$pid" nonvoluntary_ctxt_switches)
        n=$(echo "$out" | awk '/requests in/ {print $1}')
        futex=$(awk '/sys_enter_futex/ {gsub(",", "", $1); print $1}' "$work/perf.txt")
        echo "$n $futex $((v1 - v0)) $((i1 - i0)) $((u1 - u0)) $((s1 - s0)) $(getconf CLK_TCK)" |
            awk -v r="$round" -v c="$C" -v k="$kind" '{
                printf "round %s c=%-4s %-9s futex %.3f  switches %.3f (involuntary %.3f)  %5.1f us CPU/request (user %4.1f)\n",
                    r, c, k, $2 / $1, ($3 + $4) / $1, $4 / $1, ($5 + $6) * 1e6 / $7 / $1, $5 * 1e6 / $7 / $1}'
        kill "$pid"
        wait "$pid" 2>/dev/null || true
    done
done
