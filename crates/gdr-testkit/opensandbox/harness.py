"""Runs the real opensandbox-server (PyPI, pinned by install.sh) for the Rust tests.

Kubernetes mode, with the server's `K8sClient` replaced by the in-memory one of
`fake_k8s.py`; everything else (routes, auth, validators, providers, response models,
the blocking create with its timeouts) is the server's own code.

    python harness.py --workdir DIR --api-key-file FILE [--create-timeout S] [--pool-acquisition-timeout S]

Both servers bind 127.0.0.1:0. Once the API serves, one JSON line goes to stdout:
`{"api_port": N, "control_port": M}`. The harness exits (killing every sandbox process)
when its stdin closes, so it never outlives the test process that started it.

Control API (JSON, no auth, loopback only), for what a test drives on the "cluster" side:
- `PUT /pools/<name>` `{"capacity": n, "start_delay": s|null, "spawn": bool, "fail_start": bool}`
- `DELETE /pools/<name>`
- `POST /sandboxes/<id>/fail`: the sandbox's task fails (state `Failed`, `TASK_FAILED`)
- `GET /sandboxes/<id>`: `{"batchsandbox": {...}, "pod": {name, uid, pid, exit_code, env, log, …}|null}`
- `GET /sandboxes?pool=<name>`: every sandbox of the pool (all without `pool`), described as above
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import sys
import threading
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import fake_k8s  # noqa: E402

NAMESPACE = "opensandbox"


def write_config(workdir: Path, api_key: str, create_timeout: int, pool_timeout: int) -> Path:
    path = workdir / "opensandbox.toml"
    path.write_text(
        f"""
[server]
host = "127.0.0.1"
# Unused: uvicorn serves a socket the harness bound to 127.0.0.1:0.
port = 8080
api_key = {json.dumps(api_key)}
max_sandbox_timeout_seconds = 86400

[log]
level = "WARNING"

[runtime]
type = "kubernetes"
execd_image = "opensandbox/execd:v1.1.0"

[store]
type = "sqlite"
path = {json.dumps(str(workdir / "opensandbox.db"))}

[kubernetes]
namespace = "{NAMESPACE}"
workload_provider = "batchsandbox"
sandbox_create_timeout_seconds = {create_timeout}
pool_acquisition_timeout_seconds = {pool_timeout}
sandbox_create_poll_interval_seconds = 0.05
"""
    )
    return path


def install_fake_client() -> None:
    """Replaces `K8sClient` in the client module and in every server module that already
    imported the name (importing the client module runs `services/k8s/__init__`, which
    binds it in several modules); modules importing it later get the fake from the client
    module."""
    import opensandbox_server.services.k8s.client as client_module

    real = client_module.K8sClient
    for name, module in list(sys.modules.items()):
        if name.startswith("opensandbox_server") and getattr(module, "K8sClient", None) is real:
            module.K8sClient = fake_k8s.FakeK8sClient


def control_server(controller: fake_k8s.PoolController) -> ThreadingHTTPServer:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):  # quiet: the tests read state, not logs
            pass

        def _reply(self, status: int, body=None) -> None:
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _body(self):
            length = int(self.headers.get("Content-Length") or 0)
            return json.loads(self.rfile.read(length) or b"{}")

        def do_PUT(self):
            parts = self.path.strip("/").split("/")
            if len(parts) == 2 and parts[0] == "pools":
                body = self._body()
                behaviour = fake_k8s.PoolBehaviour(
                    start_delay=body.get("start_delay", 0.0),
                    spawn=bool(body.get("spawn", False)),
                    fail_start=bool(body.get("fail_start", False)),
                )
                controller.put_pool(parts[1], int(body.get("capacity", 1)), behaviour)
                return self._reply(200, {})
            self._reply(404, {"error": "unknown path"})

        def do_DELETE(self):
            parts = self.path.strip("/").split("/")
            if len(parts) == 2 and parts[0] == "pools":
                controller.delete_pool(parts[1])
                return self._reply(200, {})
            self._reply(404, {"error": "unknown path"})

        def do_POST(self):
            parts = self.path.strip("/").split("/")
            if len(parts) == 3 and parts[0] == "sandboxes" and parts[2] == "fail":
                found = controller.fail_sandbox(parts[1])
                return self._reply(200 if found else 404, {})
            self._reply(404, {"error": "unknown path"})

        def do_GET(self):
            url = urllib.parse.urlsplit(self.path)
            parts = url.path.strip("/").split("/")
            if parts == ["sandboxes"]:
                pool = urllib.parse.parse_qs(url.query).get("pool", [None])[0]
                return self._reply(200, controller.describe_all(pool))
            if len(parts) == 2 and parts[0] == "sandboxes":
                described = controller.describe(parts[1])
                return self._reply(200 if described else 404, described)
            self._reply(404, {"error": "unknown path"})

    return ThreadingHTTPServer(("127.0.0.1", 0), Handler)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--workdir", required=True, type=Path)
    parser.add_argument("--api-key-file", required=True, type=Path)
    # The server's defaults are 60 s and 30 s; tests pass shorter ones to reach the
    # 504 and 429 paths quickly, and say so.
    parser.add_argument("--create-timeout", type=int, default=60)
    parser.add_argument("--pool-acquisition-timeout", type=int, default=30)
    args = parser.parse_args()

    api_key = args.api_key_file.read_text().strip()
    config = write_config(args.workdir, api_key, args.create_timeout, args.pool_acquisition_timeout)
    os.environ["SANDBOX_CONFIG_PATH"] = str(config)

    install_fake_client()
    import uvicorn
    from opensandbox_server.main import app  # builds the sandbox service on the fake

    controller = fake_k8s.PoolController(NAMESPACE, args.workdir)
    threading.Thread(target=controller.run, daemon=True).start()
    control = control_server(controller)
    threading.Thread(target=control.serve_forever, daemon=True).start()

    api_socket = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    api_socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    api_socket.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))

    async def announce() -> None:
        while not server.started:
            await asyncio.sleep(0.02)
        print(json.dumps({"api_port": api_socket.getsockname()[1], "control_port": control.server_address[1]}), flush=True)

    def exit_with_parent() -> None:
        sys.stdin.buffer.read()  # returns at EOF: the test process is gone
        controller.stop()
        os._exit(0)

    threading.Thread(target=exit_with_parent, daemon=True).start()

    async def serve() -> None:
        await asyncio.gather(server.serve(sockets=[api_socket]), announce())

    asyncio.run(serve())


if __name__ == "__main__":
    main()
