"""Command-line front ends of the supervisor: ``train``, ``status``, ``restart``, ``clean``, ``bench``.

``train`` maps flags (and ``--config FILE``, TOML or YAML, with the sections of ``shared.config.RunConfig``)
onto the configuration, resolves the run (``supervisor.runplan``), and either prints it (``--plan``) or
runs the supervisor. Flags given on the command line override the file; everything is validated before
any process starts, and errors name the flag.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys
from pathlib import Path

from shared.config import REPO_ROOT, RunConfig, finite_number
from shared.errors import ConfigError, PeerTimeout
from supervisor.resume import latest_link

log = logging.getLogger(__name__)

_INT, _FLOAT = finite_number(int), finite_number(float)


def _ints(s: str) -> list[int]:
    try:
        return [int(x) for x in s.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {s!r}") from None


def _devices(s: str) -> list[str]:
    out = [x.strip() for x in s.split(",") if x.strip()]
    if not out:
        raise argparse.ArgumentTypeError("expected a comma-separated device list such as cpu,cpu or cuda:0,cuda:1")
    return out


# flag -> (section, field, parser, help); numbers go through one parser (finite_number), their ranges are
# declared once, on the config field (shared.config.check_numbers)
FLAGS = {
    "target": ("producer", "target", str, "target checkpoint directory (Hugging Face format)"),
    "producers": ("producer", "devices", _devices, "one producer per device, e.g. cuda:0,cuda:1 or cpu,cpu"),
    "dtype": ("producer", "dtype", str, "target dtype: auto (bf16 on GPU, fp32 on CPU), bfloat16, float16, float32"),
    "target_layers": ("producer", "target_layer_ids", _ints, "captured target layer ids, e.g. 1,9,17,25,33"),
    "num_target_layers": ("producer", "num_target_layers", _INT, "number of captured layers when --target-layers is not given (default: 5, spread over 1..L-3; fewer on a target of under 8 layers)"),
    "consumers": ("trainer", "devices", _devices, "one drafter trainer (data-parallel rank) per device"),
    "block_size": ("trainer", "block_size", _INT, "DFlash block size B"),
    "num_anchors": ("trainer", "num_anchors", _INT, "anchors per sequence"),
    "num_draft_layers": ("trainer", "num_draft_layers", _INT, "drafter layers (default: number of captured layers; 2 on CPU)"),
    "label_source": ("trainer", "label_source", str, "what the drafter learns: target (the target's own greedy next "
                     "tokens, computed by the producers) or data (the corpus's next tokens)"),
    "distill_topk": ("trainer", "distill_topk", _INT, "with --label-source target: also send the target's top-K "
                     "log-probabilities and add the KL divergence to them to the loss (0: off)"),
    "lr": ("trainer", "lr", _FLOAT, "peak learning rate"),
    "warmup_steps": ("trainer", "warmup_steps", _INT, "learning-rate warm-up steps"),
    "grad_accum": ("trainer", "grad_accum", _INT, "micro-batches per optimizer step"),
    "max_steps": ("trainer", "max_steps", _INT, "optimizer steps (ignored with --epochs)"),
    "epochs": ("trainer", "epochs", _INT, "train this many epochs of the data"),
    "checkpoint_every": ("trainer", "checkpoint_every", _INT, "optimizer steps between checkpoints"),
    "eval_every": ("trainer", "eval_every", _INT, "steps between tau evaluations (0: at every checkpoint)"),
    "eval_prompts": ("trainer", "eval_prompts", _INT, "held-out prompts per tau evaluation during training (0: none)"),
    "eval_prompt_len": ("trainer", "eval_prompt_len", _INT, "prompt tokens of each tau evaluation during training"),
    "eval_max_new_tokens": ("trainer", "eval_max_new_tokens", _INT, "tokens generated per prompt in those evaluations"),
    "seed": ("trainer", "seed", _INT, "seed of the drafter and anchor sampling (and of the batch plan)"),
    "data": ("data", "data", str, "Arrow file from `launch.py prepare` (default: the demo corpus)"),
    "heldout": ("data", "heldout", str, "held-out Arrow file for tau evaluation"),
    "max_tokens": ("data", "max_tokens", _INT, "padded tokens per batch"),
    "max_batch_size": ("data", "max_batch_size", _INT, "sequences per batch"),
    "num_slots": ("ring", "num_slots", _INT, "slots per producer ring"),
    "slot_mb": ("ring", "slot_bytes", finite_number(int, scale=2**20), "slot size in MiB (default: sized from the batch plan)"),
    "hang_timeout_s": ("monitor", "hang_timeout_s", _FLOAT, "kill a child that sends no heartbeat and makes no progress this long"),
    "batch_timeout_s": ("monitor", "batch_timeout_s", _FLOAT, "kill a child whose main thread is on one batch (forward, "
                        "training step, checkpoint) this long while its heartbeat goes on (a deadlock)"),
    "heartbeat_interval_s": ("monitor", "heartbeat_interval_s", _FLOAT, "seconds between heartbeats"),
    "max_restarts": ("monitor", "max_restarts", _INT, "restarts of one producer allowed per window"),
}


# Defaults for a run whose producers and consumers are all on CPU, unless a flag or the config file sets them:
# the embedded default then takes a few minutes on a 2-core machine (GPU runs keep RunConfig's defaults).
CPU_DEFAULTS = {("data", "max_tokens"): 2048, ("trainer", "num_anchors"): 32, ("trainer", "num_draft_layers"): 2,
                ("trainer", "max_steps"): 200,
                ("trainer", "checkpoint_every"): 100}


def default_devices() -> tuple[list[str], list[str]]:
    """2 producers + 1 consumer: on CPU, or spread over the GPUs when there are some."""
    try:
        import torch
        g = torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception:
        g = 0
    if g == 0:
        return ["cpu", "cpu"], ["cpu"]
    if g == 1:
        return ["cuda:0", "cuda:0"], ["cuda:0"]
    if g == 2:
        return ["cuda:0", "cuda:0"], ["cuda:1"]
    return ["cuda:0", "cuda:1"], ["cuda:2"]


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="launch.py train", description="Train a DFlash drafter: producers (target "
                                 "models) and consumers (drafter trainers) as separate processes over shared-memory rings.")
    for flag, (_, _, typ, help_) in FLAGS.items():
        ap.add_argument("--" + flag.replace("_", "-"), dest=flag, type=typ, default=None, help=help_)
    ap.add_argument("--run-dir", default=None, help="run directory (metrics, checkpoints, logs, socket); default: a new "
                    "runs/<UTC time>, linked as runs/latest (with --resume: runs/latest)")
    ap.add_argument("--resume", action="store_true", help="continue the run in --run-dir from its latest checkpoint")
    ap.add_argument("--config", default=None, help="TOML or YAML file with the sections of RunConfig")
    ap.add_argument("--plan", action="store_true", help="print the resolved topology and sizes, start nothing")
    ap.add_argument("--checksum", action="store_true", default=None, help="CRC32 every slot payload and verify it")
    ap.add_argument("--random-target-weights", action="store_true", default=None,
                    help="benchmarks: build the target from its config.json with random weights (the checkpoint's "
                         "own tensors, e.g. embedding and LM head, are still loaded)")
    ap.add_argument("--tcp", default=None, help="use TCP (e.g. tcp://127.0.0.1:5555) instead of an ipc socket")
    return ap


def _load_file(path: str) -> dict:
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"--config: {p} does not exist")
    text = p.read_text()
    if p.suffix in (".toml",):
        try:
            import tomllib
        except ModuleNotFoundError:  # Python 3.10
            import tomli as tomllib  # type: ignore
        try:
            return tomllib.loads(text)
        except Exception as e:
            raise ConfigError(f"--config: {p} is not valid TOML: {e}") from None
    if p.suffix in (".yaml", ".yml"):
        try:
            import yaml
        except ModuleNotFoundError:
            raise ConfigError("--config: YAML needs PyYAML (pip install pyyaml); or use TOML") from None
        try:
            d = yaml.safe_load(text)
        except Exception as e:
            raise ConfigError(f"--config: {p} is not valid YAML: {e}") from None
        if not isinstance(d, dict):
            raise ConfigError(f"--config: {p} must hold a mapping")
        return d
    raise ConfigError(f"--config: {p} must end in .toml, .yaml or .yml")


def config_from_args(args: argparse.Namespace) -> RunConfig:
    """RunConfig from defaults, then ``--config FILE``, then explicit flags; raises ``ConfigError`` naming
    the flag, or the file and key, that a bad value came from (``RunConfig.sources`` keeps that mapping for
    the checks that come later, ``supervisor.runplan``)."""
    base = RunConfig().to_dict()
    prod, cons = default_devices()
    base["producer"]["devices"], base["trainer"]["devices"] = prod, cons
    explicit: set[tuple[str, str]] = set()
    sources = {f"{section}.{field_name}": "--" + flag.replace("_", "-")
               for flag, (section, field_name, _, _) in FLAGS.items()}
    if args.config:
        for key, value in _load_file(args.config).items():
            if isinstance(base.get(key), dict):
                if not isinstance(value, dict):
                    raise ConfigError(f"--config: section {key!r} must be a mapping, got {type(value).__name__}")
                base[key].update(value)
                explicit.update((key, k) for k in value)
                sources.update({f"{key}.{k}": f"--config {args.config}: {key}.{k}" for k in value})
            else:
                base[key] = value
                sources[key] = f"--config {args.config}: {key}"
    for flag, (section, field_name, _, _) in FLAGS.items():
        value = getattr(args, flag)
        if value is not None:
            base[section][field_name] = value
            explicit.add((section, field_name))
            sources[f"{section}.{field_name}"] = "--" + flag.replace("_", "-")
    devices = [base["producer"]["devices"], base["trainer"]["devices"]]
    if not all(isinstance(d, list) and all(isinstance(x, str) for x in d) for d in devices):
        raise ConfigError(f"--config: producer.devices and trainer.devices must be lists of device names, "
                          f"got {devices[0]!r} and {devices[1]!r}")
    if all(d == "cpu" for d in devices[0] + devices[1]):
        for (section, field_name), value in CPU_DEFAULTS.items():
            if (section, field_name) not in explicit:
                base[section][field_name] = value
    if args.run_dir is not None:
        base["run_dir"] = args.run_dir
    if args.checksum:
        base["ring"]["checksum"] = True
    if args.tcp:
        base["tcp"] = args.tcp
    if args.random_target_weights:
        base["producer"]["random_weights"] = True
    base["resume"] = bool(args.resume)
    if base["data"].get("seed") in (None, 0) and args.seed is not None:
        base["data"]["seed"] = args.seed
        sources["data.seed"] = "--seed"
    try:
        cfg = RunConfig.from_dict(base)
    except ConfigError as e:
        if e.key:
            raise ConfigError(f"{sources.get(e.key, e.key)}: {e.detail}", key=e.key, detail=e.detail) from None
        raise ConfigError(f"--config/flags: {e}") from None
    except TypeError as e:
        raise ConfigError(f"--config/flags: {e}") from None
    cfg.sources = sources
    return cfg


def _setup_logging(run_dir: str | None = None) -> None:
    from shared.procs import configure_logging
    configure_logging("supervisor")
    if run_dir:
        Path(run_dir, "logs").mkdir(parents=True, exist_ok=True)
        fh = logging.FileHandler(Path(run_dir, "logs", "supervisor.log"))
        fh.setFormatter(logging.getLogger().handlers[0].formatter)
        logging.getLogger().addHandler(fh)


def train_main(argv: list[str]) -> int:
    """``launch.py [train] ...``: resolve and run (or print with ``--plan``). Returns the exit code."""
    args = build_parser().parse_args(argv)
    try:
        cfg = config_from_args(args)
        if cfg.resume:
            from supervisor.resume import resume_dir
            run_dir = Path(resume_dir(cfg.run_dir))
            saved = run_dir / "config.json"
            if not saved.is_file():
                raise ConfigError(f"--resume: {saved} does not exist (nothing to resume in --run-dir {run_dir})")
            cfg = RunConfig.from_dict(json.loads(saved.read_text()))
            cfg.resume, cfg.run_dir = True, str(run_dir)  # the directory may have moved since
            print(f"resuming with the configuration saved in {saved} (flags other than --run-dir are ignored)",
                  file=sys.stderr)
        from supervisor.resume import check_resume_data, claim_run_dir, prepare_run_dir
        new_default = prepare_run_dir(cfg)
        from supervisor.runplan import resolve_run
        plan = resolve_run(cfg)
        record = check_resume_data(cfg, plan)  # a resume onto other data or another plan stops here
        if args.plan:
            print(plan.describe(cfg))
            return 0
        lock = claim_run_dir(cfg, new_default, record)  # held until the run is over
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    trained: set[int] = set()
    if cfg.resume:
        from supervisor.resume import read_checkpoint_batches
        updated, skipped = read_checkpoint_batches(Path(cfg.run_dir))
        trained = updated | skipped
        if all(b.batch_id in trained for b in plan.order):
            print(f"nothing to resume: all {len(plan.order)} planned batches of {cfg.run_dir} are in its latest "
                  f"checkpoint (see its summary.json)", file=sys.stderr)
            lock.close()
            return 0
    _setup_logging(cfg.run_dir)
    from supervisor.supervisor import Supervisor
    from tqdm.contrib.logging import logging_redirect_tqdm
    sup = Supervisor(cfg, plan, trained=trained, updated_before=len(updated) if cfg.resume else 0)
    try:
        with logging_redirect_tqdm():
            outcome = sup.run()
    finally:
        lock.close()
    s = sup.summary
    restarts = " ".join(f"producer{k}={v}" for k, v in s["restarts"].items())
    line = (f"\nrun {s['exit_reason']}: {s['trained_batches']}/{s['planned_batches']} batches trained "
            f"(duplicates {s['duplicate_batches']}, lost {s['lost_batches']}, bad {s['bad_batches']}, "
            f"skipped {s['skipped_batches']}), "
            f"loss {_fmt(s['loss_first'])} -> {_fmt(s['loss_last'])}, {s['tokens_per_s']:,.0f} tokens/s, "
            f"{s['elapsed_s']:.0f} s, restarts {restarts}")
    if s.get("tau_last"):
        line += f"\ntau {s['tau_last']['tau_mean']:.3f} at step {s['tau_last']['step']} ({Path(cfg.run_dir) / 'eval.jsonl'})"
    if s["exit_reason"] == "nothing_trained":
        line += ("\nnothing was trained: every optimizer step was skipped (no labels: no sample of the batches has "
                 "two adjacent tokens that carry loss, which a DFlash anchor needs; or non-finite losses); "
                 "check the data's loss_mask (`launch.py prepare` names such rows no_anchor)")
    line += f"\nsummary: {Path(cfg.run_dir) / 'summary.json'}"
    if s["remaining_batches"]:
        line += (f"\n{s['remaining_batches']} batches still to train (not reached, or trained after the last "
                 f"checkpoint); continue with "
                 f"`python launch.py train --run-dir {cfg.run_dir} --resume`")
    print(line, file=sys.stderr)
    return outcome.exit_code


def _fmt(x) -> str:
    return "-" if x is None else f"{x:.3f}"


def _address(run_dir: str) -> str:
    from shared.procs import Topology
    p = Path(run_dir) / "topology.json"
    if not p.is_file():
        raise ConfigError(f"--run-dir: {run_dir} has no topology.json (no run was started there)")
    return Topology.load(run_dir).address


def status_main(argv: list[str]) -> int:
    """``launch.py status --run-dir R``: one line per process from the running supervisor."""
    ap = argparse.ArgumentParser(prog="launch.py status")
    ap.add_argument("--run-dir", default=str(latest_link()), help="the run to ask (default: runs/latest)")
    ap.add_argument("--json", action="store_true", help="print the raw status as JSON")
    args = ap.parse_args(argv)
    from shared import channel, messages as m
    from supervisor.resume import supervisor_alive
    if (Path(args.run_dir) / "topology.json").is_file() and supervisor_alive(Path(args.run_dir)) is None:
        summary = Path(args.run_dir) / "summary.json"
        print(f"no run is going in {args.run_dir} (its supervisor has exited)"
              + (f"; see {summary}" if summary.is_file() else ""), file=sys.stderr)
        return 1
    try:
        reply = channel.request(_address(args.run_dir), m.Command(action="status"), timeout_s=5.0)
    except (ConfigError, PeerTimeout) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    d = reply.data
    if args.json:
        print(json.dumps(d, indent=1))
        return 0
    print(f"run {d['run_id']}  step {d['step']}  trained {d['trained']}/{d['planned']} batches  loss {_fmt(d['loss'])}")
    print(f"{'process':<12}{'pid':>8}{'gen':>5} {'state':<9}{'hb_age':>7}{'tok/s':>10}{'cpu%':>7}{'rss_MiB':>9}"
          f"{'gpu_MiB':>9}{'restarts':>9}  {'ring F/W/R/r':<13} busy with")
    for r in d["rows"]:
        ring = r.get("ring")
        ring_s = "{FREE}/{WRITING}/{READY}/{READING}".format(**ring) if ring else ""
        print(f"{r['role'] + '-' + str(r['index']):<12}{r['pid'] or '-':>8}{r['generation']:>5} {r['state']:<9}"
              f"{_num(r.get('heartbeat_age_s'), '.1f'):>7}{_num(r.get('tokens_per_s'), ',.0f'):>10}"
              f"{_num(r.get('cpu_percent'), '.0f'):>7}{_num(_mib(r.get('rss_bytes')), '.0f'):>9}"
              f"{_num(_mib(r.get('gpu_mem_bytes')), '.0f'):>9}{r['restarts']:>9}  {ring_s:<13} {_work(r)}")
    return 0


def _work(row: dict) -> str:
    """``batch 17 for 3.2s`` (what the child's main thread is on, from its last heartbeat), ``-`` when idle."""
    what, secs = row.get("work"), row.get("work_s")
    return f"{what} for {secs:.1f}s" if what and isinstance(secs, (int, float)) else "-"


def _mib(x):
    return None if x is None else x / 2**20


def _num(x, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def restart_main(argv: list[str]) -> int:
    """``launch.py restart producer N --run-dir R``: graceful restart of one producer."""
    ap = argparse.ArgumentParser(prog="launch.py restart", description="Gracefully restart one producer while "
                                 "training goes on: it finishes its current batch, exits, and comes back as a new "
                                 "generation; its published slots are still consumed.")
    ap.add_argument("role", choices=["producer"], help="only producers can be restarted")
    ap.add_argument("index", type=_INT, help="producer index (the number after producer- in `launch.py status`)")
    ap.add_argument("--run-dir", default=str(latest_link()), help="the run (default: runs/latest)")
    args = ap.parse_args(argv)
    if not 0 <= args.index < 2**16:
        ap.error(f"argument index: no producer {args.index} (indices start at 0)")
    from shared import channel, messages as m
    try:
        reply = channel.request(_address(args.run_dir), m.Command(action="restart", role=args.role, index=args.index))
    except (ConfigError, PeerTimeout) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(reply.text, file=sys.stdout if reply.ok else sys.stderr)
    return 0 if reply.ok else 1


def clean_main(argv: list[str]) -> int:
    """``launch.py clean``: remove segments, socket files and processes of runs whose supervisor is dead."""
    ap = argparse.ArgumentParser(prog="launch.py clean")
    ap.add_argument("--run-dir", action="append", default=[], help="also look in this run directory (repeatable)")
    args = ap.parse_args(argv)
    from supervisor.resume import stale_sockets
    from shared.procs import sweep_run_processes
    from shared.ring import run_owned, sweep_stale
    for pid, run_id, cmd in sweep_run_processes(run_owned):
        print(f"killed process {pid} of run {run_id} (its supervisor is gone): {cmd}")
    removed = sweep_stale()
    dirs = [Path(d) for d in args.run_dir] + sorted((REPO_ROOT / "runs").glob("*"))
    socks = []
    for d in dirs:
        for sock in stale_sockets(d):
            os.unlink(sock)
            socks.append(str(sock))
    for name in removed:
        print(f"removed segment /dev/shm/{name}")
    for s in socks:
        print(f"removed socket {s}")
    print(f"clean: {len(removed)} segment(s), {len(socks)} socket(s) removed")
    return 0


def bench_main(argv: list[str]) -> int:
    """``launch.py bench [transport|producer] ARGS``: run a benchmark script from ``benchmarks/``."""
    name = argv[0] if argv and not argv[0].startswith("-") else "transport"
    rest = argv[1:] if argv and not argv[0].startswith("-") else argv
    script = REPO_ROOT / "benchmarks" / f"{name}.py"
    if not script.is_file():
        print(f"error: no benchmark {name!r} (have: {', '.join(p.stem for p in (REPO_ROOT / 'benchmarks').glob('*.py'))})",
              file=sys.stderr)
        return 2
    return subprocess.call([sys.executable, str(script), *rest], cwd=REPO_ROOT)
