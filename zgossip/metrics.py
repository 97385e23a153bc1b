"""Monitoring an `Averager`: Prometheus metrics over HTTP, and a JSON-lines log of every step.

`MetricsServer` serves ``GET /metrics`` in the Prometheus text exposition format (version
0.0.4) from a thread of its own (`http.server`), reading the averager's `step_log`,
`stats` and live peers at each scrape. It is written here rather than taken from
``prometheus_client``: the format is a few lines of text, zgossip needs no registry shared by
the whole process (tests run a dozen averagers in one), and the endpoint then works on every
install. The tests check its output with prometheus_client's own parser.

`JsonLinesLog` is a `StepLog` listener that appends one JSON object per step to a file
(``zgossip peer --log-json FILE``).

Not protocol code: it may start threads and open sockets (tests/other/test_architecture.py lists it
as an ops module), and the Averager imports it only when ``metrics_port`` is given.
"""
from __future__ import annotations

import http.server
import json
import logging
import math
import re
import socket
import sys
import threading
import time
import weakref
from typing import IO, Any, Callable

from .steplog import DURATION_BUCKETS, PHASES, StepRecord

__all__ = ["MetricsServer", "JsonLinesLog", "render"]

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

log = logging.getLogger(__name__)

#: a connection that sends no complete request within this many seconds is closed (a scrape
#: takes milliseconds), and at most this many are served at once; more are closed on accept.
#: Each connection holds a thread and a file descriptor of the averager's own process: held
#: forever, ~1,000 idle ones left it no descriptor for its own sockets.
IDLE_TIMEOUT = 10.0
MAX_CONNECTIONS = 32

# what the transport and node counters mean (others, e.g. added later, get a generic help line)
_COUNTER_HELP = {
    "received": "Messages received",
    "invalid": "Messages that failed validation and were dropped",
    "sent": "Messages sent",
    "send_errors": "Messages that could not be sent",
    "errors": "Internal errors of the node (logged; the node keeps serving)",
    "disconnects": "Connections to peers that dropped",
    "connections": "Connections opened to peers",
    "local_connections": "Connections opened to peers through local Unix sockets",
    "messages": "Messages handled by the protocol node",
    "dropped": "Valid messages the protocol refused (e.g. for a round it does not run)",
    "late": "Messages for a round or download already over",
    "resent": "RESULTs an in-place step sent again from a copy (their first send was stuck behind a slow link)",
}


def _escape(v: str) -> str:
    return v.replace("\\", "\\\\").replace("\"", "\\\"").replace("\n", "\\n")


def _num(x: float) -> str:
    if isinstance(x, bool):
        return "1" if x else "0"
    if isinstance(x, int):
        return str(x)
    if math.isnan(x):
        return "NaN"
    if math.isinf(x):
        return "+Inf" if x > 0 else "-Inf"
    return repr(float(x))


class _Text:
    def __init__(self) -> None:
        self.lines: list[str] = []

    def family(self, name: str, kind: str, help_: str) -> None:
        self.lines.append(f"# HELP {name} {help_}")
        self.lines.append(f"# TYPE {name} {kind}")

    def sample(self, name: str, value: float, **labels: str) -> None:
        lab = ",".join(f'{k}="{_escape(str(v))}"' for k, v in labels.items())
        self.lines.append(f"{name}{{{lab}}} {_num(value)}" if lab else f"{name} {_num(value)}")

    def text(self) -> str:
        return "\n".join(self.lines) + "\n"


def render(averager: Any, refused: int | None = None) -> str:
    """The averager's metrics as Prometheus text; `refused`: connections the endpoint turned away."""
    out = _Text()
    out.family("zgossip_info", "gauge", "This peer: its id, advertised endpoint and prefix (value 1)")
    out.sample("zgossip_info", 1, peer_id=averager.peer_id, endpoint=str(averager.endpoint),
               prefix=averager.config.prefix)
    tot = averager.step_log.totals()
    out.family("zgossip_steps_total", "counter", "Steps finished, by outcome: ok, or the class of the error")
    outcomes = {"ok": 0, **tot["outcomes"]}
    for outcome in sorted(outcomes):
        out.sample("zgossip_steps_total", outcomes[outcome], outcome=outcome)
    out.family("zgossip_step_duration_seconds", "histogram",
               "Wall time of steps that averaged, from entering step() to the result")
    cum = 0
    for le, n in zip(DURATION_BUCKETS, tot["duration_counts"]):
        cum += n
        out.sample("zgossip_step_duration_seconds_bucket", cum, le=_num(float(le)))
    cum += tot["duration_counts"][-1]
    out.sample("zgossip_step_duration_seconds_bucket", cum, le="+Inf")
    out.sample("zgossip_step_duration_seconds_sum", tot["duration_sum"])
    out.sample("zgossip_step_duration_seconds_count", cum)
    out.family("zgossip_step_phase_seconds_total", "counter", "Seconds spent in each phase of steps, summed")
    for ph in PHASES:
        out.sample("zgossip_step_phase_seconds_total", tot["phase_seconds"][ph], phase=ph)
    out.family("zgossip_step_sent_bytes_total", "counter", "Tensor bytes this peer sent in steps")
    out.sample("zgossip_step_sent_bytes_total", tot["bytes_sent"])
    out.family("zgossip_step_received_bytes_total", "counter", "Tensor bytes this peer received in steps")
    out.sample("zgossip_step_received_bytes_total", tot["bytes_received"])
    out.family("zgossip_step_lost_peers_total", "counter", "Groupmates lost during steps (died, stalled or sent bad data)")
    out.sample("zgossip_step_lost_peers_total", tot["peers_lost"])
    last = [r for r in averager.step_log.recent() if r.ok][-1:]
    if last:
        r = last[0]
        out.family("zgossip_last_step_group_size", "gauge",
                   "Members of the group of the last step that averaged, this peer included")
        out.sample("zgossip_last_step_group_size", len(r.members))
        out.family("zgossip_last_step_contributors", "gauge", "Members whose data the last step that averaged used")
        out.sample("zgossip_last_step_contributors", len(r.contributors))
    try:
        live = len(averager.peers())
        stats = averager.stats
    except Exception:  # shut down or the I/O thread is busy: say what we know
        live, stats = None, {}
    if live is not None:
        out.family("zgossip_live_peers", "gauge", "Other peers this peer believes alive (itself not counted)")
        out.sample("zgossip_live_peers", live)
    for key in sorted(stats):
        value = stats[key]
        if type(value) is not int:
            continue
        name = "zgossip_" + re.sub(r"[^a-zA-Z0-9_]", "_", key) + "_total"
        out.family(name, "counter", _COUNTER_HELP.get(key, f"Transport/node counter {key!r}"))
        out.sample(name, value)
    if refused is not None:
        out.family("zgossip_metrics_refused_connections_total", "counter",
                   "Connections to this metrics endpoint closed unserved: over its limit of connections at once")
        out.sample("zgossip_metrics_refused_connections_total", refused)
    return out.text()


class _Server(http.server.ThreadingHTTPServer):
    """A thread per connection, at most `limit` at once: the others are closed when accepted
    (counted in `refused`, logged once)."""

    daemon_threads = True

    def __init__(self, address: tuple[str, int], handler: Any, limit: int) -> None:
        # the family of the host given: an IPv6 host ("::1", "::") got "Address family for hostname
        # not supported" from the IPv4 socket http.server makes by default
        self.address_family = socket.getaddrinfo(*address, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0][0]
        self._slots = threading.BoundedSemaphore(limit)
        self.limit, self.refused = limit, 0
        super().__init__(address, handler)

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self._slots.acquire(blocking=False):
            self.refused += 1
            if self.refused == 1:
                log.warning("zgossip metrics endpoint %s:%s: more than %d connections at once; closing the "
                            "others unserved (logged once; counted in zgossip_metrics_refused_connections_total)",
                            *self.server_address[:2], self.limit)
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._slots.release()
            raise

    def handle_error(self, request: Any, client_address: Any) -> None:
        # socketserver's own prints a traceback to stderr -- through the live table -- for every
        # scraper that timed out, port scanner or health check that reset its connection
        exc = sys.exc_info()[1]
        if isinstance(exc, OSError):  # the client went away mid-request: its business, not ours
            log.debug("zgossip metrics endpoint: connection from %s:%s dropped: %s", *client_address[:2], exc)
            return
        log.warning("zgossip metrics endpoint: error serving %s:%s", *client_address[:2], exc_info=True)

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()


class MetricsServer:
    """``GET /metrics`` for one averager, served from a daemon thread until `close`. A connection
    gets `idle_timeout` seconds of silence before it is closed, and at most `max_connections` are
    served at once."""

    def __init__(self, averager: Any, host: str = "127.0.0.1", port: int = 0, *,
                 idle_timeout: float = IDLE_TIMEOUT, max_connections: int = MAX_CONNECTIONS) -> None:
        ref = weakref.ref(averager)  # the server must not keep a dropped averager alive
        server: list[_Server] = []

        class Handler(http.server.BaseHTTPRequestHandler):
            timeout = idle_timeout  # http.server sets it on the socket: a silent client is dropped

            def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
                avg = ref()
                if self.path.split("?", 1)[0] not in ("/metrics", "/") or avg is None:
                    self.send_error(404, "only /metrics is served here")
                    return
                body = render(avg, server[0].refused).encode()
                self.send_response(200)
                self.send_header("Content-Type", CONTENT_TYPE)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: Any) -> None:  # scrapes are not news
                pass

        try:
            self._server = _Server((host, port), Handler, max_connections)
        except OSError as e:  # "[Errno 98] Address already in use" named neither the address nor its use
            raise OSError(e.errno, f"cannot serve metrics at {host}:{port}: {e.strerror or e} (pick another metrics "
                                   "port, or 0 for a free one, and a metrics host this machine has)") from None
        server.append(self._server)
        h, p = self._server.server_address[:2]
        self.host, self.port = str(h), int(p)
        shown = f"[{self.host}]" if ":" in self.host else self.host
        self.url = f"http://{shown}:{self.port}/metrics"
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.2},
                                        name=f"zgossip-metrics-{self.port}", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(5)


class JsonLinesLog:
    """A `StepLog` listener: one JSON object per step, appended to `path` (or a text stream), with
    ``wall`` (Unix time) and whatever `extra()` returns added (`extra` may be set later: the
    file is opened before the averager that names the peer exists). A line that cannot be written
    (disk full, the file system gone read-only) is logged as an error -- once, until a write
    succeeds again -- and counted in `failed`; the averager goes on."""

    def __init__(self, target: str | IO[str], extra: Callable[[], dict] | None = None) -> None:
        self._own = isinstance(target, str)
        self._f: IO[str] = open(target, "a", encoding="utf-8") if isinstance(target, str) else target
        self._name = target if isinstance(target, str) else getattr(target, "name", repr(target))
        self.extra = extra
        self.failed = 0  # steps whose line could not be written, since the start
        self._failing = 0  # ... in the present outage
        self._lock = threading.Lock()

    def __call__(self, rec: StepRecord) -> None:
        data = {"wall": round(time.time(), 6), **rec.as_dict()}
        if self.extra is not None:
            data.update(self.extra())
        line = json.dumps(data, sort_keys=True, default=str)
        with self._lock:
            if self._f.closed:
                return
            try:
                self._f.write(line + "\n")
                self._f.flush()
            except OSError as e:
                self.failed += 1
                if not self._failing:
                    log.error("step log %s: cannot write step %s (%s); trying again at every step, logged once "
                              "until a write succeeds", self._name, rec.index, e.strerror or e)
                self._failing += 1
            else:
                if self._failing:
                    log.warning("step log %s: written again, after %d step(s) whose line could not be written",
                                self._name, self._failing)
                self._failing = 0

    def close(self) -> None:
        with self._lock:
            if self._own and not self._f.closed:
                try:
                    self._f.close()
                except OSError:  # its last flush failed: already logged
                    pass
