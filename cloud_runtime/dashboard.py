"""The cloud's fleet dashboard: `GET /` (cloud_runtime/dashboard.html, a page that renders the fleet every 2 s) and
`GET /fleet.json` (the fleet view: the cloud and one entry per device, cloud_runtime.fleet) on
`CloudConfig.dashboard_port`; anything else is 404. docs/DASHBOARD.md describes what the page shows.

A small threaded http.server apart from the serving loop: each request calls `document()` on its own thread, which
must copy what it reads (as the metrics' snapshot does). The page is plain HTML and JavaScript, no external resource,
so it works on a network without the internet; it is read from the package once, when the dashboard is made.
"""
from __future__ import annotations

import json
import logging
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from importlib import resources
from typing import Any, Callable, Optional, Tuple

from cloud_runtime.metrics import cannot_listen, stop_http

log = logging.getLogger("hatspec.cloud.dashboard")

PAGE = "dashboard.html"  # package data of cloud_runtime (pyproject.toml)


def page_html() -> bytes:
    """The dashboard page as shipped with the package."""
    return resources.files("cloud_runtime").joinpath(PAGE).read_bytes()


class _Server(ThreadingHTTPServer):
    daemon_threads = True  # a browser's open connection never holds the cloud's exit
    allow_reuse_address = True


class _Server6(_Server):
    address_family = socket.AF_INET6


def _handler(page: bytes, document: Callable[[], dict]) -> type:
    class Handler(BaseHTTPRequestHandler):
        server_version = "hatspec-dashboard"

        def do_GET(self) -> None:  # noqa: N802 (http.server's name)
            path = self.path.split("?", 1)[0]
            if path in ("/", "/index.html"):
                self._send(200, "text/html; charset=utf-8", page)
            elif path == "/fleet.json":
                try:
                    body = json.dumps(document(), allow_nan=False).encode()
                except Exception as exc:  # a bug in the view must not look like an empty fleet
                    log.exception("fleet view failed")
                    body = json.dumps({"error": f"{type(exc).__name__}: {exc}"}).encode()
                    self._send(500, "application/json", body)
                    return
                self._send(200, "application/json", body)
            else:
                self._send(404, "text/plain; charset=utf-8", f"not found: {path} (try / or /fleet.json)\n".encode())

        def _send(self, code: int, kind: str, body: bytes) -> None:
            self.send_response(code)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(body)))
            self.send_header("Cache-Control", "no-store")
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 (http.server's signature)
            log.debug("%s %s", self.address_string(), format % args)

    return Handler


class Dashboard:
    """The dashboard's HTTP endpoint over `document()` (the fleet view): `serve`, then `close`."""

    def __init__(self, document: Callable[[], dict]):
        self.document = document
        self.page = page_html()
        self._httpd: Optional[_Server] = None
        self._thread: Optional[threading.Thread] = None
        self.address: Optional[Tuple[str, int]] = None  # where it listens, once serving

    def serve(self, host: str, port: int) -> Tuple[str, int]:
        """Serve from a thread on host:port (0: any free port); OSError in one line when it cannot listen there."""
        kind = _Server6 if ":" in host else _Server
        try:
            self._httpd = kind((host, port), _handler(self.page, self.document))
        except OSError as exc:
            raise cannot_listen("dashboard_port", host, port, exc) from None
        self.address = self._httpd.server_address[:2]
        self._thread = threading.Thread(target=self._httpd.serve_forever, name="hatspec-dashboard", daemon=True)
        self._thread.start()
        return self.address

    def close(self) -> None:
        if self._httpd is not None:
            stop_http(self._httpd)
            self._httpd = None
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None

    def __enter__(self) -> "Dashboard":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
