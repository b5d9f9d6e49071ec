"""HTTP version notification for the files transport (engines that share only a folder).

Trainer side, `VersionServer`: `GET /version?after=N&wait_s=T` answers with the newest
published version as soon as it exceeds N, or with N itself once T seconds passed (a long
poll: the engine learns of a version the moment it is published, without polling the folder),
or with status 410 once the trainer closed. Engine side, `VersionWatcher.wait_newer(after)`
makes that request in slices of `SLICE_S` and returns the version, or None once the server
said it closed; any other failure raises TransportError naming the server and the version.
The weights file and the LATEST marker stay the source of truth; the notification only says
when to look.
"""

from __future__ import annotations

import json
import threading
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlparse

from nonstop.transport.base import TransportError

SLICE_S = 30.0  # longest one long poll is held open; renewed until a version or a close arrives


class VersionServer:
    def __init__(self, host: str, port: int) -> None:
        self.cond = threading.Condition()
        self.version = 0
        self.closed = False
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                url = urlparse(self.path)
                if url.path != "/version":
                    self.send_error(404)
                    return
                q = parse_qs(url.query)
                try:
                    after, wait_s = int(q["after"][0]), min(float(q.get("wait_s", [SLICE_S])[0]), SLICE_S)
                except (KeyError, ValueError):
                    self.send_error(400, "expected /version?after=N[&wait_s=T]")
                    return
                with server.cond:
                    server.cond.wait_for(lambda: server.closed or server.version > after, timeout=wait_s)
                    closed, version = server.closed, server.version
                body = json.dumps({"version": version}).encode()
                self.send_response(410 if closed else 200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args) -> None:  # one request per version: keep logs quiet
                pass

        self.httpd = ThreadingHTTPServer((host, port), Handler)
        self.httpd.daemon_threads = True
        self.thread = threading.Thread(target=self.httpd.serve_forever, name="weights-notify", daemon=True)
        self.thread.start()

    def publish(self, version: int) -> None:
        with self.cond:
            self.version = version
            self.cond.notify_all()

    def close(self) -> None:
        with self.cond:
            self.closed = True
            self.cond.notify_all()
        self.httpd.shutdown()
        self.httpd.server_close()


class VersionWatcher:
    def __init__(self, host: str, port: int, timeout_s: float) -> None:
        self.url = f"http://{host}:{port}/version"
        self.timeout_s = timeout_s

    def wait_newer(self, after: int, wait_s: float = SLICE_S) -> int | None:
        """The newest version once it is above `after` (or `after` when the slice ran out);
        None when the trainer closed its server."""
        try:
            with urllib.request.urlopen(
                f"{self.url}?after={after}&wait_s={wait_s}", timeout=wait_s + self.timeout_s
            ) as resp:
                return int(json.loads(resp.read())["version"])
        except urllib.error.HTTPError as e:
            if e.code == 410:
                return None
            raise TransportError(
                f"notification server {self.url} answered {e.code} while waiting for a version after {after}"
            ) from e
        except (OSError, ValueError, KeyError) as e:  # refused, reset, timed out, garbled
            raise TransportError(
                f"lost the trainer's notification server {self.url} while waiting for a version after {after}: {e}"
            ) from e
