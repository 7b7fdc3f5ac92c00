# Sourced by the scripts that run pacegate beside nginx and squid (peers.sh, cache_peers.sh):
# ports, an nginx config, waiting for listeners, and the CPU a process tree spent.

free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }

nginx_conf() { # prefix, server block
  cat <<CONF
daemon off;
master_process on;
worker_processes 1;
user root;
pid $1/nginx.pid;
error_log $1/error.log;
events { worker_connections 8192; }
http {
  access_log off;
  keepalive_requests 10000000;
  client_body_temp_path $1/cb; proxy_temp_path $1/pt; fastcgi_temp_path $1/ft;
  uwsgi_temp_path $1/ut; scgi_temp_path $1/st;
  $2
}
CONF
}

wait_for() { # port...
  for port in "$@"; do
    for _ in $(seq 100); do
      (exec 3<>/dev/tcp/127.0.0.1/$port) 2>/dev/null && break
      sleep 0.1
    done
  done
}

# CPU seconds of a process and its children, from /proc (user + system).
tree() { echo "$1"; for c in $(pgrep -P "$1" || true); do tree "$c"; done; }
cpu() {
  local total=0 tck; tck=$(getconf CLK_TCK)
  for p in $(tree "$1"); do
    [ -r "/proc/$p/stat" ] || continue
    local t; t=$(awk '{print $14 + $15}' "/proc/$p/stat")
    total=$((total + t))
  done
  echo "$total $tck" | awk '{printf "%.4f", $1 / $2}'
}
