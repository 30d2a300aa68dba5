"""End-to-end run of the launcher with a producer killed mid-run: tokens/s, ring occupancy, recovery time.

Starts ``launch.py train FLAGS``, samples ``status.json`` twice a second (ring occupancy per producer),
SIGKILLs producer 0 at ``--kill-at-s`` (after training has started), captures ``launch.py status`` while it
restarts, and measures the time until the restarted producer has published again. Prints the summary and
one ``key=value`` line per figure.

    python benchmarks/e2e.py --kill-at-s 20 -- --producers cuda:0 --consumers cuda:1 --max-steps 200
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks.launcher import child_pid, kill_tree, start_launcher  # noqa: E402
from specring.supervisor.status import read_status_rows  # noqa: E402


def status_text(run_dir: Path) -> str:
    out = subprocess.run([sys.executable, str(REPO / "launch.py"), "status", "--run-dir", str(run_dir)],
                         capture_output=True, text=True, timeout=30)
    return out.stdout + out.stderr


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--run-dir", default="runs/e2e")
    ap.add_argument("--kill-at-s", type=float, default=0.0, help="0: no kill")
    ap.add_argument("--timeout-s", type=float, default=600)
    ap.add_argument("flags", nargs=argparse.REMAINDER)
    args = ap.parse_args(argv)
    flags = [f for f in args.flags if f != "--"]
    run_dir = Path(args.run_dir)
    log = run_dir.parent / (run_dir.name + ".launcher.log")
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    proc = start_launcher(["--run-dir", str(run_dir), *flags], log_path=log)
    t0 = time.monotonic()
    occupancy: dict[int, list[int]] = {}
    killed_at = restarted_at = republished_at = None
    statuses = []
    try:
        while proc.poll() is None and time.monotonic() - t0 < args.timeout_s:
            rows = read_status_rows(run_dir)
            for r in rows:
                if r["role"] == "producer" and r.get("ring"):
                    occupancy.setdefault(r["index"], []).append(r["ring"]["READY"] + r["ring"]["READING"])
            now = time.monotonic()
            trained = any(r["role"] == "consumer" and (r.get("tokens_per_s") or 0) > 0 for r in rows)
            if args.kill_at_s and killed_at is None and trained and now - t0 >= args.kill_at_s:
                pid = child_pid(run_dir, "producer", 0)
                if pid:
                    os.kill(pid, signal.SIGKILL)
                    killed_at = now
                    print(f"kill producer=0 pid={pid} t={now - t0:.1f}s", flush=True)
                    time.sleep(1.0)
                    statuses.append(("1 s after the kill", status_text(run_dir)))
            if killed_at and restarted_at is None and child_pid(run_dir, "producer", 0, 2):
                restarted_at = time.monotonic()
                statuses.append(("restarted producer running", status_text(run_dir)))
            if restarted_at and republished_at is None:
                for r in rows:
                    if r["role"] == "producer" and r["index"] == 0 and r["generation"] >= 2:
                        if (r.get("tokens_per_s") or 0) > 0:
                            republished_at = time.monotonic()
            time.sleep(0.5)
        code = proc.wait(timeout=max(1.0, args.timeout_s - (time.monotonic() - t0)))
    except subprocess.TimeoutExpired:
        code = None
    finally:
        if proc.poll() is None:
            kill_tree(proc)
    print(log.read_text()[-2500:])
    for title, text in statuses:
        print(f"--- launch.py status ({title})\n{text}")
    summary = json.loads((run_dir / "summary.json").read_text()) if (run_dir / "summary.json").is_file() else {}
    print("summary=" + json.dumps(summary))
    print(f"exit_code={code}")
    print(f"tokens_per_s={summary.get('tokens_per_s')}")
    for p, occ in sorted(occupancy.items()):
        if occ:
            print(f"ring_occupancy_producer{p}_mean_ready_slots={sum(occ) / len(occ):.2f} samples={len(occ)}")
    if killed_at:
        print(f"restart_s={(restarted_at - killed_at) if restarted_at else float('nan'):.1f}")
        print(f"republish_s={(republished_at - killed_at) if republished_at else float('nan'):.1f}")
    return 0 if code == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
