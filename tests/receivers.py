"""Real OTLP receivers for integration tests (a plain helper module, not a conftest).

``PhoenixReceiver`` runs Arize Phoenix (``phoenix serve``, see ``phoenix_loopback.py``) as a subprocess
on loopback, with free ports for OTLP/HTTP (same port as its REST API and UI) and OTLP/gRPC,
waits until ``GET /healthz`` answers 200, and reads spans back over Phoenix's REST API.

Phoenix lives in its own virtual environment (it brings ~600 MB of server dependencies), found
through ``OTEL_ROLLOUTS_PHOENIX_PYTHON`` or at ``.receivers/phoenix/bin/python`` under the repo
root; ``.ci/run`` creates it. Without it, ``require_phoenix_python()`` skips the test, except
when ``CI`` is set, where it fails so CI cannot pass by skipping.

Facts this relies on (measured, see the project's research notes):
- start-up takes 10-15 s, almost all of it ``import phoenix.server.main``;
- the project is picked by the resource attribute ``openinference.project.name``;
- ``openinference.span.kind`` is moved out of ``attributes`` into ``span_kind``;
- OTLP/HTTP accepts protobuf only; gRPC binds ``[::]:PHOENIX_GRPC_PORT`` (all interfaces) in
  code, so the server is started through ``phoenix_loopback.py``, which binds it to 127.0.0.1;
- ingestion is asynchronous (~150 spans/s here), so read-back must poll.
"""

from __future__ import annotations

import atexit
import json
import os
import signal
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterable
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent
PHOENIX_PYTHON_ENV = "OTEL_ROLLOUTS_PHOENIX_PYTHON"
DEFAULT_PHOENIX_PYTHON = REPO_ROOT / ".receivers" / "phoenix" / "bin" / "python"

__all__ = [
    "DEFAULT_PHOENIX_PYTHON",
    "PHOENIX_PYTHON_ENV",
    "PhoenixReceiver",
    "ReceiverError",
    "find_phoenix_python",
    "free_ports",
    "in_ci",
    "require_phoenix_python",
]


class ReceiverError(RuntimeError):
    """A receiver could not be started, or did not answer as expected."""


def in_ci() -> bool:
    """True when the ``CI`` environment variable is set (to anything but ''/0/false/no)."""
    return os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no")


def find_phoenix_python() -> Path | None:
    """The Python of Phoenix's venv: ``$OTEL_ROLLOUTS_PHOENIX_PYTHON``, else the repo default."""
    configured = os.environ.get(PHOENIX_PYTHON_ENV)
    candidate = Path(configured) if configured else DEFAULT_PHOENIX_PYTHON
    if candidate.is_file() and os.access(candidate, os.X_OK):
        return candidate
    return None


def require_phoenix_python() -> Path:
    """Return Phoenix's Python, or skip the calling test (fail instead when ``CI`` is set)."""
    import pytest  # only needed when used from tests

    python = find_phoenix_python()
    if python is not None:
        return python
    configured = os.environ.get(PHOENIX_PYTHON_ENV)
    where = f"{PHOENIX_PYTHON_ENV}={configured}" if configured else str(DEFAULT_PHOENIX_PYTHON)
    message = (
        f"Phoenix OTLP receiver not available ({where} is not an executable). "
        f"Run .ci/run (it creates .receivers/phoenix), or point {PHOENIX_PYTHON_ENV} at the "
        "python of a virtual environment with arize-phoenix installed."
    )
    if in_ci():
        pytest.fail(f"CI is set, refusing to skip: {message}", pytrace=False)
    pytest.skip(message)


def free_ports(count: int = 1) -> list[int]:
    """``count`` distinct TCP ports that are free right now on all interfaces.

    All sockets are held open until every port is picked, so the ports differ. IPv6 dual-stack
    is used where available because Phoenix's gRPC server binds ``[::]``.
    """
    sockets: list[socket.socket] = []
    try:
        for _ in range(count):
            try:
                sock = socket.socket(socket.AF_INET6, socket.SOCK_STREAM)
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
                sock.bind(("::", 0))
            except OSError:
                sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                sock.bind(("0.0.0.0", 0))
            sockets.append(sock)
        return [s.getsockname()[1] for s in sockets]
    finally:
        for sock in sockets:
            sock.close()


class PhoenixReceiver:
    """Arize Phoenix as a real OTLP receiver on 127.0.0.1, in its own process group.

    >>> with PhoenixReceiver() as phx:                       # doctest: +SKIP
    ...     exporter = OTLPSpanExporter(endpoint=phx.http_endpoint)
    ...     spans = phx.wait_for_spans("my-project", 3)

    The database is a SQLite file in the working directory, so ``restart()`` (same ports,
    same data) can simulate a collector outage. Pass ``database_url="sqlite:///:memory:"``
    for a throwaway in-memory database instead.
    """

    host = "127.0.0.1"

    def __init__(
        self,
        python: str | os.PathLike[str] | None = None,
        *,
        working_dir: str | os.PathLike[str] | None = None,
        database_url: str | None = None,
        startup_timeout: float = 180.0,  # 10-20 s normally; minutes on a loaded 2-core box
    ) -> None:
        if python is None:
            python = find_phoenix_python()
            if python is None:
                raise ReceiverError(
                    f"Phoenix not found: set {PHOENIX_PYTHON_ENV} or create "
                    f"{DEFAULT_PHOENIX_PYTHON.relative_to(REPO_ROOT)} (see .ci/run)"
                )
        self.python = Path(python)
        self.startup_timeout = startup_timeout
        self._tmp: tempfile.TemporaryDirectory[str] | None = None
        if working_dir is None:
            self._tmp = tempfile.TemporaryDirectory(prefix="otr-phoenix-")
            working_dir = self._tmp.name
        self.working_dir = Path(working_dir)
        self.working_dir.mkdir(parents=True, exist_ok=True)
        self.database_url = database_url or f"sqlite:///{self.working_dir / 'phoenix.db'}"
        self.log_path = self.working_dir / "phoenix.log"
        self.port, self.grpc_port = free_ports(2)
        self._proc: subprocess.Popen[bytes] | None = None
        self.startup_seconds: float | None = None

    # -- addresses -------------------------------------------------------------------------

    @property
    def base_url(self) -> str:
        """REST API, UI and OTLP/HTTP share this origin."""
        return f"http://{self.host}:{self.port}"

    @property
    def http_endpoint(self) -> str:
        """OTLP/HTTP (protobuf only) traces endpoint."""
        return f"{self.base_url}/v1/traces"

    @property
    def grpc_endpoint(self) -> str:
        """OTLP/gRPC endpoint (plaintext: use ``insecure=True``)."""
        return f"{self.host}:{self.grpc_port}"

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    def is_running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    # -- lifecycle -------------------------------------------------------------------------

    def environment(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("PHOENIX_")}
        env.update(
            PHOENIX_WORKING_DIR=str(self.working_dir),
            PHOENIX_HOST=self.host,
            PHOENIX_PORT=str(self.port),
            PHOENIX_GRPC_PORT=str(self.grpc_port),
            PHOENIX_SQL_DATABASE_URL=self.database_url,
            # Offline and quiet: no telemetry, no downloads, no MCP/agent connections.
            PHOENIX_TELEMETRY_ENABLED="false",
            PHOENIX_ALLOW_EXTERNAL_RESOURCES="false",
            PHOENIX_DISABLE_AGENT_ASSISTANT="true",
            PYTHONUNBUFFERED="1",
        )
        # Don't let the test process's OTel settings leak into the server's own SDK.
        for key in [k for k in env if k.startswith("OTEL_")]:
            del env[key]
        return env

    def start(self) -> PhoenixReceiver:
        if self.is_running():
            return self
        started = time.monotonic()
        with open(self.log_path, "ab") as log:
            log.write(f"\n--- starting phoenix on {self.base_url} grpc {self.grpc_port}\n".encode())
            log.flush()
            self._proc = subprocess.Popen(
                # phoenix.server.main, its gRPC receiver bound to 127.0.0.1 (phoenix_loopback.py)
                [str(self.python), str(Path(__file__).resolve().parent / "phoenix_loopback.py"), "serve"],
                cwd=self.working_dir,
                env=self.environment(),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # own process group: stop() can reach any children
            )
        atexit.register(self.stop)  # safety net if the test run ends without teardown
        try:
            self._wait_healthy(self.startup_timeout)
        except BaseException:
            self.stop()
            raise
        self.startup_seconds = time.monotonic() - started
        return self

    def _wait_healthy(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        url = f"{self.base_url}/healthz"
        last_error: object = None
        while time.monotonic() < deadline:
            assert self._proc is not None
            if self._proc.poll() is not None:
                raise ReceiverError(
                    f"Phoenix exited with code {self._proc.returncode} during start-up.\n"
                    f"{self.log_tail()}"
                )
            try:
                with urllib.request.urlopen(url, timeout=2) as response:
                    if response.status == 200:
                        return
                    last_error = f"HTTP {response.status}"
            except (urllib.error.URLError, OSError) as exc:  # not listening yet
                last_error = exc
            time.sleep(0.1)
        raise ReceiverError(
            f"Phoenix not healthy after {timeout:.0f} s ({url}: {last_error}).\n{self.log_tail()}"
        )

    def stop(self, timeout: float = 15.0) -> None:
        """SIGTERM to the server's pid; SIGKILL to its process group if it does not exit."""
        proc, self._proc = self._proc, None
        if proc is None:
            return
        atexit.unregister(self.stop)
        if proc.poll() is None:
            try:
                proc.send_signal(signal.SIGTERM)
                proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                pass
        # Whatever is left in the group (the server if it ignored SIGTERM, any helpers).
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        proc.wait(timeout=timeout)

    def restart(self) -> PhoenixReceiver:
        """Stop and start again on the same ports, with the same database."""
        self.stop()
        return self.start()

    def close(self) -> None:
        self.stop()
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None

    def __enter__(self) -> PhoenixReceiver:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def log_tail(self, lines: int = 40) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return "(no phoenix log)"
        return "--- phoenix log (tail) ---\n" + "\n".join(text.splitlines()[-lines:])

    # -- reading back ----------------------------------------------------------------------

    def _get_json(self, path: str, params: list[tuple[str, str]] | None = None) -> Any:
        url = self.base_url + path
        if params:
            url += "?" + urllib.parse.urlencode(params)
        with urllib.request.urlopen(url, timeout=30) as response:
            return json.load(response)

    def _project_ids(self) -> dict[str, str]:
        """Every project's name and id, following the cursor (a page holds 100)."""
        ids: dict[str, str] = {}
        cursor: str | None = None
        while True:
            params = [("limit", "100")] + ([("cursor", cursor)] if cursor else [])
            body = self._get_json("/v1/projects", params)
            ids.update((p["name"], p["id"]) for p in body.get("data", []))
            cursor = body.get("next_cursor")
            if not cursor:
                return ids

    def projects(self) -> list[str]:
        """Names of all projects."""
        return list(self._project_ids())

    def project_id(self, project: str, timeout: float = 60.0, interval: float = 0.2) -> str:
        """Phoenix's id of ``project`` (what its GraphQL ``node`` takes), polled for until it is
        there: Phoenix makes a project as it inserts the project's first span, which it does
        after answering the export that carried it (a test that asked at once failed on a
        loaded machine, 2026-11)."""
        deadline = time.monotonic() + timeout
        while True:
            found = self._project_ids().get(project)
            if found is not None:
                return found
            if not self.is_running():
                raise ReceiverError(f"Phoenix is not running.\n{self.log_tail()}")
            if time.monotonic() >= deadline:
                raise ReceiverError(f"no project {project!r} after {timeout:.0f} s.\n{self.log_tail()}")
            time.sleep(interval)

    def spans(
        self, project: str, trace_id: str | Iterable[str] | None = None
    ) -> list[dict[str, Any]]:
        """All spans of ``project`` (optionally of some trace ids), following the cursor.

        Each span is Phoenix's REST shape: ``name``, ``context.trace_id``/``span_id`` (hex),
        ``parent_id`` (hex or None), ``span_kind``, ``start_time``/``end_time`` (ISO),
        ``status_code``, ``attributes``, ``events``. An unknown project gives ``[]``.
        """
        base: list[tuple[str, str]] = [("limit", "1000")]
        if trace_id is not None:
            ids = [trace_id] if isinstance(trace_id, str) else list(trace_id)
            base += [("trace_id", t) for t in ids]
        path = f"/v1/projects/{urllib.parse.quote(project, safe='')}/spans"
        result: list[dict[str, Any]] = []
        cursor: str | None = None
        while True:
            params = base + ([("cursor", cursor)] if cursor else [])
            try:
                body = self._get_json(path, params)
            except urllib.error.HTTPError as exc:
                if exc.code == 404:  # project not created yet: nothing ingested
                    return []
                raise
            result.extend(body.get("data", []))
            cursor = body.get("next_cursor")
            if not cursor:
                return result

    def wait_for_spans(
        self,
        project: str,
        count: int,
        trace_ids: Iterable[str] | None = None,
        timeout: float = 60.0,
        interval: float = 0.2,
    ) -> list[dict[str, Any]]:
        """Poll until at least ``count`` spans (of ``trace_ids``, if given) are there.

        Returns every span found at that point; raises ``ReceiverError`` on timeout, with the
        number seen and the server log's tail.
        """
        ids = list(trace_ids) if trace_ids is not None else None
        deadline = time.monotonic() + timeout
        found: list[dict[str, Any]] = []
        while True:
            if not self.is_running():
                raise ReceiverError(f"Phoenix is not running.\n{self.log_tail()}")
            found = self.spans(project, trace_id=ids)
            if len(found) >= count:
                return found
            if time.monotonic() >= deadline:
                raise ReceiverError(
                    f"expected >= {count} spans in project {project!r}"
                    f"{f' for traces {ids}' if ids else ''}, found {len(found)} after "
                    f"{timeout:.0f} s.\n{self.log_tail()}"
                )
            time.sleep(interval)
