"""``launch.py status --serve``: the report of a run (``specring.supervisor.report``) as a live page, with the
per-process table of ``launch.py status``.

A threaded ``http.server`` on ``127.0.0.1`` by default (``--host`` to listen elsewhere; through an SSH tunnel the
default is enough), on ``--port`` (default 0: a free port, printed). The page lives at ``/<token>/`` only, the
token random per start (``secrets.token_urlsafe``), printed with the URL: any other path is a 404 that says
nothing. Read-only: it answers GET and HEAD, sends nothing to the run's supervisor and writes nothing; it reads
the run directory (``status.json`` for the process table, rewritten by the supervisor every second; the files
of the report for the plots). The page re-fetches itself every ``--refresh-s`` seconds (a few lines of inline
script replace its content in place, so the scroll position stays; without script a meta refresh reloads it);
it is rebuilt when a file of the run changed and the last build is at least half that old, so many open pages
cost one build. Everything it shows is inline (PNG data URIs, inline style): no network, and a
Content-Security-Policy that allows nothing else.
"""

from __future__ import annotations

import hmac
import html
import http.server
import secrets
import signal
import sys
import threading
import time
from pathlib import Path

from specring.shared.process.procs import install_stop_handlers
from specring.shared.run import run_dir as rd
from specring.shared.run.run_dir import RunDir
from specring.shared.run.run_records import StatusRow
from specring.supervisor.report import load_run, render_page, render_plots
from specring.supervisor.status import status_mib as _mib
from specring.supervisor.status import status_num as _num
from specring.supervisor.status import status_pct as _pct
from specring.supervisor.status import status_work as _work

WATCHED = (rd.CONFIG_FILE, rd.SUMMARY_FILE, rd.METRICS_FILE, rd.EVAL_FILE, rd.TIMESERIES_FILE, rd.STATUS_FILE)
CSP = ("default-src 'none'; img-src data:; style-src 'unsafe-inline'; script-src 'unsafe-inline'; "
       "connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'")
PROCESS_HEAD = ["process", "pid", "gen", "state", "hb_age s", "tok/s", "duty", "starv", "cpu%", "rss MiB",
                "gpu MiB", "restarts", "ring F/W/R/r", "busy with"]


def process_rows(rows: list[StatusRow]) -> list[list[str]]:
    """The cells of ``launch.py status``'s per-process table for the rows of ``status.json``."""
    out = []
    for r in rows:
        ring = r.ring
        out.append([r.name, str(r.pid or "-"), _or_dash(r.generation), _or_dash(r.state),
                    _num(r.heartbeat_age_s, ".1f"), _num(r.tokens_per_s, ",.0f"),
                    _pct(r.duty_cycle) if r.role == "producer" else "",
                    _pct(r.starvation) if r.role == "consumer" else "",
                    _num(r.cpu_percent, ".0f"), _num(_mib(r.rss_bytes), ".0f"),
                    _num(_mib(r.gpu_mem_bytes), ".0f"), _or_dash(r.restarts),
                    "{FREE}/{WRITING}/{READY}/{READING}".format(**ring) if isinstance(ring, dict) else "",
                    _work(r)])
    return out


def _or_dash(x) -> str:
    return "-" if x is None else str(x)


def live_section(run_dir: Path, refresh_s: float) -> str:
    """The live part of the page: whether the run is going, its step, and the process table of ``status.json``."""
    esc = html.escape
    run = RunDir(run_dir)
    st = run.read_status()
    rows, run_id = (st.rows, "?" if st.run_id is None else st.run_id) if st is not None else ([], "?")
    pid = run.supervisor_pid()
    going = (f"going (supervisor pid {pid})" if pid else "going") if pid is not None else \
        "not going: its supervisor has exited (the table is its last second)"
    state = f"run {esc(str(run_id))}: {esc(going)}; page rebuilt {esc(time.strftime('%H:%M:%S'))}, " \
            f"refreshed every {refresh_s:g} s"
    if rows:
        cells = process_rows(rows)
        head = "".join(f"<th>{esc(h)}</th>" for h in PROCESS_HEAD)
        body = "".join(f'<tr class="state-{esc(r[3])}">' + "".join(f"<td>{esc(c)}</td>" for c in r) + "</tr>"
                       for r in cells)
        table = f'<table id="table-processes"><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>'
    else:
        table = ('<p id="table-processes" class="empty">no process rows yet: status.json is missing or empty '
                 "(the supervisor writes it every second once the run has started)</p>")
    return (f'<section id="processes"><h2>Processes (launch.py status)</h2>'
            f'<p class="meta" id="live-state" data-going="{int(pid is not None)}">{state}</p>{table}</section>')


def refresh_script(refresh_s: float) -> str:
    """Inline script: every ``refresh_s`` seconds fetch the page again and swap its ``<main>`` in place."""
    ms = max(500, int(refresh_s * 1000))
    return (f'<noscript><meta http-equiv="refresh" content="{max(1, round(refresh_s))}"></noscript><script>'
            "setInterval(async function(){try{const r=await fetch(location.href,{cache:'no-store'});"
            "if(!r.ok)return;const d=new DOMParser().parseFromString(await r.text(),'text/html');"
            "const m=d.getElementById('report');if(m)document.getElementById('report').replaceWith(m);}"
            f"catch(e){{}}}},{ms});</script>")


class LivePage:
    """Builds the live page of ``run_dir`` and keeps the last build (see the module docstring)."""

    def __init__(self, run_dir: str | Path, refresh_s: float = 5.0):
        self.run_dir = Path(run_dir)
        self.refresh_s = float(refresh_s)
        self._lock = threading.Lock()
        self._page: bytes | None = None
        self._sig = None
        self._built = 0.0
        self._cache: dict = {}  # what was read of the run's JSON-lines files: only appended lines are parsed

    def _signature(self):
        sig = []
        for name in WATCHED:
            try:
                st = (self.run_dir / name).stat()
                sig.append((name, st.st_size, st.st_mtime_ns))
            except OSError:
                sig.append((name, None, None))
        return tuple(sig)

    def page(self) -> bytes:
        """The page's HTML (UTF-8), rebuilt when a watched file changed and the last build is old enough."""
        with self._lock:
            sig = self._signature()
            fresh = time.monotonic() - self._built < self.refresh_s / 2
            if self._page is not None and (sig == self._sig or fresh):
                return self._page
            self._page = self._build().encode()
            self._sig, self._built = sig, time.monotonic()
            return self._page

    def _build(self) -> str:
        try:
            run = load_run(self.run_dir, cache=self._cache)
        except FileNotFoundError as e:
            return (f"<!doctype html><html><head><meta charset=\"utf-8\">{refresh_script(self.refresh_s)}</head>"
                    f'<body><main id="report"><p>{html.escape(str(e))}</p></main></body></html>')
        plots = render_plots([run], [])
        return render_page([run], [], plots, f"specring live: {run.name}",
                           live=live_section(self.run_dir, self.refresh_s),
                           head_extra=refresh_script(self.refresh_s))


def make_server(run_dir: str | Path, host: str = "127.0.0.1", port: int = 0, refresh_s: float = 5.0,
                token: str | None = None) -> tuple[http.server.ThreadingHTTPServer, str]:
    """A server of the live page of ``run_dir`` (not yet serving) and its URL ``http://HOST:PORT/TOKEN/``; raises
    ``OSError`` when the address cannot be bound."""
    token = token or secrets.token_urlsafe(16)
    live = LivePage(run_dir, refresh_s)
    prefix = f"/{token}/"

    class Handler(http.server.BaseHTTPRequestHandler):
        server_version = "specring-live"
        sys_version = ""

        def _answer(self, body: bool) -> None:
            path = self.path.split("?", 1)[0]
            if not (hmac.compare_digest(path.encode(), prefix.encode())
                    or hmac.compare_digest(path.encode(), prefix.rstrip("/").encode())):
                self.send_response(404)
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
            try:
                data = live.page()
                code = 200
            except Exception as e:  # noqa: BLE001 - a page that says so, never a dropped connection
                data = f"<!doctype html><p>the page could not be built: {html.escape(repr(e))}</p>".encode()
                code = 500
            self.send_response(code)
            self.send_header("Content-Type", "text/html; charset=utf-8")
            self.send_header("Content-Length", str(len(data)))
            self.send_header("Cache-Control", "no-store")
            self.send_header("Content-Security-Policy", CSP)
            self.send_header("X-Content-Type-Options", "nosniff")
            self.send_header("Referrer-Policy", "no-referrer")
            self.end_headers()
            if body:
                self.wfile.write(data)

        def do_GET(self):  # http.server's names
            self._answer(True)

        def do_HEAD(self):
            self._answer(False)

        def log_message(self, fmt, *args):  # quiet: the URL holds the token
            pass

    server = http.server.ThreadingHTTPServer((host, port), Handler)
    server.daemon_threads = True
    shown = host if ":" not in host else f"[{host}]"
    return server, f"http://{shown}:{server.server_address[1]}{prefix}"


def serve(run_dir: str | Path, host: str = "127.0.0.1", port: int = 0, refresh_s: float = 5.0) -> int:
    """Serve the live page of ``run_dir`` until a signal of ``shared.process.procs.STOP_SIGNALS`` (Ctrl-C, even
    when the parent left SIGINT ignored: exit code 0); prints its URL first. Exit code 2 when the address cannot be
    bound."""
    try:
        server, url = make_server(run_dir, host, port, refresh_s)
    except OSError as e:
        print(f"error: --port {port} / --host {host}: cannot listen there ({e})", file=sys.stderr)
        return 2
    where = "" if host in ("127.0.0.1", "localhost", "::1") else \
        f" (listening on {host}: anyone who can reach it and has the URL sees the run)"
    print(f"live page of {run_dir}: {url}{where}; read-only, refreshed every {refresh_s:g} s; Ctrl-C stops",
          flush=True)
    # the stop signals end it even where the parent started it with SIGINT ignored (a shell's background job,
    # nohup): Python then keeps SIGINT ignored and a KeyboardInterrupt never comes
    install_stop_handlers(signal.default_int_handler)
    try:
        server.serve_forever(poll_interval=0.5)
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
    return 0
