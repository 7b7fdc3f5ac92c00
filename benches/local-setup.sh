# Sourced by benches/syscalls.sh and benches/idle_memory.sh: a work dir removed on exit, a
# local upstream answering 1 KiB to every GET, and a pacegate config with destination
# `local` (localhost) at `rate = 1000000` and `$proxy_limits` in [proxy.limits]. Sets
# $work, $upstream_port and $proxy_port. Loopback only.
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
