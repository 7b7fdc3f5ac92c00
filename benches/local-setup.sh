# Sourced by benches/syscalls.sh, benches/idle_memory.sh, benches/profile.sh,
# benches/instructions.sh, benches/alternate.sh and benches/fresh_rounds.sh: a work dir
# removed on exit, a local upstream answering 1 KiB to every GET, and a pacegate config with
# destination `local` (localhost) at `rate = 1000000` and `$proxy_limits` in [proxy.limits].
# The upstream is a small Python server, or nginx (one worker) when `$nginx` names its
# binary: fast enough not to be the limit under load. Sets $work, $upstream_port and
# $proxy_port. Loopback only.
[ -x "$bin" ] || cargo build --release --quiet
work=$(mktemp -d)
trap 'kill $(jobs -p) 2>/dev/null; rm -rf "$work"' EXIT
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
upstream_port=$(free_port)
proxy_port=$(free_port)
cat > "$work/pacegate.toml" <<TOML
[proxy]
listen = "127.0.0.1:$proxy_port"
allow_private_upstreams = true
ports = ["1024-65535"]
[proxy.limits]
${proxy_limits:-}
[admin]
listen = "127.0.0.1:0"
[tls]
generate_ca = true
[destinations.local]
hosts = ["localhost"]
rate = 1000000
TOML
if [ -n "${nginx:-}" ]; then
    mkdir -p "$work/www"
    head -c 1024 /dev/zero | tr '\0' x > "$work/www/index.html"
    cat > "$work/nginx.conf" <<CONF
daemon off; worker_processes 1; pid $work/nginx.pid; error_log $work/nginx.err;
events { worker_connections 4096; }
http { access_log off; keepalive_requests 10000000; client_body_temp_path $work;
  proxy_temp_path $work; fastcgi_temp_path $work; uwsgi_temp_path $work; scgi_temp_path $work;
  server { listen 127.0.0.1:$upstream_port; root $work/www; } }
CONF
    "$nginx" -p "$work" -c "$work/nginx.conf" &
else
    python3 - "$upstream_port" <<'PY' &
import http.server, sys
class H(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    # Head and body are two writes: with Nagle on, the body waits 40 ms for a delayed ACK.
    disable_nagle_algorithm = True
    def do_GET(self):
        body = b"x" * 1024
        self.send_response(200); self.send_header("Content-Length", str(len(body))); self.end_headers(); self.wfile.write(body)
    def log_message(self, *a): pass
http.server.ThreadingHTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
PY
fi
