"""Commands that talk to a run: ``status`` (one line per process), ``restart`` (a producer, gracefully),
``clean`` (what dead runs left behind), and ``bench`` (a script of ``benchmarks/``).

The flags of ``status``, ``restart`` and ``clean`` are derived from ``shared.commands.command_config.StatusConfig``,
``RestartConfig`` and ``CleanConfig`` (``specring.cli.flags.command_parser``); ``bench`` passes its arguments on.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

from specring.cli.flags import command_config, command_parser
from specring.cli.main import description
from specring.shared import paths
from specring.shared.commands.command_config import CleanConfig, RestartConfig, StatusConfig
from specring.shared.errors import ConfigError, PeerTimeout
from specring.shared.run.run_dir import RunDir
from specring.shared.run.run_records import RunStatus
from specring.supervisor.status import status_mib as _mib
from specring.supervisor.status import status_num as _num
from specring.supervisor.status import status_pct as _pct
from specring.supervisor.status import status_work as _work


def _fmt(x) -> str:
    return "-" if x is None else f"{x:.3f}"


def _address(run_dir: str) -> str:
    run = RunDir(run_dir)
    if not run.topology_file.is_file():
        raise ConfigError(f"--run-dir: {run_dir} has no topology.json (no run was started there)")
    return run.read_topology().address


def status_parser() -> argparse.ArgumentParser:
    """The parser of ``launch.py status``, derived from ``StatusConfig``."""
    return command_parser(StatusConfig, "launch.py status",
                          description=description("status") + " Exits with 1 "
                          "when no run is going in the run directory (its supervisor has exited).",
                          epilog="examples:\n"
                          "  launch.py status                         runs/latest, one line a process\n"
                          "  launch.py status --serve --port 8765     the live page, on loopback")


def restart_parser() -> argparse.ArgumentParser:
    """The parser of ``launch.py restart``, derived from ``RestartConfig``."""
    return command_parser(RestartConfig, "launch.py restart",
                          description="Gracefully restart one producer while "
                          "training goes on: it finishes its current batch, exits, and comes back as a new "
                          "generation; its published slots are still consumed.")


def clean_parser() -> argparse.ArgumentParser:
    """The parser of ``launch.py clean``, derived from ``CleanConfig``."""
    return command_parser(CleanConfig, "launch.py clean",
                          description=description("clean") + " A run whose "
                          "launcher is alive (it holds RUN_DIR/.lock) is left alone; run directories under "
                          "./runs are always looked in.")


def _options(ap: argparse.ArgumentParser, cls: type, argv: list[str]):
    """``cls`` (a command's options) from ``argv`` parsed by ``ap``; a refused value exits 2 naming the flag, as
    argparse does (``SystemExit``)."""
    try:
        return command_config(cls, ap.parse_args(argv))
    except ConfigError as e:
        ap.error(str(e))


def status_main(argv: list[str]) -> int:
    """``launch.py status --run-dir R``: one line per process from the running supervisor; ``--serve``: the live
    page of the run (``specring.supervisor.live_page``) until Ctrl-C."""
    ap = status_parser()
    opts = _options(ap, StatusConfig, argv)
    if opts.serve:
        if not Path(opts.run_dir).is_dir():
            print(f"error: --run-dir: {opts.run_dir} is not a directory (no run there yet)", file=sys.stderr)
            return 1
        if not 0 <= opts.port < 65536 or not opts.refresh_s > 0:
            ap.error("--port must be in 0..65535 and --refresh-s above 0")
        from specring.supervisor.live_page import serve
        return serve(opts.run_dir, opts.host, opts.port, opts.refresh_s)
    from specring.shared.transport import channel
    from specring.shared.transport import messages as m
    run = RunDir(opts.run_dir)
    if run.topology_file.is_file() and run.supervisor_pid() is None:
        summary = run.summary_file
        print(f"no run is going in {opts.run_dir} (its supervisor has exited)"
              + (f"; see {summary}" if summary.is_file() else ""), file=sys.stderr)
        return 1
    try:
        reply = channel.request(_address(opts.run_dir), m.Command(action="status"), timeout_s=5.0)
    except (ConfigError, PeerTimeout) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    if opts.json:
        print(json.dumps(reply.data, indent=1))
        return 0
    st = RunStatus.from_json(reply.data)
    print(f"run {st.run_id}  step {st.step}  trained {st.trained}/{st.planned} batches  loss {_fmt(st.loss)}")
    for key, what, first in (("per_step_acc", "TTT step", 0), ("per_slot_acc", "block slot", 1)):
        if st.acc_key == key and st.acc:  # the accuracy of the last optimizer step in metrics.jsonl, per position
            accs = "  ".join(f"{i + first}:{_num(a, '.3f')}" for i, a in enumerate(st.acc))
            print(f"{st.drafter or 'drafter'} accuracy per {what} (step {st.acc_step}): {accs}")
    b = st.balance or {}
    print(f"balance: producer duty cycle {_pct(b.get('producer_duty_cycle'))} (working, not waiting for a lease), "
          f"consumer starvation {_pct(b.get('consumer_starvation'))} (waiting for a batch)")
    print(f"{'process':<12}{'pid':>8}{'gen':>5} {'state':<9}{'hb_age':>7}{'tok/s':>10}{'duty':>6}{'starv':>6}"
          f"{'cpu%':>7}{'rss_MiB':>9}{'gpu_MiB':>9}{'restarts':>9}  {'ring F/W/R/r':<13} busy with")
    for r in st.rows:
        ring = r.ring
        ring_s = "{FREE}/{WRITING}/{READY}/{READING}".format(**ring) if ring else ""
        print(f"{r.name:<12}{r.pid or '-':>8}{r.generation:>5} {r.state:<9}"
              f"{_num(r.heartbeat_age_s, '.1f'):>7}{_num(r.tokens_per_s, ',.0f'):>10}"
              f"{_pct(r.duty_cycle) if r.role == 'producer' else '':>6}"
              f"{_pct(r.starvation) if r.role == 'consumer' else '':>6}"
              f"{_num(r.cpu_percent, '.0f'):>7}{_num(_mib(r.rss_bytes), '.0f'):>9}"
              f"{_num(_mib(r.gpu_mem_bytes), '.0f'):>9}{r.restarts:>9}  {ring_s:<13} {_work(r)}")
    return 0


def restart_main(argv: list[str]) -> int:
    """``launch.py restart producer N --run-dir R``: graceful restart of one producer."""
    ap = restart_parser()
    opts = _options(ap, RestartConfig, argv)
    if not 0 <= opts.index < 2**16:
        ap.error(f"argument index: no producer {opts.index} (indices start at 0)")
    from specring.shared.transport import channel
    from specring.shared.transport import messages as m
    try:
        reply = channel.request(_address(opts.run_dir), m.Command(action="restart", role=opts.role, index=opts.index))
    except (ConfigError, PeerTimeout) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(reply.text, file=sys.stdout if reply.ok else sys.stderr)
    return 0 if reply.ok else 1


def clean_main(argv: list[str]) -> int:
    """``launch.py clean``: remove segments, socket files and processes of runs whose supervisor is dead."""
    ap = clean_parser()
    opts = _options(ap, CleanConfig, argv)
    from specring.shared.process.procs import sweep_run_processes
    from specring.shared.transport.ring import run_owned, sweep_stale
    for pid, run_id, cmd in sweep_run_processes(run_owned):
        print(f"killed process {pid} of run {run_id} (its supervisor is gone): {cmd}")
    removed = sweep_stale()
    dirs = [RunDir(d) for d in opts.run_dir] + RunDir.under_runs()
    socks = []
    for d in dirs:
        for sock in d.stale_sockets():
            os.unlink(sock)
            socks.append(str(sock))
    for name in removed:
        print(f"removed segment /dev/shm/{name}")
    for s in socks:
        print(f"removed socket {s}")
    print(f"clean: {len(removed)} segment(s), {len(socks)} socket(s) removed")
    return 0


def benchmarks() -> dict[str, str]:
    """``{name: first line of its docstring}`` of the scripts in ``benchmarks/`` (read, not imported)."""
    import ast
    out = {}
    for script in sorted(paths.BENCHMARKS_DIR.glob("*.py")):
        if script.name.startswith("_"):
            continue
        try:
            doc = ast.get_docstring(ast.parse(script.read_text())) or ""
        except (OSError, SyntaxError):
            doc = ""
        out[script.stem] = doc.split("\n\n")[0].replace("``", "").replace("\n", " ").strip()
    return out


def bench_help() -> str:
    """The text of ``launch.py bench --help``: what bench does and the benchmarks there are."""
    import textwrap
    intro = (description("bench") + " It runs benchmarks/NAME.py (default: transport) with ARGS, from the "
             "checkout's root; `launch.py bench NAME --help` gives that benchmark's own flags.")
    lines = ["usage: launch.py bench [NAME] [ARGS ...]", "", textwrap.fill(intro, 100), ""]
    if paths.BENCHMARKS_DIR.is_dir():
        found = benchmarks()
        width = max(map(len, found), default=0) + 4
        lines += ["benchmarks:"] + [textwrap.fill(text, 100, initial_indent=f"  {name:<{width - 2}}",
                                                  subsequent_indent=" " * width) for name, text in found.items()]
    else:
        lines += ["The benchmarks are scripts of a specring checkout (benchmarks/), not of the installed package."]
    return "\n".join(lines)


def bench_main(argv: list[str]) -> int:
    """``launch.py bench [NAME] ARGS``: run ``benchmarks/NAME.py`` (default: transport) with ``ARGS``;
    ``--help`` first describes bench and lists the benchmarks."""
    if argv and argv[0] in ("-h", "--help"):
        print(bench_help())
        return 0
    name = argv[0] if argv and not argv[0].startswith("-") else "transport"
    rest = argv[1:] if argv and not argv[0].startswith("-") else argv
    if not paths.BENCHMARKS_DIR.is_dir():
        print("error: the benchmarks are scripts of a specring checkout (benchmarks/), not of the installed "
              "package; clone the repository to run them", file=sys.stderr)
        return 2
    script = paths.BENCHMARKS_DIR / f"{name}.py"
    if not script.is_file():
        print(f"error: no benchmark {name!r} (have: {', '.join(benchmarks())})", file=sys.stderr)
        return 2
    return subprocess.call([sys.executable, str(script), *rest], cwd=paths.PACKAGE_ROOT)
