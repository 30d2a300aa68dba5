"""The report of a run (``launch.py report``, ``cli/report.py``; written by ``train`` at the end of every run).

One self-contained HTML page (``index.html``: the plots embedded as base64 PNGs, no script, no network needed to
open it) and the same plots as PNG files beside it, drawn with matplotlib from what the run directory holds:

* ``loss.png``: the training loss against optimizer steps and against minutes (``metrics.jsonl``);
* ``accuracy.png``: the accuracy of each draft position (DFlash/DFlash2 ``per_slot_acc`` per block slot, EAGLE-3
  ``per_step_acc`` per TTT step, DFlash2's ``selector_acc`` and ``topk_recall``), against steps and minutes;
* ``tau.png``: held-out τ during training (``eval.jsonl``) against GPU-minutes and steps, with the prompt-lookup
  and untrained lines (and the trained drafter's point) of each ``--eval FILE`` (``launch.py eval --output-json``);
* ``throughput.png``: target tokens/s (trained, from the pipeline; produced, the producers' sum; the trainer's)
  and draft positions/s (positions that carry a prediction: anchors x (B - 1) for a block drafter, positions x
  TTT steps for EAGLE-3) against minutes;
* ``rings.png``: each producer ring's slots by state (free, writing, ready, reading) over time;
* ``balance.png``: producer duty cycle and consumer starvation over time, per process and for the run;
* restarts, hangs, fences, deaths, signals and resumes as marks on every time axis (``timeseries.jsonl``, else
  the lines of ``logs/supervisor.log``);
* tables: the runs at a glance, the events, ``summary.json`` and the configuration (``config.json``), one column
  per run with the rows that differ marked, and each ``--eval`` file's rows.

Minutes count the time the run's supervisor was up (a resumed run's time between sessions left out); GPU-minutes
are those minutes times the distinct GPUs of the run (``cuda`` devices of producers and consumers, times the
nodes); a CPU run counts as one device. Several run directories share every axis: lines per run in one plot, or
one column per run (rings). What is missing or truncated (a run still going, a killed supervisor, a run from
before ``timeseries.jsonl``) is named at the top of the page and in the empty plots; the report never raises on a
run directory's content. ``train`` writes ``RUN_DIR/report/`` at the end of every run; ``launch.py status --serve``
serves the same page, live (``specring.supervisor.live_page``).
"""

from __future__ import annotations

import base64
import html
import io
import itertools
import json
import math
import os
import re
import time
from dataclasses import dataclass, field
from pathlib import Path

from specring.shared.run.run_dir import (
    CHECKPOINTS_DIR,
    CONFIG_FILE,
    EVAL_FILE,
    METRICS_FILE,
    SUMMARY_FILE,
    TIMESERIES_FILE,
    RunDir,
)

# name -> (title, what it shows), in the page's order
PLOTS = {
    "loss": ("Loss", "training loss (metrics.jsonl) against optimizer steps and minutes"),
    "accuracy": ("Accuracy per draft position", ("per_slot_acc / per_step_acc (and DFlash2's selector_acc, "
                                                 "topk_recall) against optimizer steps and minutes")),
    "tau": ("Held-out τ", ("τ at checkpoints (eval.jsonl) against GPU-minutes and steps, beside the baselines of "
                           "--eval files")),
    "throughput": ("Throughput", "target tokens/s and draft positions/s against minutes"),
    "rings": ("Ring occupancy", "slots of each producer's ring by state over time (timeseries.jsonl)"),
    "balance": ("Duty cycle and starvation", ("producer duty cycle and consumer starvation over time "
                                              "(timeseries.jsonl)")),
}
# per-position metrics of metrics.jsonl: key -> (what a position is, number of the first position)
POSITION_METRICS = {
    "per_slot_acc": ("block slot", 1),
    "per_step_acc": ("TTT step", 0),
    "selector_acc": ("selector accuracy, block slot", 1),
    "topk_recall": ("top-K recall, block slot", 1),
}
# event kinds drawn on time axes: kind -> (colour, line style)
EVENT_STYLE = {
    "restart": ("tab:orange", "-"), "hang": ("tab:red", "--"), "fence": ("tab:purple", ":"),
    "death": ("black", "-"), "signal": ("tab:gray", "-."), "stall": ("tab:brown", "--"),
    "eval_failed": ("tab:red", ":"), "bad_batch": ("tab:olive", ":"), "resume": ("tab:green", "-"),
}
RING_STATES = (("free", "#d9d9d9"), ("writing", "#f28e2b"), ("ready", "#59a14f"), ("reading", "#4e79a7"))
MAX_POINTS = 4000       # points per line drawn (longer series are thinned for drawing; smoothing uses them all)
MAX_EVENT_ROWS = 200    # rows of the events table per run
LOG_EVENT_RE = re.compile(r"^(\d\d):(\d\d):(\d\d) supervisor \w+ [\w.]+: (\S+)(.*)$")


# ---------------------------------------------------------------------------------------------- reading
@dataclass
class Run:
    """What one run directory holds, read whole and checked (see ``load_run``).

    ``metrics``/``evals``: the records of ``metrics.jsonl``/``eval.jsonl``; ``samples``/``events``: of
    ``timeseries.jsonl`` (events also from ``logs/supervisor.log`` when there is no time series, and the resumes);
    ``sessions``: ``(start, end)`` epoch seconds of each supervisor session; ``problems``: one sentence per file
    that is missing, truncated or unreadable, saying what the report lacks because of it."""
    path: Path
    name: str
    config: dict = field(default_factory=dict)
    summary: dict = field(default_factory=dict)
    metrics: list = field(default_factory=list)
    evals: list = field(default_factory=list)
    samples: list = field(default_factory=list)
    events: list = field(default_factory=list)
    sessions: list = field(default_factory=list)
    problems: list = field(default_factory=list)

    @property
    def gpus(self) -> int:
        """Distinct CUDA devices of the run's producers and consumers, times its nodes (0 on CPU)."""
        devs = set()
        for group in list(_get(self.config, "producer", "devices") or []) + list(_get(self.config, "trainer",
                                                                                      "devices") or []):
            devs.update(d for d in str(group).split("+") if d.startswith("cuda"))
        nodes = _get(self.config, "nodes", "nnodes")
        return len(devs) * (int(nodes) if isinstance(nodes, int) and nodes > 0 else 1)

    def minutes(self, t: float) -> float:
        """Minutes of the run at epoch second ``t``: time the supervisor was up since the run began (time between
        sessions of a resumed run left out; before the first session: negative)."""
        if not self.sessions:
            return 0.0
        acc = 0.0
        for i, (s, e) in enumerate(self.sessions):
            last = i == len(self.sessions) - 1
            if t < s:
                return (acc if i else t - s) / 60.0
            if t <= e or last:
                return (acc + t - s) / 60.0
            acc += e - s
        return acc / 60.0

    def device_minutes(self, t: float) -> float:
        """GPU-minutes at ``t`` (``minutes(t)`` times ``gpus``; a CPU run counts as one device)."""
        return self.minutes(t) * max(1, self.gpus)


@dataclass
class _Jsonl:
    """What has been read of one JSON-lines file (for ``read_jsonl``'s ``cache``): its inode, the offset just past
    the last whole line read, and the counts so far."""
    ino: int = -1
    offset: int = 0
    lines: int = 0
    records: list = field(default_factory=list)
    bad: int = 0
    lacking: int = 0
    first_bad: int | None = None


def read_jsonl(path: Path, what: str, problems: list[str], missing: str, need: tuple[str, ...] = (),
               cache: dict | None = None) -> list[dict]:
    """The records of a JSON-lines file (those with every key of ``need``), appending to ``problems`` a sentence
    when it is missing (``missing``: what that means) or when lines do not parse (a truncated last line of a
    killed process, or garbage) or lack a needed key.

    ``cache`` (a dict kept by the caller, the live page): read only what was appended since the last call, and
    leave a last line without its newline for the next call (it is being written) instead of counting it; a
    file that shrank or was replaced is read again from its start."""
    if not path.is_file():
        problems.append(f"{what}: missing ({missing})")
        return []
    try:
        with open(path, "rb") as f:
            st = os.fstat(f.fileno())
            state = cache.get(str(path)) if cache is not None else None
            if state is None or state.ino != st.st_ino or st.st_size < state.offset:
                state = _Jsonl(ino=st.st_ino)
            f.seek(state.offset)
            raw = f.read()
    except OSError as e:
        problems.append(f"{what}: unreadable ({e}): {missing}")
        return []
    torn_tail = b""
    if cache is not None and raw and not raw.endswith(b"\n"):
        cut = raw.rfind(b"\n") + 1
        raw, torn_tail = raw[:cut], raw[cut:]
    lines = raw.splitlines()
    for n, line in enumerate(lines, state.lines + 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except ValueError:
            state.bad += 1
            state.first_bad = state.first_bad or n
            continue
        if not isinstance(rec, dict):
            state.bad += 1
            state.first_bad = state.first_bad or n
        elif any(rec.get(k) is None or (k in ("step", "time") and not _finite(rec[k])) for k in need):
            state.lacking += 1
        else:
            state.records.append(rec)
    state.lines += len(lines)
    state.offset += len(raw)
    if cache is not None:
        cache[str(path)] = state
    if state.bad:
        torn = " (the last line is cut short: a process was killed while writing it)" \
            if state.first_bad == state.lines and state.bad == 1 and not raw.endswith(b"\n") and not torn_tail else ""
        problems.append(f"{what}: {state.bad} of {state.lines} lines did not parse, first at line {state.first_bad}"
                        f"{torn}; they are left out")
    if state.lacking:
        problems.append(f"{what}: {state.lacking} records without {'/'.join(need)} left out")
    return list(state.records)


def read_json(path: Path, what: str, problems: list[str], missing: str) -> dict:
    """A JSON object file, ``{}`` with a sentence in ``problems`` when it is missing, truncated or not an object."""
    if not path.is_file():
        problems.append(f"{what}: missing ({missing})")
        return {}
    try:
        d = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        problems.append(f"{what}: unreadable, truncated or corrupt ({e}): {missing}")
        return {}
    if not isinstance(d, dict):
        problems.append(f"{what}: not a JSON object: {missing}")
        return {}
    return d


def load_run(path: str | Path, cache: dict | None = None) -> Run:
    """Read a run directory for the report; never raises on its content (``Run.problems`` says what is missing).
    ``cache``: kept by a caller that reads the same run again and again (the live page; see ``read_jsonl``).
    Raises ``FileNotFoundError`` when ``path`` is not a directory."""
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"{path}: no such run directory")
    real = path.resolve()
    run = Run(path=path, name=real.name or str(path))
    rundir = RunDir(path)
    p = run.problems
    run.config = read_json(rundir.config_file, CONFIG_FILE, p,
                           "written when the run starts: no configuration table; GPU-minutes count one device")
    run.summary = read_json(rundir.summary_file, SUMMARY_FILE, p,
                            "written when the run ends: it is still going, or its supervisor was killed")
    run.metrics = read_jsonl(rundir.metrics_file, METRICS_FILE, p,
                             "no optimizer step recorded: no loss, accuracy or draft throughput",
                             need=("step", "time"), cache=cache)
    run.evals = read_jsonl(rundir.eval_file, EVAL_FILE, p,
                           "no τ evaluation during training: --eval-prompts 0, or no checkpoint reached yet",
                           need=("step", "time"), cache=cache)
    ts_missing = ("no ring occupancy, duty cycle or starvation over time (runs from before timeseries.jsonl do "
                  "not have it); minutes count from the first optimizer step")
    recs = read_jsonl(rundir.timeseries_file, TIMESERIES_FILE, p, ts_missing, need=("kind", "time"), cache=cache)
    run.samples = [r for r in recs if r["kind"] == "sample"]
    run.events = [{"time": float(r["time"]), "event": str(r.get("event")), "text": str(r.get("text", ""))}
                  for r in recs if r["kind"] == "event"]
    starts = [i for i, r in enumerate(recs) if r["kind"] == "start"]
    for j, i in enumerate(starts):
        chunk = recs[i:starts[j + 1] if j + 1 < len(starts) else len(recs)]
        run.sessions.append((float(recs[i]["time"]), max(float(r["time"]) for r in chunk)))
        if recs[i].get("resume"):
            run.events.append({"time": float(recs[i]["time"]), "event": "resume", "text": "resume: a supervisor "
                               "started again on the run directory"})
    dropped = sum(int(r.get("events_dropped") or 0) for r in recs if r["kind"] == "stop")
    if dropped:
        p.append(f"{TIMESERIES_FILE}: {dropped} events beyond its bound were not recorded (see logs/supervisor.log)")
    if not run.sessions:  # no time series: the run's clock starts at its first record
        times = [float(r["time"]) for r in run.metrics + run.evals if _finite(r.get("time"))]
        if times:
            run.sessions = [(min(times), max(times))]
        run.events = _log_events(path, run.sessions[0][0] if run.sessions else None, p)
    else:  # metrics written after the last sample still belong to the last session
        times = [float(r["time"]) for r in run.metrics + run.evals if _finite(r.get("time"))]
        if times and max(times) > run.sessions[-1][1]:
            run.sessions[-1] = (run.sessions[-1][0], max(times))
    run.events.sort(key=lambda e: e["time"])
    return run


def _log_events(run_dir: Path, t0: float | None, problems: list[str]) -> list[dict]:
    """Events from the lines of ``logs/supervisor.log`` (``HH:MM:SS supervisor LEVEL logger: word ...``), for a
    run without ``timeseries.jsonl``: the clock time of day is placed on the first day at or after ``t0`` that
    keeps the lines in order (second resolution; local time)."""
    from specring.supervisor.timeseries import EVENTS
    log_path = RunDir(run_dir).log_file("supervisor")
    if t0 is None or not log_path.is_file():
        return []
    try:
        lines = log_path.read_text(errors="replace").splitlines()
    except OSError:
        return []
    out: list[dict] = []
    lt = time.localtime(t0)
    day0 = time.mktime((lt.tm_year, lt.tm_mon, lt.tm_mday, 0, 0, 0, 0, 0, -1))
    day, prev = day0, None
    for line in lines:
        m = LOG_EVENT_RE.match(line)
        if not m:
            continue
        secs = int(m.group(1)) * 3600 + int(m.group(2)) * 60 + int(m.group(3))
        if prev is not None and secs < prev - 3600:  # past midnight
            day += 86400
        prev = secs
        name = EVENTS.get(m.group(4).split("=", 1)[0])
        if name is not None and name != "checkpoint":
            out.append({"time": day + secs, "event": name, "text": (m.group(4) + m.group(5))[:300]})
    if out:
        problems.append("events: taken from logs/supervisor.log (no timeseries.jsonl), placed to the second")
    return out


def load_eval_json(path: str | Path) -> dict:
    """An eval JSON of ``launch.py eval --output-json``; raises ``ValueError`` naming the file when it is missing,
    unreadable or has no ``rows``."""
    path = Path(path)
    try:
        d = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"--eval {path}: unreadable ({e})") from None
    if not isinstance(d, dict) or not isinstance(d.get("rows"), list):
        raise ValueError(f"--eval {path}: not an eval JSON of `launch.py eval --output-json` (no rows)")  # noqa: TRY004
    d["_name"] = path.stem
    return d


# ---------------------------------------------------------------------------------------------- plotting
def _figure(width: float, height: float, rows: int = 1, cols: int = 1, **kw):
    """A matplotlib ``Figure`` (object API: no pyplot state, safe beside other threads) and its axes grid."""
    from matplotlib.figure import Figure
    fig = Figure(figsize=(width, height), layout="constrained")
    axes = fig.subplots(rows, cols, squeeze=False, **kw)
    return fig, axes


def _png(fig) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=90)
    return buf.getvalue()


def _empty(ax, text: str) -> None:
    """Clear ``ax`` (event marks included) and say in it what is missing."""
    ax.cla()
    ax.text(0.5, 0.5, text, ha="center", va="center", wrap=True, fontsize=10, color="dimgray",
            transform=ax.transAxes)
    ax.set_xticks([])
    ax.set_yticks([])


def _thin(xs: list, ys: list) -> tuple[list, list]:
    step = max(1, math.ceil(len(xs) / MAX_POINTS))
    return xs[::step], ys[::step]


def _smooth(ys: list[float], window: int) -> list[float]:
    """Trailing moving average over ``window`` values, skipping NaN."""
    if window <= 1:
        return ys
    out, acc, cnt, q = [], 0.0, 0, []
    for y in ys:
        q.append(y)
        if not math.isnan(y):
            acc, cnt = acc + y, cnt + 1
        if len(q) > window:
            old = q.pop(0)
            if not math.isnan(old):
                acc, cnt = acc - old, cnt - 1
        out.append(acc / cnt if cnt else float("nan"))
    return out


def _window(n: int) -> int:
    return max(1, n // 40)


def _style(i: int) -> dict:
    return {"color": f"C{i % 10}", "linestyle": ("-", "--", ":", "-.")[(i // 10) % 4]}


def _mark_events(ax, run: Run, seen: set, device: bool = False) -> None:
    """Vertical marks at ``run``'s events on a minutes axis (GPU-minutes with ``device``); ``seen`` collects the
    kinds drawn, for the legend."""
    for ev in run.events:
        style = EVENT_STYLE.get(ev["event"])
        if style is None:
            continue
        x = run.device_minutes(ev["time"]) if device else run.minutes(ev["time"])
        ax.axvline(x, color=style[0], linestyle=style[1], linewidth=1, alpha=0.7, zorder=1)
        seen.add(ev["event"])


def _event_legend(fig, seen: set) -> None:
    if not seen:
        return
    from matplotlib.lines import Line2D
    handles = [Line2D([], [], color=EVENT_STYLE[k][0], linestyle=EVENT_STYLE[k][1]) for k in EVENT_STYLE if k in seen]
    fig.legend(handles, [k for k in EVENT_STYLE if k in seen], loc="outside lower center", ncols=len(handles),
               fontsize=8, title="events", title_fontsize=8)


def _steps_done(m: dict) -> float:
    return float(m["step"]) + 1.0


def plot_loss(runs: list[Run]):
    """Loss against steps and minutes, a line per run (smoothed, the raw values faint); log scale when the loss
    spans more than a factor of 10. Returns ``(figure, empty)``."""
    fig, ax = _figure(11, 3.8, 1, 2, sharey=True)
    seen: set = set()
    drawn = False
    spans = []
    for i, run in enumerate(runs):
        pts = [(m, _f(m.get("loss"))) for m in run.metrics if not m.get("skipped")]
        pts = [(m, y) for m, y in pts if not math.isnan(y)]
        if not pts:
            continue
        drawn = True
        ys = [y for _, y in pts]
        spans += [min(ys), max(ys)]
        sm = _smooth(ys, _window(len(ys)))
        for col, xs in ((0, [_steps_done(m) for m, _ in pts]), (1, [run.minutes(m["time"]) for m, _ in pts])):
            ax[0][col].plot(*_thin(xs, ys), alpha=0.25, linewidth=0.8, **_style(i))
            ax[0][col].plot(*_thin(xs, sm), label=run.name, linewidth=1.6, **_style(i))
        _mark_events(ax[0][1], run, seen)
    if not drawn:
        for a in ax[0]:
            _empty(a, "no loss: metrics.jsonl is missing or empty")
        return fig, True
    if spans and min(spans) > 0 and max(spans) / min(spans) > 10:
        ax[0][0].set_yscale("log")
    ax[0][0].set_xlabel("optimizer steps")
    ax[0][1].set_xlabel("minutes")
    ax[0][0].set_ylabel("loss")
    ax[0][0].legend(fontsize=8)
    for a in ax[0]:
        a.grid(alpha=0.3)
    _event_legend(fig, seen)
    return fig, False


def plot_accuracy(runs: list[Run]):
    """A row per per-position metric present (``POSITION_METRICS``), columns steps and minutes: a line per
    position (at most 8, spread over the block, colour by position) and run (line style by run)."""
    keys = [k for k in POSITION_METRICS if any(isinstance(m.get(k), list) for r in runs for m in r.metrics)]
    if not keys:
        fig, ax = _figure(11, 3.0, 1, 2)
        for a in ax[0]:
            _empty(a, "no per-position accuracy: metrics.jsonl is missing or has none")
        return fig, True
    from matplotlib import colormaps
    cmap = colormaps["viridis"]
    fig, ax = _figure(11, 3.2 * len(keys) + 0.6, len(keys), 2, sharey="row")
    seen: set = set()
    run_styles = ("-", "--", ":", "-.")
    for row, key in enumerate(keys):
        what, first = POSITION_METRICS[key]
        handles = {}
        for i, run in enumerate(runs):
            ms = [m for m in run.metrics if isinstance(m.get(key), list) and not m.get("skipped")]
            if not ms:
                continue
            drawn_before = bool(handles)
            n = max(len(m[key]) for m in ms)
            chosen = sorted({round(j * (n - 1) / 7) for j in range(8)}) if n > 8 else list(range(n))
            for j in chosen:
                ys = [_f(m[key][j]) if j < len(m[key]) else float("nan") for m in ms]
                sm = _smooth(ys, _window(len(ys)))
                color = cmap(j / max(1, n - 1) * 0.9)
                for col, xs in ((0, [_steps_done(m) for m in ms]), (1, [run.minutes(m["time"]) for m in ms])):
                    line, = ax[row][col].plot(*_thin(xs, sm), color=color, linestyle=run_styles[i % 4],
                                              linewidth=1.3)
                    if col == 0 and not drawn_before:
                        handles[f"{what} {j + first}"] = line
            _mark_events(ax[row][1], run, seen)
        ax[row][0].set_ylabel(key)
        ax[row][0].set_ylim(-0.02, 1.02)
        leg = ax[row][0].legend(list(handles.values()), list(handles), fontsize=7, ncols=2)
        if len(runs) > 1 and row == 0:
            from matplotlib.lines import Line2D
            ax[row][0].add_artist(leg)
            ax[row][1].legend([Line2D([], [], color="k", linestyle=run_styles[i % 4]) for i in range(len(runs))],
                              [r.name for r in runs], fontsize=7, title="runs", title_fontsize=7)
        for a in ax[row]:
            a.grid(alpha=0.3)
    ax[-1][0].set_xlabel("optimizer steps (moving average over 1/40 of each run)")
    ax[-1][1].set_xlabel("minutes")
    _event_legend(fig, seen)
    return fig, False


def _eval_points(evals: list[dict]) -> tuple[list[dict], list[dict]]:
    ok = [e for e in evals if _finite(e.get("tau_mean")) and not e.get("error")]
    failed = [e for e in evals if e.get("error") or e.get("tau_mean") is None]
    return ok, failed


def _run_of(drafter: str | None, runs: list[Run]) -> tuple[Run | None, int | None]:
    """The run (and checkpoint step) that an eval JSON's ``drafter`` path names (``.../RUN/checkpoints/step-N``)."""
    if not drafter:
        return None, None
    parts = Path(drafter).parts
    m = re.search(r"step-(\d+)", drafter)
    step = int(m.group(1)) if m else None
    for run in runs:
        name = run.path.resolve().name
        if str(Path(drafter).resolve()).startswith(str(run.path.resolve()) + "/") or \
                (CHECKPOINTS_DIR in parts and parts.index(CHECKPOINTS_DIR) > 0
                 and parts[parts.index(CHECKPOINTS_DIR) - 1] == name) or (parts and parts[-1] == name):
            return run, step
    return None, step


def _time_at_step(run: Run, step: int | None) -> float | None:
    """The epoch time by which ``run`` had done ``step`` optimizer steps (its metrics record ``step - 1``)."""
    if step is None:
        return run.sessions[-1][1] if run.sessions else None
    best = None
    for m in run.metrics:
        if _steps_done(m) <= step:
            best = float(m["time"])
    return best if best is not None else (run.sessions[-1][1] if run.sessions else None)


def plot_tau(runs: list[Run], evals: list[dict]):
    """τ during training against GPU-minutes and steps, a line per run; failed evaluations as red crosses at the
    bottom; each eval JSON's prompt-lookup (dashed) and untrained (dotted) rows as horizontal lines and its trained
    drafter as a star where its checkpoint was."""
    fig, ax = _figure(11, 4.0, 1, 2, sharey=True)
    seen: set = set()
    drawn = False
    any_gpu = any(r.gpus for r in runs)
    for i, run in enumerate(runs):
        ok, failed = _eval_points(run.evals)
        if ok:
            drawn = True
            ax[0][0].plot([run.device_minutes(e["time"]) for e in ok], [float(e["tau_mean"]) for e in ok],
                          marker="o", label=f"{run.name} (eval.jsonl)", **_style(i))
            ax[0][1].plot([float(e["step"]) for e in ok], [float(e["tau_mean"]) for e in ok], marker="o",
                          label=run.name, **_style(i))
        for e in failed:
            drawn = True
            ax[0][0].plot([run.device_minutes(e["time"])], [1.0], marker="x", color="tab:red", markersize=9)
            ax[0][1].plot([float(e["step"])], [1.0], marker="x", color="tab:red", markersize=9)
        _mark_events(ax[0][0], run, seen, device=True)
    grays = ("dimgray", "darkgoldenrod", "teal", "slateblue")
    for j, ev in enumerate(evals):
        multi = len({r.get("dataset") for r in ev["rows"]}) > 1
        for row in ev["rows"]:
            name, tau = str(row.get("drafter", "")), row.get("tau_mean")
            if not _finite(tau) or name.startswith("target greedy"):
                continue
            drawn = True
            label = f"{ev['_name']}: {name}" + (f" [{row.get('dataset')}]" if multi else "") + f" τ={float(tau):.2f}"
            if name.startswith("prompt-lookup") or name.endswith("untrained"):
                for a in ax[0]:
                    a.axhline(float(tau), color=grays[j % len(grays)], linewidth=1.2,
                              linestyle="--" if name.startswith("prompt-lookup") else ":",
                              label=label if a is ax[0][0] else None)
            else:
                run, step = _run_of(ev.get("drafter"), runs)
                if run is not None:
                    t = _time_at_step(run, step)
                    if t is not None:
                        ax[0][0].plot([run.device_minutes(t)], [float(tau)], marker="*", markersize=13,
                                      color=_style(runs.index(run))["color"], markeredgecolor="k", linestyle="",
                                      label=label)
                    if step is not None:
                        ax[0][1].plot([step], [float(tau)], marker="*", markersize=13, linestyle="",
                                      color=_style(runs.index(run))["color"], markeredgecolor="k")
                else:
                    for a in ax[0]:
                        a.axhline(float(tau), color=grays[j % len(grays)], linewidth=1.2, linestyle="-.",
                                  label=label if a is ax[0][0] else None)
    if not drawn:
        for a in ax[0]:
            _empty(a, "no τ: eval.jsonl is missing or empty (train --eval-prompts N measures it at checkpoints) "
                      "and no --eval file was given")
        return fig, True
    ax[0][0].set_xlabel("GPU-minutes (GPUs x minutes)" if any_gpu else "minutes (CPU run: no GPU)")
    ax[0][1].set_xlabel("optimizer steps")
    ax[0][0].set_ylabel("τ (accepted tokens per verify)")
    ax[0][0].legend(fontsize=7)
    for a in ax[0]:
        a.grid(alpha=0.3)
    _event_legend(fig, seen)
    return fig, False


def _positions_per_s(m: dict) -> float:
    """Draft positions per second of a metrics record: its trainer tokens/s times positions per token
    (``num_blocks`` x the per-position list's length, over ``num_tokens``)."""
    acc = next((m[k] for k in POSITION_METRICS if isinstance(m.get(k), list)), None)
    tps, nb, nt = _f(m.get("tokens_per_s")), _f(m.get("num_blocks")), _f(m.get("num_tokens"))
    if acc is None or math.isnan(tps) or math.isnan(nb) or math.isnan(nt) or not nt:
        return float("nan")
    return tps * nb * len(acc) / nt


def plot_throughput(runs: list[Run]):
    """Target tokens/s (trained: the difference of the pipeline's trained tokens between samples; produced: the
    sum of the producers' own rates; trainer: metrics.jsonl's, smoothed) and draft positions/s, against minutes."""
    fig, ax = _figure(11, 3.8, 1, 2)
    seen: set = set()
    drawn = [False, False]
    for i, run in enumerate(runs):
        st = _style(i)
        s = run.samples
        if len(s) > 1:
            xs, ys = [], []
            for a, b in itertools.pairwise(s):
                dt = float(b["time"]) - float(a["time"])
                d = _f(b.get("tokens_trained")) - _f(a.get("tokens_trained"))
                if dt > 0 and not math.isnan(d) and d >= 0:
                    xs.append(run.minutes(float(b["time"])))
                    ys.append(d / dt)
            if xs:
                drawn[0] = True
                ax[0][0].plot(*_thin(xs, _smooth(ys, 5)), label=f"{run.name}: trained", color=st["color"],
                              linewidth=1.6)
            prod = [(run.minutes(float(x["time"])), sum(_f(p.get("tokens_per_s")) for p in x.get("producers") or []
                                                        if _finite(p.get("tokens_per_s"))))
                    for x in s if any(_finite(p.get("tokens_per_s")) for p in x.get("producers") or [])]
            if prod:
                drawn[0] = True
                ax[0][0].plot(*_thin([p[0] for p in prod], [p[1] for p in prod]), label=f"{run.name}: produced",
                              color=st["color"], linestyle="--", linewidth=1.0)
        ms = [m for m in run.metrics if _finite(m.get("tokens_per_s"))]
        if ms:
            drawn[0] = True
            xs = [run.minutes(m["time"]) for m in ms]
            ax[0][0].plot(*_thin(xs, _smooth([float(m["tokens_per_s"]) for m in ms], _window(len(ms)))),
                          label=f"{run.name}: trainer", color=st["color"], linestyle=":", linewidth=1.2)
            pos = [_positions_per_s(m) for m in ms]
            if any(not math.isnan(p) for p in pos):
                drawn[1] = True
                ax[0][1].plot(*_thin(xs, _smooth(pos, _window(len(ms)))), label=run.name, **st)
        for a in ax[0]:
            _mark_events(a, run, seen)
    if not drawn[0]:
        _empty(ax[0][0], "no target tokens/s: neither timeseries.jsonl nor metrics.jsonl has them")
    else:
        ax[0][0].set_ylabel("target tokens/s")
        ax[0][0].legend(fontsize=7)
    if not drawn[1]:
        _empty(ax[0][1], "no draft positions/s: metrics.jsonl is missing or empty")
    else:
        ax[0][1].set_ylabel("draft positions/s (trainer)")
        ax[0][1].legend(fontsize=7)
    for a in ax[0]:
        a.set_xlabel("minutes")
        a.grid(alpha=0.3)
    _event_legend(fig, seen)
    return fig, not any(drawn)


def plot_rings(runs: list[Run]):
    """Stacked slot counts by state over minutes: a row per producer ring (at most 8 drawn), a column per run;
    axes shared."""
    nprod = max([max((len(x.get("producers") or []) for x in r.samples), default=0) for r in runs] + [0])
    if nprod == 0:
        fig, ax = _figure(11, 3.0, 1, max(1, len(runs)))
        for a, r in zip(ax[0], runs):
            _empty(a, f"{r.name}: no ring occupancy (timeseries.jsonl is missing or has no sample)")
            a.set_title(r.name, fontsize=9)
        return fig, True
    rows = min(nprod, 8)
    fig, ax = _figure(max(6, 5.5 * len(runs)), 1.9 * rows + 1.0, rows, len(runs), sharex=True, sharey=True)
    seen: set = set()
    for c, run in enumerate(runs):
        ax[0][c].set_title(run.name, fontsize=9)
        for p in range(rows):
            a = ax[p][c]
            pts = [(run.minutes(float(x["time"])), (x.get("producers") or [])[p].get("ring"))
                   for x in run.samples if len(x.get("producers") or []) > p]
            pts = [(t, r) for t, r in pts if isinstance(r, list) and len(r) == 4]
            if not pts:
                _empty(a, "no samples")
                continue
            xs = [t for t, _ in pts]
            a.stackplot(xs, *[[r[k] for _, r in pts] for k in range(4)], colors=[c_ for _, c_ in RING_STATES],
                        labels=[n for n, _ in RING_STATES], step="post")
            _mark_events(a, run, seen)
            if c == 0:
                a.set_ylabel(f"ring {p}\nslots", fontsize=8)
        ax[-1][c].set_xlabel("minutes")
    ax[0][0].legend(fontsize=7, loc="upper right", ncols=4)
    if nprod > rows:
        fig.suptitle(f"first {rows} of {nprod} producer rings", fontsize=9)
    _event_legend(fig, seen)
    return fig, False


def plot_balance(runs: list[Run]):
    """Producer duty cycle and consumer starvation against minutes: the run's (thick) and each process's (thin)."""
    fig, ax = _figure(11, 3.6, 1, 2, sharey=True)
    seen: set = set()
    drawn = False
    for i, run in enumerate(runs):
        st = _style(i)
        for col, (key, side, per) in enumerate((("producer_duty_cycle", "producers", "duty_cycle"),
                                                ("consumer_starvation", "consumers", "starvation"))):
            pts = [(run.minutes(float(x["time"])), float(x[key])) for x in run.samples if _finite(x.get(key))]
            if pts:
                drawn = True
                ax[0][col].plot(*_thin([p[0] for p in pts], [p[1] for p in pts]), label=run.name, linewidth=2,
                                **st)
            n = max((len(x.get(side) or []) for x in run.samples), default=0)
            for k in range(n):
                pp = [(run.minutes(float(x["time"])), float(x[side][k][per])) for x in run.samples
                      if len(x.get(side) or []) > k and _finite(x[side][k].get(per))]
                if pp:
                    drawn = True
                    ax[0][col].plot(*_thin([p[0] for p in pp], [p[1] for p in pp]), linewidth=0.7, alpha=0.5,
                                    color=st["color"])
            _mark_events(ax[0][col], run, seen)
    if not drawn:
        for a in ax[0]:
            _empty(a, "no duty cycle or starvation over time: timeseries.jsonl is missing or has no sample "
                      "after the first batch")
        return fig, True
    ax[0][0].set_title("producer duty cycle (working, not waiting for a slot)", fontsize=9)
    ax[0][1].set_title("consumer starvation (waiting for a batch)", fontsize=9)
    ax[0][0].set_ylim(-0.02, 1.02)
    ax[0][0].legend(fontsize=7)
    for a in ax[0]:
        a.set_xlabel("minutes")
        a.grid(alpha=0.3)
    _event_legend(fig, seen)
    return fig, False


@dataclass
class Plot:
    """One rendered plot: ``name`` (a key of ``PLOTS``), PNG bytes, ``empty`` (nothing to draw: the image says
    what is missing), ``error`` (the plot itself failed: the image says so)."""
    name: str
    png: bytes
    empty: bool
    error: str = ""


def render_plots(runs: list[Run], evals: list[dict]) -> list[Plot]:
    """Every plot of ``PLOTS`` for ``runs`` (several share the axes); a plot that fails is an image saying so."""
    makers = {"loss": lambda: plot_loss(runs), "accuracy": lambda: plot_accuracy(runs),
              "tau": lambda: plot_tau(runs, evals), "throughput": lambda: plot_throughput(runs),
              "rings": lambda: plot_rings(runs), "balance": lambda: plot_balance(runs)}
    out = []
    for name in PLOTS:
        try:
            fig, empty = makers[name]()
            out.append(Plot(name, _png(fig), empty))
        except Exception as e:  # noqa: BLE001 - one plot's failure must not cost the others (nor a traceback)
            fig, ax = _figure(8, 2.0)
            _empty(ax[0][0], f"this plot failed: {type(e).__name__}: {e}")
            out.append(Plot(name, _png(fig), True, f"{type(e).__name__}: {e}"))
    return out


# ---------------------------------------------------------------------------------------------- tables and page
def _flatten(d, prefix: str = "") -> dict[str, str]:
    out: dict[str, str] = {}
    if isinstance(d, dict):
        for k, v in d.items():
            key = f"{prefix}.{k}" if prefix else str(k)
            if isinstance(v, dict) and v:
                out.update(_flatten(v, key))
            else:
                out[key] = _cell(v)
    return out


def _cell(v) -> str:
    if isinstance(v, float):
        return f"{v:,.0f}" if abs(v) >= 1000 else f"{v:.4g}"
    if isinstance(v, (list, dict)):
        s = json.dumps(v)
        return s if len(s) <= 160 else s[:157] + "..."
    return "" if v is None else str(v)


def _table(tid: str, head: list[str], rows: list[list[str]], marked: set[int] | None = None) -> str:
    """An HTML table (``id=tid``); cells are escaped; rows whose index is in ``marked`` get class ``differs``."""
    h = "".join(f"<th>{html.escape(x)}</th>" for x in head)
    differs = ' class="differs"'
    body = "".join(f"<tr{differs if marked and n in marked else ''}>"
                   + "".join(f"<td>{html.escape(c)}</td>" for c in r) + "</tr>" for n, r in enumerate(rows))
    return f'<table id="{tid}"><thead><tr>{h}</tr></thead><tbody>{body}</tbody></table>'


def _compare_table(tid: str, runs: list[Run], dicts: list[dict], drop: tuple[str, ...] = ()) -> str:
    flats = [_flatten(d) for d in dicts]
    keys: list[str] = []
    for f in flats:
        keys += [k for k in f if k not in keys and not k.startswith(drop)]
    if not keys:
        return f'<p class="empty" id="{tid}">nothing to show (the file is missing: see above)</p>'
    rows = [[k] + [f.get(k, "") for f in flats] for k in keys]
    marked = {n for n, r in enumerate(rows) if len(set(r[1:])) > 1} if len(runs) > 1 else set()
    return _table(tid, ["field"] + [r.name for r in runs], rows, marked)


def runs_table(runs: list[Run]) -> str:
    """The runs at a glance: drafter, outcome, steps, loss, tokens/s, time, τ, GPUs, events."""
    head = ["run", "path", "drafter", "exit", "steps", "batches trained/planned", "loss first → last", "tokens/s",
            "elapsed s", "τ last (step)", "GPUs", "restarts", "hangs", "fences"]
    rows = []
    for r in runs:
        s, m = r.summary, r.metrics
        loss = [x for x in (_f(x.get("loss")) for x in m) if not math.isnan(x)]
        tau = s.get("tau_last") or next(({"step": e["step"], "tau_mean": e["tau_mean"]} for e in reversed(r.evals)
                                         if _finite(e.get("tau_mean"))), None)
        count = {k: sum(e["event"] == k for e in r.events) for k in ("restart", "hang", "fence")}
        rows.append([r.name, str(r.path), str(_get(r.config, "trainer", "drafter") or "?"),
                     str(s.get("exit_reason", "running or killed (no summary.json)")),
                     str(int(m[-1]["step"]) + 1 if m else 0),
                     f"{s.get('trained_batches', '-')}/{s.get('planned_batches', '-')}",
                     f"{loss[0]:.3f} → {loss[-1]:.3f}" if loss else "-",
                     _cell(s.get("tokens_per_s")) or "-", _cell(s.get("elapsed_s")) or "-",
                     f"{float(tau['tau_mean']):.3f} ({tau['step']})" if tau else "-",
                     str(r.gpus) if r.gpus else "CPU", str(sum((s.get("restarts") or {}).values()) if isinstance(
                         s.get("restarts"), dict) else count["restart"]), str(count["hang"]), str(count["fence"])])
    return _table("table-runs", head, rows)


def events_table(runs: list[Run]) -> str:
    rows = []
    for r in runs:
        evs = [e for e in r.events if e["event"] != "checkpoint"]
        for e in evs[:MAX_EVENT_ROWS]:
            rows.append([r.name, f"{r.minutes(e['time']):.2f}", e["event"], e["text"]])
        if len(evs) > MAX_EVENT_ROWS:
            rows.append([r.name, "", "...", f"{len(evs) - MAX_EVENT_ROWS} more (timeseries.jsonl)"])
    if not rows:
        return '<p id="table-events" class="empty">no restart, hang, fence, death or signal recorded</p>'
    return _table("table-events", ["run", "minute", "event", "line"], rows)


def evals_table(evals: list[dict]) -> str:
    rows = [[ev["_name"], str(r.get("dataset", "")), str(r.get("drafter", "")), _cell(r.get("num_prompts")),
             _cell(r.get("tau_mean")), _cell(r.get("forwards_per_token")), _cell(r.get("tokens_per_s")),
             _cell(r.get("speedup"))] for ev in evals for r in ev["rows"]]
    return _table("table-eval", ["file", "dataset", "drafter", "prompts", "τ mean", "fwd/tok", "tokens/s",
                                 "speed-up"], rows)


CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,sans-serif;margin:1.2em 2em;color:#222;max-width:1400px}
h1{font-size:1.4em;margin-bottom:.2em} h2{font-size:1.15em;margin-top:1.6em;border-bottom:1px solid #ddd}
.meta{color:#555;font-size:.9em} figure{margin:1em 0} figure img{max-width:100%;border:1px solid #eee}
figcaption{color:#555;font-size:.85em} table{border-collapse:collapse;font-size:.82em;margin:.5em 0}
td,th{border:1px solid #ddd;padding:2px 6px;text-align:left;vertical-align:top} th{background:#f4f4f4}
tr.differs td{background:#fff6d5} #missing li{color:#8a4b00} .ok{color:#2d6a2d} .empty{color:#777}
.state-running{color:#2d6a2d} .state-failed,.state-exited{color:#a00}
"""


def safe_table(tid: str, make) -> str:
    """``make()``'s table, or a line saying it failed (a value of an unexpected type in a run's files)."""
    try:
        return make()
    except Exception as e:  # noqa: BLE001 - one table's failure must not cost the page
        return f'<p id="{tid}" class="empty">this table failed: {html.escape(f"{type(e).__name__}: {e}")}</p>'


def render_page(runs: list[Run], evals: list[dict], plots: list[Plot], title: str, live: str = "",
                head_extra: str = "") -> str:
    """The report's HTML: ``live`` (an HTML fragment: the process table) goes first when given; every plot
    embedded as a base64 PNG (``<figure class="plot" data-plot=NAME>``), then the tables."""
    esc = html.escape
    parts = [f"<h1>{esc(title)}</h1>",
             f'<p class="meta">generated {esc(time.strftime("%Y-%m-%d %H:%M:%S %Z"))} by specring from '
             + ", ".join(f"<code>{esc(str(r.path))}</code>" for r in runs) + "</p>"]
    if live:
        parts.append(live)
    problems = [(r.name, p) for r in runs for p in r.problems] + [("plot " + p.name, p.error) for p in plots
                                                                    if p.error]
    parts.append('<section id="missing"><h2>Missing or unreadable</h2>')
    if problems:
        parts.append("<ul>" + "".join(f'<li data-run="{esc(n)}"><b>{esc(n)}</b>: {esc(p)}</li>' for n, p in problems)
                     + "</ul>")
    else:
        parts.append('<p class="ok">nothing: every file of the run directory was read whole</p>')
    parts.append("</section>")
    parts.append('<section id="runs"><h2>Runs</h2>' + safe_table("table-runs", lambda: runs_table(runs))
                 + "</section>")
    parts.append('<section id="plots"><h2>Plots</h2>')
    for p in plots:
        t, what = PLOTS[p.name]
        parts.append(f'<figure class="plot" id="plot-{p.name}" data-plot="{p.name}" data-empty="{int(p.empty)}">'
                     f'<img alt="{esc(t)}" src="data:image/png;base64,{base64.b64encode(p.png).decode()}">'
                     f"<figcaption><b>{esc(t)}</b>: {esc(what)}</figcaption></figure>")
    parts.append("</section>")
    parts.append('<section id="events"><h2>Restarts, hangs, fences</h2>'
                 + safe_table("table-events", lambda: events_table(runs)) + "</section>")
    if evals:
        parts.append('<section id="evals"><h2>Evaluations (--eval)</h2>'
                     + safe_table("table-eval", lambda: evals_table(evals)) + "</section>")
    for tid, sec, heading, key in (("table-summary", "summary", "Summary (summary.json)", "summary"),
                                 ("table-config", "config", "Configuration (config.json)", "config")):
        parts.append(f'<section id="{sec}"><h2>{heading}</h2>'
                     + safe_table(tid, lambda tid=tid, key=key: _compare_table(tid, runs,
                                                                              [getattr(r, key) for r in runs]))
                     + "</section>")
    return ("<!doctype html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
            f"<title>{esc(title)}</title><style>{CSS}</style>{head_extra}</head><body>"
            f'<main id="report">{"".join(parts)}</main></body></html>\n')


def default_output(run_dirs: list[Path]) -> Path:
    """``RUN_DIR/report`` for one run; ``./reports/A-vs-B`` for several."""
    if len(run_dirs) == 1:
        return RunDir(run_dirs[0]).report_dir
    names = [Path(d).resolve().name for d in run_dirs]
    return Path.cwd() / "reports" / "-vs-".join(names)[:200]


def write_report(run_dirs: list[str | Path], output: str | Path | None = None,
                 eval_files: list[str | Path] = ()) -> Path:
    """Write the report of ``run_dirs`` (several share the axes) into ``output`` (default ``default_output``):
    ``index.html`` and one PNG per plot; returns the path of ``index.html``. Raises ``FileNotFoundError`` for a
    run directory that does not exist and ``ValueError`` for an unreadable ``--eval`` file; never on what a run
    directory holds."""
    runs = [load_run(d) for d in run_dirs]
    evals = [load_eval_json(f) for f in eval_files]
    plots = render_plots(runs, evals)
    out = Path(output) if output is not None else default_output([Path(d) for d in run_dirs])
    out.mkdir(parents=True, exist_ok=True)
    for p in plots:
        (out / f"{p.name}.png").write_bytes(p.png)
    title = "specring report: " + " vs ".join(r.name for r in runs)
    page = out / "index.html"
    tmp = page.with_suffix(".tmp")
    tmp.write_text(render_page(runs, evals, plots, title))
    tmp.replace(page)
    return page


def _get(d: dict, *keys):
    for k in keys:
        if not isinstance(d, dict):
            return None
        d = d.get(k)
    return d


def _finite(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _f(x) -> float:
    """``x`` as a float; NaN when it is not a finite number."""
    return float(x) if _finite(x) else float("nan")
