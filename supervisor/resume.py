"""The run directory across runs: choosing it, refusing to share it, and resuming from it.

* A fresh run gets ``runs/<UTC time>`` unless ``--run-dir`` names one; ``runs/latest`` points at the newest
  run that passed its start-up checks. ``--resume`` without ``--run-dir`` resumes the run it points at; a
  ``--resume`` of a run that saved no checkpoint trains it from the beginning.
* A run directory that a live launcher holds (``shared.run.run_dir.RunDir.held``: ``flock`` on ``RUN_DIR/.lock``,
  whatever PID namespace it runs in) is refused (two supervisors would share a socket); ``status`` and ``clean``
  ask the same lock.
* A fresh run into a directory that already holds checkpoints is refused (use ``--resume`` or another
  directory) so no earlier result is overwritten.
* ``--resume``: the trained batch ids come from the latest checkpoint (``shared.drafters.checkpoint``); the
  trainer drops the ``metrics.jsonl`` records of steps after that checkpoint (their weights were lost),
  so the final ``metrics.jsonl`` lists every batch exactly once.
* A run knows its data: ``RUN_DIR/data.json`` (``data_record``), written when the run starts without a
  checkpoint, holds the content digest of ``--data``, the config fields that shape the batch plan and a
  digest of the plan itself. ``--resume`` onto other data or another plan is refused before anything
  starts (``check_resume_data``): a checkpoint's batch ids name batches of *that* plan over *that* data.
"""

from __future__ import annotations

import hashlib
import logging
import sys
from pathlib import Path

from specring.shared.config.run_config import RunConfig
from specring.shared.errors import ConfigError
from specring.shared.run.run_dir import RunDir

log = logging.getLogger(__name__)


def prepare_run_dir(cfg: RunConfig) -> bool:
    """Pick and check ``cfg.run_dir`` (see module docstring); changes nothing on disk. Raises
    ``ConfigError`` naming ``--run-dir`` (a directory whose records would replace an input:
    ``check_run_dir_outputs``) or ``--resume``.

    Returns True when a new ``runs/<UTC time>`` was chosen (``claim_run_dir`` then moves ``runs/latest``;
    ``train --plan`` stops before that)."""
    new_default = False
    latest = RunDir.latest_link()
    if cfg.resume:
        cfg.run_dir = resume_dir(cfg.run_dir)
    elif cfg.run_dir in ("", "runs/default"):
        if latest.exists() and not latest.is_symlink():
            raise ConfigError(f"--run-dir: {latest} is not the symbolic link specring keeps there; move it away "
                              f"or give --run-dir")
        cfg.run_dir = str(RunDir.new_default())
        new_default = True
    run = RunDir(cfg.run_dir)
    run_dir = run.path
    check_run_dir_outputs(cfg, run_dir)
    pid = run.supervisor_pid()
    if pid is not None:
        raise ConfigError(f"--run-dir: a run is already going in {run_dir} (supervisor pid {pid}); "
                          f"watch it with `launch.py status --run-dir {run_dir}`")
    steps = run.checkpoint_names()
    pointer = run.checkpoint_pointer
    if not cfg.resume and (steps or pointer.exists()):
        raise ConfigError(f"--run-dir: {run_dir} already holds checkpoints of an earlier run; "
                          f"continue it with --resume or choose another --run-dir")
    if cfg.resume and pointer.exists() and run.latest_checkpoint_step() is None:
        name = pointer.read_text(errors="replace").strip()
        raise ConfigError(f"--resume: {pointer} names {name!r}, which is not a complete checkpoint "
                          f"(complete ones: {', '.join(steps) or 'none'}); write the name of one of them into it")
    if cfg.resume and pointer.exists():
        check_latest_readable(run_dir)
    return new_default


def check_latest_readable(run_dir: Path) -> None:
    """On ``--resume``: check that every file of the checkpoint ``checkpoints/latest`` names reads
    (``shared.drafters.checkpoint.check_checkpoint_files``: headers and archive directories only, cheap at any size).
    Raises ``ConfigError`` naming ``--resume``, the file that does not read and how to continue: from the newest
    older checkpoint that reads (``last_good_checkpoint``; its name written into ``latest``, the batches trained
    after it are trained again), or, when none reads, from the beginning (the checkpoints moved away)."""
    from specring.shared.drafters.checkpoint import check_checkpoint_files, last_good_checkpoint, latest_checkpoint
    from specring.shared.errors import CorruptFile

    ckpts = RunDir(run_dir).checkpoints_dir
    latest = latest_checkpoint(ckpts)
    try:
        check_checkpoint_files(latest)
    except CorruptFile as e:
        good, _ = last_good_checkpoint(ckpts)
        if good is not None and good.name < latest.name:
            how = (f"the newest checkpoint that reads is {good.name}: continue from it with "
                   f"`echo {good.name} > {ckpts / 'latest'}` and the same --resume (the batches trained after it "
                   f"are trained again)")
        else:
            how = (f"no checkpoint of {ckpts} reads: restore the file, or move {ckpts} away to train "
                   f"{run_dir} from the beginning")
        raise ConfigError(f"--resume: the latest checkpoint {latest.name} cannot be read: {e}; {how}") from None


def check_run_dir_outputs(cfg: RunConfig, run_dir: Path) -> None:
    """Refuse a ``--run-dir`` whose records (``shared.run.run_dir.RunDir.records``) would replace what the run reads: a
    file of the target's directory (``--run-dir`` the target itself), ``--data``, ``--heldout`` or their
    sidecars (``shared.config.outputs.check_outputs``; ``ConfigError`` naming ``--run-dir``)."""
    from specring.shared.config.outputs import check_outputs
    from specring.shared.data.dataset import sidecar_path

    outputs = RunDir(run_dir).records()
    inputs = {"target directory": cfg.producer.target if Path(cfg.producer.target).is_dir() else None}
    for flag, path in (("--data", cfg.data.data), ("--heldout", cfg.data.heldout)):
        if path:
            inputs.update({flag: path, f"sidecar of {flag}": sidecar_path(path)})
    check_outputs("--run-dir", outputs, inputs)


def claim_run_dir(cfg: RunConfig, new_default: bool, record: dict | None = None):
    """Take ``cfg.run_dir`` for this launcher, once the run has passed every start-up check.

    Creates the directory, holds an exclusive ``flock`` on ``RUN_DIR/.lock`` (returned: keep it open for the
    life of the run; the kernel drops it if the launcher dies), removes half-written checkpoints, and, when
    no checkpoint was ever saved there, the records of an earlier start (``metrics.jsonl``, ``eval.jsonl``,
    ``summary.json``, ``tensorboard/``: the weights they describe are gone). Moves ``runs/latest`` to a new
    default run. Writes ``record`` (``data_record``) as ``RUN_DIR/data.json`` when the run starts without
    a checkpoint, or when a resumed run has none yet. Raises ``ConfigError`` when another launcher holds the
    directory."""
    run = RunDir(cfg.run_dir)
    lock = run.claim()  # ConfigError when another launcher holds it
    run.remove_half_written_checkpoints()
    if run.latest_checkpoint_step() is None and not run.checkpoint_pointer.exists():
        if cfg.resume:
            log.warning("resume run_dir=%s has no checkpoint: its batches are trained from the beginning", run.path)
        run.forget_void_records()
    if record is not None and not run.data_file.exists():
        run.write_data_record(record)
    if new_default:
        run.point_latest()
    return lock


# Config fields that shape the batch order (with the data and the number of consumers): see runplan.
PLAN_FIELDS = ("data.max_tokens", "data.max_batch_size", "data.bucket_edges", "data.num_buckets", "data.seed",
               "trainer.epochs", "trainer.max_steps", "trainer.grad_accum")
# Of those, the ones that only set how long the order is (it is always the start of the epochs concatenated):
# --resume may change them; the data record is then compared on the batches both lengths plan.
LENGTH_FIELDS = ("trainer.epochs", "trainer.max_steps")


def plan_digest(order) -> str:
    """``"sha256:<hex>"`` of a batch order (``shared.data.dataset.Batch`` items): every batch id with its sample ids,
    in order. Equal digests mean every batch id names the same samples."""
    import itertools

    import numpy as np
    n = len(order)
    ids = np.fromiter((b.batch_id for b in order), dtype=np.int64, count=n)
    sizes = np.fromiter((len(b.sample_ids) for b in order), dtype=np.int64, count=n)
    samples = np.fromiter(itertools.chain.from_iterable(b.sample_ids for b in order), dtype=np.int64,
                          count=int(sizes.sum()))
    h = hashlib.sha256(b"specring-plan-v1|")
    for part in (ids, sizes, samples):
        h.update(part.astype("<i8").tobytes())
    return "sha256:" + h.hexdigest()


def data_record(cfg: RunConfig, plan) -> dict:
    """What a run trains on, as stored in ``RUN_DIR/data.json``: the data file and its content digest
    (``TokenDataset.content_digest``), samples, tokens, the plan-shaping config fields (``PLAN_FIELDS`` and
    the number of consumers) and the digest of the resolved batch order (``plan_digest``)."""
    fields = {key: getattr(getattr(cfg, key.split(".")[0]), key.split(".")[1]) for key in PLAN_FIELDS}
    fields["trainer.consumers"] = len(cfg.trainer.devices)
    return {"data": str(Path(cfg.data.data).resolve()), "content_digest": plan.data_digest,
            "num_samples": plan.data_samples, "num_tokens": plan.data_tokens, "plan_fields": fields,
            "planned_batches": len(plan.order), "plan_digest": plan_digest(plan.order)}


def check_resume_data(cfg: RunConfig, plan) -> dict:
    """On ``--resume`` of a run with a checkpoint, compare the data and plan of ``plan`` with the run's
    ``data.json``; returns the current ``data_record``. Raises ``ConfigError`` naming ``--resume``, the data
    file and what changed (content, samples and tokens; plan fields; the plan itself) when they differ:
    the checkpoint's batch ids would count as trained against other samples. A run started before
    ``data.json`` existed cannot be checked: a warning is printed (and ``claim_run_dir`` records it).

    A changed run length (``LENGTH_FIELDS``: ``--max-steps``, ``--epochs``) is no change of plan: the
    first batches of the new order (``RunPlan.first_batches``) must be those the run recorded."""
    record = data_record(cfg, plan)
    run = RunDir(cfg.run_dir)
    run_dir = run.path
    if not cfg.resume or run.latest_checkpoint_step() is None:
        return record
    path = run.data_file
    try:
        old = run.read_data_record()
    except FileNotFoundError:
        print(f"warning: {run_dir} has no {path.name} (started by an older specring): cannot check that "
              f"{cfg.data.data} still holds the data it trained on; recording it now", file=sys.stderr)
        return record
    except (OSError, ValueError) as e:
        raise ConfigError(f"--resume: {path} cannot be read ({e}); it records the data the run trained on") from None
    advice = ("its checkpoint's batch ids would count as trained against other samples. Restore the data the run "
              "was started with, or train a new run on the new data (another --run-dir)")
    if old.get("content_digest") != record["content_digest"]:
        raise ConfigError(
            f"--resume: the data of {run_dir} changed since the run started: {cfg.data.data} now holds "
            f"{record['num_samples']} samples, {record['num_tokens']} tokens ({record['content_digest'][:19]}...), "
            f"the run started on {old.get('num_samples')} samples, {old.get('num_tokens')} tokens "
            f"({str(old.get('content_digest'))[:19]}...) of {old.get('data')}; {advice}")
    changed = [f"{k} {old['plan_fields'].get(k)!r} -> {v!r}" for k, v in record["plan_fields"].items()
               if old.get("plan_fields", {}).get(k) != v and k not in LENGTH_FIELDS]
    digest = record["plan_digest"]
    if isinstance(old.get("planned_batches"), int) and old["planned_batches"] != len(plan.order):
        digest = plan_digest(plan.first_batches(old["planned_batches"]))  # the run length changed on --resume
    if changed or old.get("plan_digest") != digest:
        why = (", ".join(changed) if changed
               else "same data and settings, another batch order (another specring version?)")
        raise ConfigError(f"--resume: the batch plan of {run_dir} changed since the run started ({why}); {advice}")
    return record


def resume_dir(run_dir: str) -> str:
    """The directory ``--resume`` continues: ``run_dir``, or without ``--run-dir`` the run that
    ``runs/latest`` points at."""
    if run_dir not in ("", "runs/default"):
        return run_dir
    latest = RunDir.latest_link()
    try:
        return str(latest.resolve(strict=False) if latest.is_symlink() else latest)
    except (OSError, RuntimeError) as e:  # a link loop
        raise ConfigError(f"--resume: {latest} cannot be followed ({e}); give --run-dir") from None


def read_checkpoint_batches(run_dir: Path) -> tuple[set[int], set[int]]:
    """``(updated, skipped)``: batch ids of the latest checkpoint of ``run_dir`` whose steps updated the
    weights, and those whose steps were skipped (no labels, non-finite loss); two empty sets if there is
    no checkpoint. Reads the trainer state only (memory-mapped), not the weights."""
    from specring.shared.drafters.checkpoint import latest_checkpoint, load_trainer_state
    path = latest_checkpoint(RunDir(run_dir).checkpoints_dir)
    if path is None:
        return set(), set()
    state = load_trainer_state(path, mmap=True)
    return ({int(b) for b in state["trained_batch_ids"]}, {int(b) for b in state.get("skipped_batch_ids", [])})



def prepare_draft_vocab(cfg: RunConfig, plan) -> str:
    """The draft vocabulary of an EAGLE-3 run (``shared.drafters.draft_vocab``), once the run directory is claimed:
    built from the loss-carrying tokens of ``--data`` when the run starts, read back (never rebuilt) on
    ``--resume`` once it exists or a checkpoint was saved. Returns what was done (``"built"``, ``"read"``;
    ``""`` for a DFlash run). Raises ``ConfigError`` naming ``--resume`` when a resumed run's file is
    missing or is not the vocabulary its drafter needs, ``ConfigError`` naming ``--data`` when a token id
    lies outside the target's vocabulary."""
    from specring.shared.drafters import get_family
    from specring.shared.drafters.draft_vocab import read_draft_vocab, write_draft_vocab

    if not get_family(cfg.trainer.drafter).needs_draft_vocab:
        return ""
    run = RunDir(cfg.run_dir)
    run_dir = run.path
    if not plan.vocab_size:
        raise ConfigError(f"--target: {cfg.producer.target}/config.json has no vocab_size, which an EAGLE-3 draft "
                          f"vocabulary needs")
    if cfg.resume and (run.draft_vocab_file.exists() or run.latest_checkpoint_step() is not None):
        read_draft_vocab(run_dir, plan.draft_vocab_size, plan.vocab_size, prefix="--resume: ")
        log.info("draft_vocab read=%s size=%d", run.draft_vocab_file, plan.draft_vocab_size)
        return "read"
    try:
        d2t, _ = write_draft_vocab(run_dir, cfg.data.data, plan.vocab_size, plan.draft_vocab_size)
    except ValueError as e:
        raise ConfigError(f"--data: {e}") from None
    log.info("draft_vocab built=%s size=%d", run.draft_vocab_file, d2t.numel())
    return "built"


def check_resume_draft_vocab(cfg: RunConfig, plan) -> None:
    """On ``--resume`` of an EAGLE-3 run (a family that ``needs_draft_vocab``) with a checkpoint: the run's
    ``draft_vocab.safetensors`` must be the vocabulary that checkpoint was trained with (its ``d2t``/``t2d``
    buffers), checked before anything starts (``train --plan`` included), not by the consumer after start-up.
    Reads only those two tensors of the checkpoint. Raises ``ConfigError`` naming ``--resume`` and both files
    when they differ, and what ``shared.drafters.draft_vocab.read_draft_vocab`` raises for a missing or misshapen
    file."""
    import torch

    from specring.shared.drafters import get_family
    from specring.shared.drafters.checkpoint import WEIGHTS_FILE, latest_checkpoint, read_safetensors
    from specring.shared.drafters.draft_vocab import read_draft_vocab
    from specring.shared.errors import CorruptFile

    run = RunDir(cfg.run_dir)
    run_dir = run.path
    if not cfg.resume or not get_family(cfg.trainer.drafter).needs_draft_vocab or \
            run.latest_checkpoint_step() is None or not plan.vocab_size:
        return
    d2t, t2d = read_draft_vocab(run_dir, plan.draft_vocab_size, plan.vocab_size, prefix="--resume: ")
    weights = latest_checkpoint(run.checkpoints_dir) / WEIGHTS_FILE
    try:
        saved = read_safetensors(weights, keys=["d2t", "t2d"])
    except CorruptFile as e:
        raise ConfigError(f"--resume: {e}") from None
    differ = [k for k, mine in (("d2t", d2t), ("t2d", t2d))
              if k in saved and (saved[k].shape != mine.shape or not torch.equal(saved[k].to(mine.dtype), mine))]
    if differ:
        raise ConfigError(f"--resume: {run.draft_vocab_file} is not the draft vocabulary the checkpoint "
                          f"{weights.parent.name} was trained with ({' and '.join(differ)} differ from those in "
                          f"{weights}): restore the run's own draft_vocab.safetensors (it was built once, when the "
                          f"run started), or start a new run")
