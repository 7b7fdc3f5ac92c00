#!/usr/bin/env bash
# pacegate beside its peers, in one run on one machine: the same nginx upstream (1 KiB) reached
# directly, through nginx as a reverse proxy (one worker, keepalive to the upstream), through
# squid as a forward proxy (no cache, no access log, one worker) and through pacegate (as
# shipped: request log on, a destination at rate = 1000000). Each is driven in turn, at
# c=1, 32 and 256 (CONCURRENCY), alternating, ROUNDS times; for each it prints req/s, p50 and
# p99 latency, and the CPU the proxy spent per request (user + system, from /proc, helpers
# included; for "direct", the upstream's own). pacegate and its floor swap places every other
# round, and the run ends with pacegate ÷ floor over all its rounds (CPU and requests summed):
# one round's figure moves with what the machine does in its five seconds (docs/benchmarks.md,
# "Eleventh pass").
#
# PROTOCOLS="http https" by default:
# - http: wrk, the request line in absolute form as a forward proxy receives it.
# - https: examples/connect_load.rs (wrk cannot CONNECT), keep-alive connections to an nginx
#   upstream over TLS (a certificate for localhost from a CA made here). squid bumps the
#   tunnel (ssl-bump, leaves minted by security_file_certgen from its own local CA), pacegate
#   intercepts it (leaves minted from its CA); nginx terminates TLS as a reverse proxy and
#   opens TLS to the upstream, keepalive.
# With STRACE=1 it also counts system calls per request of each proxy over http (strace -c -f
# over a short load at c=32; strace slows what it traces).
#
# nginx and squid run one worker process each; pacegate runs as shipped, one thread per core
# (PACEGATE_THREADS=N sets `[proxy] threads = N`). Over http, "hyper" is the floor under
# pacegate: examples/hyper_floor.rs, a forward proxy of the same hyper server, hyper-util client
# and tokio runtime that does nothing else; what pacegate spends above it is its own, and each
# round prints pacegate ÷ floor, CPU per request. Over https, "floor-s" is the interception
# floor (examples/intercept_floor.rs: CONNECT, a leaf from pacegate's CA cached per host, the
# same hyper server inside the tunnel and hyper-rustls client upstream), and each round prints
# pacegate-s ÷ floor-s.
#
# PIN=1 runs each proxy on CPU 0 and wrk, connect_load and the nginx upstream on CPU 1: the
# proxies then no longer compete with the load for a core, and their CPU per request moves far
# less from run to run (it leaves out what a second core costs in contention).
#
#   benches/peers.sh                 # ROUNDS=2 SECONDS_EACH=5 by default; PACEGATE_BIN=path
#
# Installs nginx-light, wrk, squid-openssl and openssl when run as root on Debian, else says
# what it needs. Loopback only.
set -euo pipefail
cd "$(dirname "$0")/.."
. benches/peers_lib.sh
ROUNDS=${ROUNDS:-2}
SECONDS_EACH=${SECONDS_EACH:-5}
CONCURRENCY=${CONCURRENCY:-1 32 256}
PROTOCOLS=${PROTOCOLS:-http https}
PACEGATE_THREADS=${PACEGATE_THREADS:-cores}
threads_key=""
[ "$PACEGATE_THREADS" = cores ] || threads_key="threads = $PACEGATE_THREADS"
bin=${PACEGATE_BIN:-target/release/pacegate}
load=target/release/examples/connect_load
floor=target/release/examples/hyper_floor
ifloor=target/release/examples/intercept_floor

need=()
command -v nginx >/dev/null 2>&1 || [ -x /usr/sbin/nginx ] || need+=(nginx-light)
command -v wrk >/dev/null 2>&1 || need+=(wrk)
[ -x /usr/sbin/squid ] || need+=(squid-openssl)
command -v openssl >/dev/null 2>&1 || need+=(openssl)
if [ ${#need[@]} -gt 0 ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    apt-get update -qq >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need[@]}" >/dev/null
  else
    echo "benches/peers.sh needs: ${need[*]} (Debian: sudo apt-get install ${need[*]})" >&2
    exit 1
  fi
fi
NGINX=$(command -v nginx || echo /usr/sbin/nginx)
[ -x "$bin" ] || cargo build --release --quiet
[ -x "$load" ] || cargo build --release --quiet --example connect_load
[ -x "$floor" ] || cargo build --release --quiet --example hyper_floor
[ -x "$ifloor" ] || cargo build --release --quiet --example intercept_floor
# With PIN=1: the proxies on CPU 0, the load and the upstream on CPU 1.
on_proxy=(); on_load=()
if [ "${PIN:-0}" = 1 ]; then on_proxy=(taskset -c 0); on_load=(taskset -c 1); fi

work=$(mktemp -d)
chmod 755 "$work"
pids=()
cleanup() {
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
  wait 2>/dev/null || true
  rm -rf "$work"
}
trap cleanup EXIT
up=$(free_port); rp=$(free_port); sq=$(free_port); pg=$(free_port); hf=$(free_port)
ups=$(free_port); rps=$(free_port); sqb=$(free_port); ifl=$(free_port)

mkdir -p "$work/www" "$work/up" "$work/rp" "$work/squid"
head -c 1024 /dev/zero | tr '\0' x > "$work/www/1k"
# The upstream's CA and its certificate for localhost; squid's own local CA for its leaves.
openssl_ca() { # name
  openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes -days 2 \
    -subj "/CN=peers bench $1" -addext basicConstraints=critical,CA:TRUE \
    -addext keyUsage=critical,keyCertSign,cRLSign \
    -keyout "$work/$1-ca-key.pem" -out "$work/$1-ca.pem" 2>/dev/null
}
openssl_ca up
openssl_ca squid
openssl req -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes -subj /CN=localhost \
  -keyout "$work/up-key.pem" -out "$work/up.csr" 2>/dev/null
openssl x509 -req -in "$work/up.csr" -CA "$work/up-ca.pem" -CAkey "$work/up-ca-key.pem" \
  -CAcreateserial -days 2 -out "$work/up.pem" \
  -extfile <(printf 'subjectAltName=DNS:localhost,IP:127.0.0.1\nextendedKeyUsage=serverAuth') 2>/dev/null
chmod 644 "$work"/*.pem
tls_keys="ssl_certificate $work/up.pem; ssl_certificate_key $work/up-key.pem;"
nginx_conf "$work/up" "server { listen 127.0.0.1:$up; root $work/www; }
  server { listen 127.0.0.1:$ups ssl; $tls_keys root $work/www; }" > "$work/up/nginx.conf"
nginx_conf "$work/rp" "upstream up { server 127.0.0.1:$up; keepalive 512; }
  upstream ups { server 127.0.0.1:$ups; keepalive 512; }
  server { listen 127.0.0.1:$rp; location / { proxy_pass http://up; proxy_http_version 1.1; proxy_set_header Connection \"\"; } }
  server { listen 127.0.0.1:$rps ssl; $tls_keys location / { proxy_pass https://ups; proxy_http_version 1.1; proxy_set_header Connection \"\";
    proxy_ssl_session_reuse on; proxy_ssl_verify on; proxy_ssl_trusted_certificate $work/up-ca.pem; proxy_ssl_name localhost; } }" > "$work/rp/nginx.conf"
"${on_load[@]}" "$NGINX" -p "$work/up" -c "$work/up/nginx.conf" & pids+=($!)
"${on_proxy[@]}" "$NGINX" -p "$work/rp" -c "$work/rp/nginx.conf" & pids+=($!)

chmod 777 "$work/squid"
/usr/lib/squid/security_file_certgen -c -s "$work/squid/ssl_db" -M 16MB >/dev/null
chmod -R 777 "$work/squid/ssl_db"
cat > "$work/squid/squid.conf" <<CONF
http_port 127.0.0.1:$sq
http_port 127.0.0.1:$sqb ssl-bump tls-cert=$work/squid-ca.pem tls-key=$work/squid-ca-key.pem generate-host-certificates=on dynamic_cert_mem_cache_size=16MB
sslcrtd_program /usr/lib/squid/security_file_certgen -s $work/squid/ssl_db -M 16MB
sslcrtd_children 4 startup=1 idle=1
acl step1 at_step SslBump1
ssl_bump peek step1
ssl_bump bump all
tls_outgoing_options cafile=$work/up-ca.pem
http_access allow all
cache deny all
cache_mem 0 MB
access_log none
cache_log $work/squid/cache.log
pid_filename $work/squid/squid.pid
coredump_dir $work/squid
workers 1
shutdown_lifetime 0 seconds
CONF
"${on_proxy[@]}" /usr/sbin/squid -N -f "$work/squid/squid.conf" & pids+=($!)

cat > "$work/pacegate.toml" <<TOML
[proxy]
listen = "127.0.0.1:$pg"
allow_private_upstreams = true
ports = ["1024-65535"]
$threads_key
[proxy.limits]
max_connections = 20000
[admin]
listen = "127.0.0.1:0"
[tls]
generate_ca = true
ca_cert = "$work/ca.pem"
ca_key = "$work/ca-key.pem"
extra_upstream_roots = ["$work/up-ca.pem"]
[destinations.local]
hosts = ["localhost"]
rate = 1000000
TOML
"${on_proxy[@]}" "$bin" serve --config "$work/pacegate.toml" 2> "$work/pacegate.log" & pids+=($!)
pacegate_pid=$!
"${on_proxy[@]}" "$floor" "127.0.0.1:$hf" & pids+=($!)
floor_pid=$!

# The request line in absolute form, as a forward proxy receives it.
cat > "$work/proxied.lua" <<LUA
wrk.path = "http://localhost:$up/1k"
wrk.headers["Host"] = "localhost:$up"
LUA

wait_for $up $rp $sq $pg $hf $ups $rps $sqb
# The interception floor signs with pacegate's CA, which pacegate has made by now.
"${on_proxy[@]}" "$ifloor" "127.0.0.1:$ifl" "$work/ca.pem" "$work/ca-key.pem" "$work/up-ca.pem" & pids+=($!)
ifloor_pid=$!
wait_for $ifl

# The pids of each target's process tree root.
up_pid=${pids[0]}; rp_pid=${pids[1]}; sq_pid=${pids[2]}

run() { # name, pid whose CPU counts, concurrency, wrk target args...
  local name=$1 pid=$2 c=$3; shift 3
  local t=$((c < 2 ? 1 : 2))
  local before after out
  before=$(cpu "$pid")
  out=$("${on_load[@]}" wrk -t "$t" -c "$c" -d "${SECONDS_EACH}s" --latency "$@" 2>&1)
  after=$(cpu "$pid")
  local reqs rps p50 p99
  reqs=$(echo "$out" | awk '/requests in/ {print $1}')
  rps=$(echo "$out" | awk '/Requests\/sec/ {print $2}')
  p50=$(echo "$out" | awk '$1 == "50%" {print $2}')
  p99=$(echo "$out" | awk '$1 == "99%" {print $2}')
  local us; us=$(echo "$before $after $reqs" | awk '{ if ($3 > 0) printf "%.1f", ($2 - $1) * 1e6 / $3; else print "-" }')
  printf "%-9s c=%-4s %10s req/s  p50 %8s  p99 %8s  %6s us CPU/request\n" "$name" "$c" "$rps" "$p50" "$p99" "$us"
  cpu_of[$name]=$us
  add_up "$name" "$c" "$before" "$after" "$reqs"
}
declare -A cpu_of cpu_sum req_sum
# CPU and requests summed over the rounds, for each proxy and concurrency: the run's figure,
# against which a round's, which moves with what the machine does in its five seconds, is read.
add_up() { # name, concurrency, CPU before, CPU after, requests
  local key="$1 $2"
  cpu_sum[$key]=$(echo "${cpu_sum[$key]:-0} $3 $4" | awk '{printf "%.4f", $1 + $3 - $2}')
  req_sum[$key]=$(( ${req_sum[$key]:-0} + ${5:-0} ))
}
over_rounds() { # name, floor's name, label
  local c
  for c in $CONCURRENCY; do
    echo "${cpu_sum[$1 $c]:-0} ${req_sum[$1 $c]:-0} ${cpu_sum[$2 $c]:-0} ${req_sum[$2 $c]:-0}" |
      awk -v c="$c" -v label="$3" -v rounds="$ROUNDS" '$2 > 0 && $4 > 0 && $3 > 0 {
        printf "%s c=%-4s %.2f× CPU/request over %d rounds (%.1f against %.1f us)\n", label, c,
          ($1 / $2) / ($3 / $4), rounds, $1 * 1e6 / $2, $3 * 1e6 / $4 }'
  done
}

run_tls() { # name, pid whose CPU counts, concurrency, connect_load args...
  local name=$1 pid=$2 c=$3; shift 3
  local t=$((c < 2 ? 1 : 2))
  local before after out
  before=$(cpu "$pid")
  out=$("${on_load[@]}" "$load" -t "$t" -c "$c" -d "$SECONDS_EACH" --path /1k "$@" 2>&1) || true
  after=$(cpu "$pid")
  local reqs="" rps="" p50="" p99="" errors=""
  read -r reqs rps p50 p99 errors < <(echo "$out" | awk '/^requests/ {print $2, $4, $6, $8, $10}') || true
  local us; us=$(echo "$before $after ${reqs:-0}" | awk '{ if ($3 > 0) printf "%.1f", ($2 - $1) * 1e6 / $3; else print "-" }')
  printf "%-9s c=%-4s %10s req/s  p50 %8s  p99 %8s  %6s us CPU/request  %s errors\n" "$name" "$c" "$rps" "$p50" "$p99" "$us" "${errors:-?}"
  cpu_of[$name]=$us
  add_up "$name" "$c" "$before" "$after" "${reqs:-0}"
  [ "${errors:-1}" = 0 ] || echo "$out" | grep -v '^requests' | head -3
}

# pacegate and its floor at concurrency $c, pacegate first in odd rounds, the floor in even.
pacegate_http() { run pacegate "$pacegate_pid" "$c" -s "$work/proxied.lua" "http://127.0.0.1:$pg"; }
floor_http() { run hyper "$floor_pid" "$c" -s "$work/proxied.lua" "http://127.0.0.1:$hf"; }
pacegate_https() { run_tls pacegate-s "$pacegate_pid" "$c" --proxy "127.0.0.1:$pg" --ca "$work/ca.pem" --target "localhost:$ups"; }
floor_https() { run_tls floor-s "$ifloor_pid" "$c" --proxy "127.0.0.1:$ifl" --ca "$work/ca.pem" --target "localhost:$ups"; }
in_turn() { # round, first, second
  if [ $(($1 % 2)) = 1 ]; then "$2"; "$3"; else "$3"; "$2"; fi
}

echo "peers: nginx upstream 1 KiB on 127.0.0.1:$up (https :$ups); ${SECONDS_EACH}s per run, $ROUNDS rounds; $(nproc) cores; pacegate threads: $PACEGATE_THREADS"
for round in $(seq "$ROUNDS"); do
  for c in $CONCURRENCY; do
    if [[ " $PROTOCOLS " == *" http "* ]]; then
      run direct "$up_pid" "$c" "http://localhost:$up/1k"
      run nginx "$rp_pid" "$c" "http://127.0.0.1:$rp/1k"
      run squid "$sq_pid" "$c" -s "$work/proxied.lua" "http://127.0.0.1:$sq"
      in_turn "$round" pacegate_http floor_http
      echo "${cpu_of[pacegate]} ${cpu_of[hyper]}" | awk -v c="$c" '$2 > 0 {printf "pacegate ÷ floor   c=%-4s %.2f× CPU/request\n", c, $1 / $2}'
    fi
    if [[ " $PROTOCOLS " == *" https "* ]]; then
      run_tls direct-s "$up_pid" "$c" --ca "$work/up-ca.pem" --target "localhost:$ups"
      run_tls nginx-s "$rp_pid" "$c" --ca "$work/up-ca.pem" --target "localhost:$rps"
      run_tls squid-s "$sq_pid" "$c" --proxy "127.0.0.1:$sqb" --ca "$work/squid-ca.pem" --target "localhost:$ups"
      in_turn "$round" pacegate_https floor_https
      echo "${cpu_of[pacegate-s]} ${cpu_of[floor-s]}" | awk -v c="$c" '$2 > 0 {printf "pacegate-s ÷ floor-s c=%-4s %.2f× CPU/request\n", c, $1 / $2}'
    fi
  done
done

[[ " $PROTOCOLS " != *" http "* ]] || over_rounds pacegate hyper "pacegate ÷ floor  "
[[ " $PROTOCOLS " != *" https "* ]] || over_rounds pacegate-s floor-s "pacegate-s ÷ floor-s"

if [ "${STRACE:-0}" = 1 ]; then
  command -v strace >/dev/null 2>&1 || { echo "STRACE=1 needs strace" >&2; exit 1; }
  for target in "nginx $rp_pid http://127.0.0.1:$rp/1k" "squid $sq_pid -s $work/proxied.lua http://127.0.0.1:$sq" "pacegate $pacegate_pid -s $work/proxied.lua http://127.0.0.1:$pg"; do
    set -- $target
    name=$1; pid=$2; shift 2
    attach=()
    for p in $(tree "$pid"); do attach+=(-p "$p"); done
    strace -c -f "${attach[@]}" -o "$work/strace-$name" &
    tracer=$!
    sleep 0.5
    reqs=$(wrk -t 2 -c 32 -d 3s "$@" | awk '/requests in/ {print $1}')
    kill -INT "$tracer"; wait "$tracer" 2>/dev/null || true
    calls=$(awk '$NF == "total" {print $4}' "$work/strace-$name")
    echo "$calls $reqs" | awk -v n="$name" '{printf "%-9s %.2f system calls per request (%d over %d requests, traced)\n", n, $1 / $2, $1, $2}'
    awk '$4 ~ /^[0-9]+$/ && $NF != "total"' "$work/strace-$name" | sort -k4 -n -r |
      awk -v r="$reqs" '{printf "          %-14s %.2f\n", $NF, $4 / r}' | head -6
  done
fi
