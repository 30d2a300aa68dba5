"""``launch.py train``: flags and ``--config FILE`` onto the configuration, the run resolved
(``specring.supervisor.runplan``), then printed (``--plan``) or run by the supervisor.

Flags given on the command line override the file; everything is validated before any process starts, and
errors name the flag.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

from specring.cli.ops import _fmt
from specring.shared.config import RunConfig, finite_number
from specring.shared.errors import ConfigError

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


def train_main(argv: list[str]) -> int:
    """``launch.py [train] ...``: resolve and run (or print with ``--plan``). Returns the exit code."""
    args = build_parser().parse_args(argv)
    try:
        cfg = config_from_args(args)
        if cfg.resume:
            from specring.supervisor.resume import resume_dir
            run_dir = Path(resume_dir(cfg.run_dir))
            saved = run_dir / "config.json"
            if not saved.is_file():
                raise ConfigError(f"--resume: {saved} does not exist (nothing to resume in --run-dir {run_dir})")
            cfg = RunConfig.from_dict(json.loads(saved.read_text()))
            cfg.resume, cfg.run_dir = True, str(run_dir)  # the directory may have moved since
            print(f"resuming with the configuration saved in {saved} (flags other than --run-dir are ignored)",
                  file=sys.stderr)
        from specring.supervisor.resume import (
            check_resume_data,
            claim_run_dir,
            prepare_run_dir,
        )
        new_default = prepare_run_dir(cfg)
        from specring.supervisor.runplan import resolve_run
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
        from specring.supervisor.resume import read_checkpoint_batches
        updated, skipped = read_checkpoint_batches(Path(cfg.run_dir))
        trained = updated | skipped
        if all(b.batch_id in trained for b in plan.order):
            print(f"nothing to resume: all {len(plan.order)} planned batches of {cfg.run_dir} are in its latest "
                  f"checkpoint (see its summary.json)", file=sys.stderr)
            lock.close()
            return 0
    from specring.shared.logs import configure_logging
    configure_logging("supervisor", log_file=Path(cfg.run_dir, "logs", "supervisor.log"))
    from tqdm.contrib.logging import logging_redirect_tqdm

    from specring.supervisor.supervisor import Supervisor
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
