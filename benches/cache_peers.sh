#!/usr/bin/env bash
# Cache hits beside the peers, in one run on one machine: a 16 KiB object (Cache-Control:
# max-age=3600) from one nginx upstream, kept and served by squid's memory cache (a forward
# proxy, one worker, no access log), by nginx's proxy_cache (a reverse proxy, one worker, the
# cache's files on tmpfs where /dev/shm is one) and by pacegate's [cache] (as shipped: request
# log on, a destination at rate = 1000000 with cache = true). Each is warmed with one request,
# then driven by wrk at c=32 and 256 (CONCURRENCY), alternating, ROUNDS times; for each it
# prints hits/s, p50 and p99, and the CPU the proxy spent per hit (user + system, from /proc).
# The upstream's access log counts what reached it: a hit that is not one shows there.
#
# Then the memory tier's resident set: pacegate with [cache] memory = MEMORY_MIB MiB is filled
# with OBJECTS distinct 16 KiB objects (more than fit, so that it is full), and its VmRSS is
# read against the configured bytes.
#
#   benches/cache_peers.sh        # ROUNDS=2 SECONDS_EACH=5 CONCURRENCY="32 256"
#                                 # OBJECTS=10000 MEMORY_MIB=160 PACEGATE_BIN=path
#
# Installs nginx-light, wrk and squid-openssl when run as root on Debian, else says what it
# needs. Loopback only.
set -euo pipefail
cd "$(dirname "$0")/.."
. benches/peers_lib.sh
ROUNDS=${ROUNDS:-2}
SECONDS_EACH=${SECONDS_EACH:-5}
CONCURRENCY=${CONCURRENCY:-32 256}
OBJECTS=${OBJECTS:-10000}
MEMORY_MIB=${MEMORY_MIB:-160}
bin=${PACEGATE_BIN:-target/release/pacegate}

# need.sh checks /usr/sbin too, where Debian puts nginx and squid.
. benches/need.sh
need benches/cache_peers.sh nginx:nginx-light wrk:wrk squid:squid-openssl
NGINX=$(command -v nginx || echo /usr/sbin/nginx)
[ -x "$bin" ] || cargo build --release --quiet

work=$(mktemp -d)
chmod 755 "$work"
shm=$work
[ -d /dev/shm ] && shm=$(mktemp -d -p /dev/shm) && chmod 777 "$shm"
pids=()
cleanup() {
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
  wait 2>/dev/null || true
  rm -rf "$work"
  [ "$shm" = "$work" ] || rm -rf "$shm"
}
trap cleanup EXIT
up=$(free_port); rp=$(free_port); sq=$(free_port); pg=$(free_port); fill=$(free_port)
pga=$(free_port); filla=$(free_port)

mkdir -p "$work/www" "$work/up" "$work/rp" "$work/squid"
head -c 16384 /dev/urandom > "$work/www/16k"
# The upstream logs each request it serves: what the caches let through.
nginx_conf "$work/up" "server { listen 127.0.0.1:$up; root $work/www;
    access_log $work/up/access.log;
    add_header Cache-Control \"max-age=3600\";
    location /obj/ { try_files /16k =404; } }" > "$work/up/nginx.conf"
nginx_conf "$work/rp" "upstream up { server 127.0.0.1:$up; keepalive 512; }
  proxy_cache_path $shm/nginx-cache levels=1:2 keys_zone=objects:16m max_size=1g inactive=1h;
  server { listen 127.0.0.1:$rp; location / { proxy_pass http://up; proxy_http_version 1.1;
    proxy_set_header Connection \"\"; proxy_cache objects; proxy_cache_lock on; } }" > "$work/rp/nginx.conf"
"$NGINX" -p "$work/up" -c "$work/up/nginx.conf" & pids+=($!)
"$NGINX" -p "$work/rp" -c "$work/rp/nginx.conf" & pids+=($!)

chmod 777 "$work/squid"
cat > "$work/squid/squid.conf" <<CONF
http_port 127.0.0.1:$sq
http_access allow all
cache_mem 256 MB
maximum_object_size_in_memory 1 MB
memory_cache_mode always
cache_dir null /tmp
collapsed_forwarding on
access_log none
cache_log $work/squid/cache.log
pid_filename $work/squid/squid.pid
coredump_dir $work/squid
workers 1
shutdown_lifetime 0 seconds
CONF
/usr/sbin/squid -N -f "$work/squid/squid.conf" & pids+=($!)

pacegate_config() { # port, memory, admin port
  cat <<TOML
[proxy]
listen = "127.0.0.1:$1"
allow_private_upstreams = true
ports = ["1024-65535"]
[proxy.limits]
max_connections = 20000
[admin]
listen = "127.0.0.1:$3"
[tls]
generate_ca = true
ca_cert = "$work/ca.pem"
ca_key = "$work/ca-key.pem"
[cache]
memory = "$2"
max_object = "1MiB"
[destinations.local]
hosts = ["localhost"]
rate = 1000000
cache = true
TOML
}
pacegate_config "$pg" "256MiB" "$pga" > "$work/pacegate.toml"
"$bin" serve --config "$work/pacegate.toml" 2> "$work/pacegate.log" & pids+=($!)
pacegate_pid=$!

wait_for $up $rp $sq $pg

rp_pid=${pids[1]}; sq_pid=${pids[2]}

cat > "$work/proxied.lua" <<LUA
wrk.path = "http://localhost:$up/16k"
wrk.headers["Host"] = "localhost:$up"
LUA
arrivals() { wc -l < "$work/up/access.log"; }
# Warmed: each keeps the object before it is measured.
curl -s -o /dev/null -x "http://127.0.0.1:$sq" "http://localhost:$up/16k"
curl -s -o /dev/null "http://127.0.0.1:$rp/16k"
curl -s -o /dev/null -x "http://127.0.0.1:$pg" "http://localhost:$up/16k"
sleep 0.5
echo "warmed: the upstream served $(arrivals) requests"

declare -A hits_sum cpu_sum
run() { # name, pid whose CPU counts, concurrency, wrk target args...
  local name=$1 pid=$2 c=$3; shift 3
  local before after out seen
  seen=$(arrivals)
  before=$(cpu "$pid")
  out=$(wrk -t 2 -c "$c" -d "${SECONDS_EACH}s" --latency "$@" 2>&1)
  after=$(cpu "$pid")
  local reqs rps p50 p99 us through
  reqs=$(echo "$out" | awk '/requests in/ {print $1}')
  rps=$(echo "$out" | awk '/Requests\/sec/ {print $2}')
  p50=$(echo "$out" | awk '$1 == "50%" {print $2}')
  p99=$(echo "$out" | awk '$1 == "99%" {print $2}')
  us=$(echo "$before $after $reqs" | awk '{ if ($3 > 0) printf "%.1f", ($2 - $1) * 1e6 / $3; else print "-" }')
  through=$(( $(arrivals) - seen ))
  printf "%-9s c=%-4s %10s hits/s  p50 %8s  p99 %8s  %6s us CPU/hit  %d reached the upstream\n" \
    "$name" "$c" "$rps" "$p50" "$p99" "$us" "$through"
  hits_sum["$name $c"]=$(( ${hits_sum["$name $c"]:-0} + ${reqs:-0} ))
  cpu_sum["$name $c"]=$(echo "${cpu_sum["$name $c"]:-0} $before $after" | awk '{printf "%.4f", $1 + $3 - $2}')
}

for round in $(seq "$ROUNDS"); do
  echo "round $round"
  for c in $CONCURRENCY; do
    run squid "$sq_pid" "$c" -s "$work/proxied.lua" "http://127.0.0.1:$sq"
    run nginx "$rp_pid" "$c" "http://127.0.0.1:$rp/16k"
    run pacegate "$pacegate_pid" "$c" -s "$work/proxied.lua" "http://127.0.0.1:$pg"
  done
done
echo "over $ROUNDS rounds (hits/s, CPU per hit):"
for c in $CONCURRENCY; do
  for name in squid nginx pacegate; do
    echo "${hits_sum["$name $c"]} ${cpu_sum["$name $c"]}" | awk -v n="$name" -v c="$c" -v s="$SECONDS_EACH" -v r="$ROUNDS" \
      '{ printf "%-9s c=%-4s %8.0f hits/s  %6.1f us CPU/hit\n", n, c, $1 / (s * r), $2 * 1e6 / $1 }'
  done
  echo "${hits_sum["pacegate $c"]} ${hits_sum["squid $c"]} ${cpu_sum["pacegate $c"]} ${cpu_sum["nginx $c"]} ${hits_sum["nginx $c"]}" |
    awk -v c="$c" '{ printf "c=%-4s pacegate: %.2f× squid hits/s, %.2f× nginx CPU/hit\n", c, $1 / $2, ($3 / $1) / ($4 / $5) }'
done

# The memory tier full: OBJECTS distinct objects through a pacegate of MEMORY_MIB MiB.
pacegate_config "$fill" "${MEMORY_MIB}MiB" "$filla" > "$work/fill.toml"
"$bin" serve --config "$work/fill.toml" 2> "$work/fill.log" & pids+=($!)
fill_pid=$!
wait_for $fill
rss() { awk '/VmRSS/ {print $2}' "/proc/$1/status"; }
idle=$(rss "$fill_pid")
python3 - "$fill" "$up" "$OBJECTS" <<'PY'
import http.client, sys, concurrent.futures
proxy, up, n = int(sys.argv[1]), sys.argv[2], int(sys.argv[3])
def some(start):
    c = http.client.HTTPConnection("127.0.0.1", proxy)
    for i in range(start, n, 8):
        c.request("GET", f"http://localhost:{up}/obj/{i}", headers={"Host": f"localhost:{up}"})
        r = c.getresponse()
        assert len(r.read()) == 16384 and r.status == 200
with concurrent.futures.ThreadPoolExecutor(8) as pool:
    list(pool.map(some, range(8)))
PY
sleep 1
full=$(rss "$fill_pid")
kept=$(curl -s "http://127.0.0.1:$filla/metrics" | awk '$1 == "pacegate_cache_bytes{tier=\"memory\"}" {print $2}')
echo "memory tier: $OBJECTS objects of 16 KiB through memory = ${MEMORY_MIB}MiB" \
  "| RSS idle ${idle} KiB, full ${full} KiB" \
  "| RSS ÷ configured: $(echo "$full $MEMORY_MIB" | awk '{printf "%.3f", $1 / ($2 * 1024)}')" \
  "| kept: ${kept:-?} bytes"
