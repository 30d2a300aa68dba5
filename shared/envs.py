"""Every environment variable specring reads or sets, declared once (the shape of vLLM's ``vllm/envs.py``).

A module that needs one imports its name from here and reads it with ``get`` (the raw text, ``default`` when
unset) or a typed reader (``flag``, ``seconds``); nothing else in the project names a variable or calls
``os.environ.get`` for one. ``VARIABLES`` lists them with who sets them and what they mean, for ``--help``-style
listings and the test that keeps this file complete (``tests/unit/test_envs.py``).

Who sets them:

* ``specring``: the supervisor, for its children (``SPECRING_RUN_ID``, the data-parallel store of several nodes);
* ``test``: fault hooks of tests and chaos drills (``shared.process.faults`` reads them and logs each one that is set);
* ``launcher``: a multi-node launcher (torchrun, SLURM scripts) or the user, for ``--nnodes`` runs;
* ``user``: the Hugging Face cache and the experiment trackers, read as those libraries document them.

Values are read at call time (not cached at import), so a test's ``monkeypatch.setenv`` takes effect.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from specring.shared.errors import ConfigError


@dataclass(frozen=True)
class EnvVar:
    """One variable: its ``name``, who sets it (``specring``, ``test``, ``launcher``, ``user``) and its meaning."""
    name: str
    set_by: str
    meaning: str


def _declare(*vars_: EnvVar) -> dict[str, EnvVar]:
    return {v.name: v for v in vars_}


# the run's own
RUN_ID = "SPECRING_RUN_ID"
DIST_STORE = "SPECRING_DIST_STORE"
DIST_PREFIX = "SPECRING_DIST_PREFIX"
CHECKPOINTS_DIR = "SPECRING_CHECKPOINTS_DIR"
# fault hooks (shared.process.faults)
FAULT_HELPERS = "SPECRING_FAULT_HELPERS"
SLOW_FORWARD_S = "SPECRING_SLOW_FORWARD_S"
STALL_FORWARD = "SPECRING_STALL_FORWARD"
SLOW_WRITE_S = "SPECRING_SLOW_WRITE_S"
INJECT_NONFINITE = "SPECRING_INJECT_NONFINITE"
SLOW_CHECKPOINT_S = "SPECRING_SLOW_CHECKPOINT_S"
SLOW_EVAL_S = "SPECRING_SLOW_EVAL_S"
FAIL_EVAL = "SPECRING_FAIL_EVAL"
SLOW_SHARD_S = "SPECRING_SLOW_SHARD_S"
# diagnostics
PROFILE_STEPS = "SPECRING_PROFILE_STEPS"
DECODE_GRAPHS = "SPECRING_DECODE_GRAPHS"

VARIABLES: dict[str, EnvVar] = _declare(
    EnvVar(RUN_ID, "specring", "marks every process of a run (its children inherit it): `launch.py clean` and the "
                               "next start find leftovers by it (shared.process.procs)"),
    EnvVar(DIST_STORE, "specring", "host:port of the TCPStore the consumers' process group meets in (several nodes)"),
    EnvVar(DIST_PREFIX, "specring", "the prefix of this run's keys in that store"),
    EnvVar(CHECKPOINTS_DIR, "specring", "node 0's checkpoints directory, read on --resume by the other nodes"),
    EnvVar(FAULT_HELPERS, "test", "1: the producer starts two helper processes that must not outlive it"),
    EnvVar(SLOW_FORWARD_S, "test", "seconds the producer sleeps before every forward"),
    EnvVar(STALL_FORWARD, "test", "<index>:<generation>: that producer incarnation never returns from its first batch"),
    EnvVar(SLOW_WRITE_S, "test", "seconds between writing a slot and publishing it"),
    EnvVar(INJECT_NONFINITE, "test", "batch ids whose captured hidden states get a NaN"),
    EnvVar(SLOW_CHECKPOINT_S, "test", "seconds a checkpoint write sleeps before its rename"),
    EnvVar(SLOW_EVAL_S, "test", "seconds the tau evaluation sleeps after each prompt"),
    EnvVar(FAIL_EVAL, "test", "1: the tau evaluation raises before its first prompt"),
    EnvVar(SLOW_SHARD_S, "test", "seconds a regenerate worker sleeps after each shard"),
    EnvVar(PROFILE_STEPS, "user", "START:COUNT: each consumer runs torch.profiler over optimizer steps START.."
                                  "START+COUNT-1 and writes RUN_DIR/profile/consumer-I.txt (consumer.step_profile)"),
    EnvVar(DECODE_GRAPHS, "user", "0: the batched DFlash propose of launch.py eval runs eagerly on CUDA instead of "
                                  "as CUDA graphs (shared.models.batched_dflash_graphs), to measure one against "
                                  "the other"),
    EnvVar("NNODES", "launcher", "nodes of a multi-node run (with NODE_RANK, MASTER_ADDR, MASTER_PORT)"),
    EnvVar("NODE_RANK", "launcher", "this node's rank"),
    EnvVar("MASTER_ADDR", "launcher", "node 0's address"),
    EnvVar("MASTER_PORT", "launcher", "node 0's rendezvous port"),
    EnvVar("TORCHELASTIC_RUN_ID", "launcher", "set by torchrun: the node contract is then torchrun's own"),
    EnvVar("GROUP_WORLD_SIZE", "launcher", "torchrun: nodes (one process per node)"),
    EnvVar("GROUP_RANK", "launcher", "torchrun: this node"),
    EnvVar("WORLD_SIZE", "launcher", "torchrun: processes (nodes, with --nproc-per-node 1); a consumer: its ranks"),
    EnvVar("RANK", "launcher", "torchrun: this process; a consumer: its data-parallel rank"),
    EnvVar("TORCHELASTIC_USE_AGENT_STORE", "launcher", "true: torchrun's agent hosts the rendezvous store"),
    EnvVar("TORCHELASTIC_RESTART_COUNT", "launcher", "torchrun's restart count (a fresh key prefix per restart)"),
    EnvVar("HF_HUB_CACHE", "user", "the Hugging Face hub cache (else HF_HOME/hub, else ~/.cache/huggingface/hub)"),
    EnvVar("HF_HOME", "user", "the Hugging Face home"),
    EnvVar("XDG_CACHE_HOME", "user", "the cache home HF_HOME defaults under"),
    EnvVar("HF_HUB_OFFLINE", "user", "1/true/yes: no downloads; a hub id must be in the cache"),
    EnvVar("WANDB_MODE", "user", "wandb's mode (default: online with WANDB_API_KEY, else offline)"),
    EnvVar("WANDB_API_KEY", "user", "wandb's key"),
    EnvVar("WANDB_PROJECT", "user", "wandb's project (default specring)"),
    EnvVar("MLFLOW_TRACKING_URI", "user", "MLflow's tracking URI (default: RUN_DIR/mlruns)"),
    EnvVar("MLFLOW_EXPERIMENT_NAME", "user", "MLflow's experiment (default specring)"),
    EnvVar("MLFLOW_ALLOW_FILE_STORE", "specring", "set to true for MLflow's file store under the run directory"),
    EnvVar("TOKENIZERS_PARALLELISM", "specring", "set to false in prepare's workers (one process per core already)"),
    EnvVar("PYTHONUNBUFFERED", "specring", "set to 1 for the tracker worker, whose output is read line by line"),
)


def known(name: str) -> str:
    """``name`` if it is declared in ``VARIABLES``; ``KeyError`` otherwise (a new variable is declared first)."""
    if name not in VARIABLES:
        raise KeyError(f"{name} is not declared in shared/envs.py")
    return name


def put(name: str, value: str) -> None:
    """Set the declared variable ``name`` in this process's environment (its children inherit it)."""
    os.environ[known(name)] = value


def set_default(name: str, value: str) -> None:
    """Set the declared variable ``name`` unless it is already set."""
    os.environ.setdefault(known(name), value)


def get(name: str, default: str | None = None) -> str | None:
    """The raw value of the declared variable ``name`` (``default`` when unset). ``KeyError`` for an undeclared
    name, so a new variable is declared here before it is read."""
    return os.environ.get(known(name), default)


def is_set(name: str) -> bool:
    """Whether the declared variable ``name`` is in the environment (even empty)."""
    return known(name) in os.environ


def flag(name: str, default: bool = False) -> bool:
    """``$name`` as a switch: ``0`` is off, ``1`` is on, unset or empty is ``default``; ``ConfigError`` naming it
    otherwise."""
    text = (get(name) or "").strip()
    if text not in ("", "0", "1"):
        raise ConfigError(f"{name}={text!r} must be 0 or 1")
    return default if text == "" else text == "1"


def seconds(name: str) -> float:
    """``$name`` as seconds (0 when unset or empty); ``ConfigError`` naming it if not a finite number >= 0."""
    text = (get(name) or "").strip()
    if not text:
        return 0.0
    try:
        value = float(text)
    except ValueError:
        raise ConfigError(f"{name}={text!r} is not a number of seconds") from None
    if not 0 <= value < float("inf"):
        raise ConfigError(f"{name}={text!r} must be a finite number >= 0")
    return value


def truthy(name: str) -> bool:
    """``$name`` as the Hugging Face and torchrun libraries read their switches: ``1``, ``true`` or ``yes``."""
    return (get(name) or "").strip().lower() in ("1", "true", "yes")
