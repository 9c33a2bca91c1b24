"""A real Alertmanager and a real HTTP receiver on loopback, for tests of alert delivery.

``Alertmanager`` runs Debian's ``prometheus-alertmanager`` (``make test-deps``) on a free port,
with its data in a temporary directory, clustering off, and a route to one webhook receiver
with small group timings, so a posted alert reaches the receiver within a second.
``HttpReceiver`` records every request (raw body bytes and headers); it can be stopped and
started again on the same port (a receiver that went away), and made to answer errors.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import threading
import time
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import requests

from orchestration.services import free_port

ALERTMANAGER = "/usr/bin/prometheus-alertmanager"


@dataclass(frozen=True)
class Request:
    path: str
    headers: dict[str, str]
    body: bytes
    status: int  # what the receiver answered

    def json(self):
        return json.loads(self.body)


class HttpReceiver:
    """Records POSTs; ``answer(status)`` (or a callable of the request) sets the reply."""

    def __init__(self, port: int | None = None) -> None:
        self.port = port or free_port()
        self.requests: list[Request] = []
        self.lock = threading.Lock()
        self.status = 200
        self.server: ThreadingHTTPServer | None = None
        self.thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def answer(self, status) -> None:
        """An HTTP status for every request, or a function ``(path, headers, body) -> status``."""
        self.status = status

    def start(self) -> HttpReceiver:
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                headers = {k: v for k, v in self.headers.items()}
                status = receiver.status
                if callable(status):
                    status = status(self.path, headers, body)
                with receiver.lock:
                    receiver.requests.append(Request(self.path, headers, body, status))
                self.send_response(status)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, args=(0.05,), daemon=True,
                                       name=f"http-receiver-{self.port}")
        self.thread.start()
        return self

    def stop(self) -> None:
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()
            self.thread.join(5)
            self.server = None

    def received(self, path: str | None = None, ok: bool = True) -> list[Request]:
        """Requests (to ``path``), by default only those answered 2xx."""
        with self.lock:
            return [r for r in self.requests if (path is None or r.path == path)
                    and (not ok or 200 <= r.status < 300)]

    def wait_for(self, count: int, path: str | None = None, timeout: float = 15.0) -> list[Request]:
        deadline = time.monotonic() + timeout
        while len(got := self.received(path)) < count:
            if time.monotonic() > deadline:
                raise AssertionError(f"{self.url}{path or ''}: {len(got)} of {count} requests "
                                     f"within {timeout:g}s: {[r.body[:200] for r in got]}")
            time.sleep(0.02)
        return got


def config(webhook_url: str, group_wait: str = "0s", group_interval: str = "1s",
           repeat_interval: str = "1h", resolve_timeout: str = "5m") -> str:
    """One route, grouped by every label (a notification per alert), to one webhook."""
    return f"""global:
  resolve_timeout: {resolve_timeout}
route:
  receiver: test
  group_by: ['...']
  group_wait: {group_wait}
  group_interval: {group_interval}
  repeat_interval: {repeat_interval}
receivers:
  - name: test
    webhook_configs:
      - url: {json.dumps(webhook_url)}
        send_resolved: true
"""


class Alertmanager:
    """``prometheus-alertmanager`` on 127.0.0.1:<free port>; ``restart()`` starts a new
    process on the same port with empty storage (Alertmanager keeps no alerts on disk)."""

    def __init__(self, workdir: Path, webhook_url: str = "", config_text: str | None = None,
                 port: int | None = None) -> None:
        if not Path(ALERTMANAGER).exists():
            raise RuntimeError(f"{ALERTMANAGER} is missing: run `make test-deps` "
                               "(apt-get install prometheus-alertmanager)")
        self.workdir = Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.port = port or free_port()
        self.config_file = self.workdir / "alertmanager.yml"
        self.config_file.write_text(config_text or config(webhook_url))
        self.log_file = self.workdir / "alertmanager.log"
        self.proc: subprocess.Popen | None = None
        self.session = requests.Session()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 20.0) -> Alertmanager:
        storage = self.workdir / "data"
        shutil.rmtree(storage, ignore_errors=True)
        with open(self.log_file, "ab") as out:
            self.proc = subprocess.Popen(
                [ALERTMANAGER, f"--config.file={self.config_file}", f"--storage.path={storage}",
                 f"--web.listen-address=127.0.0.1:{self.port}", "--cluster.listen-address=",
                 "--log.level=warn"],
                stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"alertmanager exited ({self.proc.returncode}): "
                                   f"{self.log_file.read_text(errors='replace')[-2000:]}")
            try:
                if self.session.get(f"{self.url}/-/ready", timeout=1).status_code == 200:
                    return self
            except requests.RequestException:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"alertmanager not ready on {self.url} within {timeout:g}s")
            time.sleep(0.05)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self.proc = None

    def restart(self) -> Alertmanager:
        self.stop()
        return self.start()

    def alerts(self, **filters: str) -> list[dict]:
        """``GET /api/v2/alerts`` (active ones; ``filter`` matchers as keyword labels)."""
        params = [("filter", f'{k}="{v}"') for k, v in filters.items()]
        r = self.session.get(f"{self.url}/api/v2/alerts", params=params, timeout=5)
        r.raise_for_status()
        return r.json()

    def wait_for_alerts(self, count: int, timeout: float = 10.0, **filters: str) -> list[dict]:
        deadline = time.monotonic() + timeout
        while len(got := self.alerts(**filters)) != count:
            if time.monotonic() > deadline:
                raise AssertionError(f"alertmanager holds {len(got)} alerts matching {filters}, "
                                     f"not {count}: {got}")
            time.sleep(0.05)
        return got

    def __enter__(self) -> Alertmanager:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
        self.session.close()
