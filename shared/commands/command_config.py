"""The options of ``launch.py eval``, ``export``, ``regenerate``, ``prepare``, ``status``, ``restart``, ``clean``
and ``report``, declared like the run's configuration (``specring.shared.config.run_config``).

Each command's options are one keyword-only dataclass (``EvalConfig``, ``ExportConfig``, ``RegenerateConfig``,
``PrepareConfig``, ``StatusConfig``, ``RestartConfig``, ``CleanConfig``, ``ReportConfig``) whose fields are
declared with ``setting``/``num``: type, default, bounds, choices and help line. An option that several commands
take (``--target``, ``--trust-remote-code``, ``--dtype``, ``--drafter``, ``--max-new-tokens``, ``--temperature``,
``--seed``, ``--no-progress``) is declared once, in an option group (``TargetOptions``, ``RemoteCodeOptions``, ...),
and composed into each command's class as one of its dataclass bases, so it has one declaration and one help line
everywhere. A command's ``HELP_GROUPS`` places every field in a ``--help`` group (title -> field names, in order;
``POSITIONALS`` and ``OPTIONS`` name argparse's own groups), and ``REQUIRED`` names the fields of a shared group
that this command requires (``regenerate`` needs ``--target``; ``eval`` and ``export`` default to the run's
target).

From the declaration come (``specring.cli.flags``, ``shared.config.run_config.option_specs``): each command's flags
(``--FIELD-NAME``, typed parsing, ``--help`` with every default) and the checks of every value when the object is
built (``check_fields``: bounds, choices, required; ``ConfigError`` naming the field, which the command line names
by its flag). The commands' library code takes the built object.

Every flag name, default and choice here is the command line's contract (tests and docs use them).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from specring.shared.config.run_config import MAX_INT32, MAX_SEED, check_fields, num, setting
from specring.shared.data.demo import DEMO_MAX_LENGTH
from specring.shared.paths import DEFAULT_TARGET
from specring.shared.run.run_dir import RunDir

DTYPES = ("auto", "bfloat16", "float16", "float32")  # auto + shared.machine.devices.MODEL_DTYPES
BASELINES = ("untrained", "prompt-lookup")            # the baseline rows of launch.py eval
BACKENDS = ("auto", "transformers", "vllm", "sglang")  # shared.data.regenerate.pick_backend
PREPARE_MAX_LENGTH = 2048                             # tokens per sample of launch.py prepare without --demo
# the --help groups argparse prints anyway: a HELP_GROUPS title of these is that group (cli.flags.command_parser)
POSITIONALS, OPTIONS = "positional arguments", "options"


# ------------------------------------------------------------------------- option groups (several commands)

@dataclass(kw_only=True)
class DrafterOptions:
    """``--drafter`` (eval, export): the trained drafter a command reads."""
    drafter: str | None = setting(None, path=True,
                                  help="a trained drafter: a checkpoint step directory or a run directory (its latest "
                                       "checkpoint); eval also takes an export, and none (the baselines only)")


@dataclass(kw_only=True)
class TargetOptions:
    """``--target`` (eval, export, regenerate): the target model; none: the one the drafter's run trained with."""
    target: str | None = setting(None, path=True, metavar="DIR|ORG/NAME",
                                 default_text="the run's target, else assets/tiny-code-lm",
                                 help="target checkpoint: a directory (Hugging Face format) or a hub id "
                                      "(Qwen/Qwen3-8B), resolved from the local Hugging Face cache")


@dataclass(kw_only=True)
class RemoteCodeOptions:
    """``--trust-remote-code`` (eval, export, regenerate, prepare)."""
    trust_remote_code: bool = setting(False, switch=True,
                                      help="let transformers (and vLLM/SGLang) run the modelling and tokenizer code "
                                           "that the model's directory ships (model families outside transformers)")


@dataclass(kw_only=True)
class DtypeOptions:
    """``--dtype`` (eval, regenerate: the target as loaded; export: the drafter as written)."""
    dtype: str = setting("auto", choices=DTYPES,
                         help="dtype of the target's weights as loaded (eval, regenerate; auto: bfloat16 on CUDA, "
                              "float32 on CPU), or of the drafter as written (export; auto: the target's own)")


@dataclass(kw_only=True)
class GenerationOptions:
    """What the target generates (eval, regenerate): ``--max-new-tokens``, ``--temperature``, ``--seed``."""
    max_new_tokens: int = num(256, ge=1, le=2**20,
                              help="tokens generated per prompt (per assistant turn of a chat sample)")
    temperature: float = num(0.0, ge=0, le=1e6, help="sampling temperature; 0: greedy decoding")
    seed: int = num(0, ge=0, le=MAX_SEED,
                    help="seed of the command's random numbers: the untrained drafter's initialisation (eval; its "
                         "sampling has --sampling-seed), sampling at --temperature > 0 (regenerate)")


@dataclass(kw_only=True)
class ProgressOptions:
    """``--no-progress`` (regenerate, prepare)."""
    no_progress: bool = setting(False, switch=True, help="no progress bar")


# ------------------------------------------------------------------------------------------------ commands

@dataclass(kw_only=True)
class EvalConfig(DrafterOptions, TargetOptions, RemoteCodeOptions, DtypeOptions, GenerationOptions):
    """``launch.py eval``: tau of a drafter beside the baselines (``specring.shared.commands.evaluation``). Decoding
    parameters are checked here (``ConfigError`` naming the field); what depends on the drafter (``--block-size``
    of a chain drafter, ``--num-draft-tokens``) when it is loaded."""
    HELP_GROUPS: ClassVar[dict[str, tuple[str, ...]]] = {
        "target and drafter": ("drafter", "target", "trust_remote_code", "device", "dtype"),
        "prompts": ("data", "num_prompts", "prompt_len"),
        "decoding": ("max_new_tokens", "block_size", "num_draft_tokens", "batch_size", "ignore_eos",
                     "no_lossless_check", "temperature", "top_p", "top_k", "sampling_seed"),
        "baselines": ("baselines_only", "no_baselines", "baselines", "ngram_max", "seed"),
        "output": ("output_json",),
    }
    device: str = setting("auto", metavar="DEVICE", help="auto (cuda when present), cpu, cuda or cuda:N")
    data: list[str] = setting([], path=True, nargs="+",
                              default_text="data/demo/heldout.arrow, built when missing",
                              help="held-out Arrow file(s) from `launch.py prepare`")
    num_prompts: int = num(24, ge=1, le=2**20, help="prompts per dataset")
    prompt_len: int = num(256, ge=1, le=MAX_INT32, help="prompt = first N tokens of a sample")
    block_size: int | None = num(None, ge=2, le=1024, default_text="the drafter's, else 16",
                                 help="verify block size B; an EAGLE-3 drafter drafts B-1 tokens (see "
                                      "--num-draft-tokens)")
    num_draft_tokens: int | None = num(None, ge=1, le=1024, default_text="the drafter's TTT steps",
                                       help="EAGLE-3: tokens drafted one by one per verify step (chain drafting; "
                                            "the verify block is K+1, also for the baselines)")
    batch_size: int = num(64, ge=1, le=2**16,
                          help="prompts decoded together: the greedy reference and every row run all their prompts "
                               "through the target at once (shared.models.batched_decode; the same tokens and "
                               "acceptance lengths); 1: one prompt at a time. Sampling and hybrid linear-attention "
                               "targets decode one prompt at a time whatever this says (the report says why)")
    ignore_eos: bool = setting(False, switch=True, help="do not stop at the target's EOS token")
    no_lossless_check: bool = setting(False, switch=True, help="skip the greedy reference decode")
    top_p: float = num(1.0, gt=0, le=1, help="nucleus sampling mass in (0, 1] (1: off); with --temperature > 0")
    top_k: int = num(0, ge=0, le=2**24, help="sample among the K most likely tokens (0: off); with --temperature > 0")
    sampling_seed: int = num(0, ge=0, le=MAX_SEED,
                             help="seed of each row's sampling generator (with --temperature > 0)")
    baselines_only: bool = setting(False, switch=True, help="evaluate only the baselines")
    no_baselines: bool = setting(False, switch=True, help="skip the untrained-drafter and prompt-lookup rows")
    baselines: list[str] = setting(list(BASELINES), choices=BASELINES, metavar="NAME,...",
                                   help=f"comma list of baseline rows: {', '.join(BASELINES)}")
    ngram_max: int = num(3, ge=1, le=1024, help="longest n-gram of the prompt-lookup baseline")
    output_json: str | None = setting(None, path=True, help="write every figure to this JSON file")

    def __post_init__(self):
        check_fields(self)

    @property
    def uses_drafter(self) -> bool:
        """Whether a drafter is evaluated (``--drafter`` given and not none, no ``--baselines-only``)."""
        return not self.baselines_only and self.drafter not in (None, "") and self.drafter.lower() != "none"


@dataclass(kw_only=True)
class ExportConfig(DrafterOptions, TargetOptions, RemoteCodeOptions, DtypeOptions):
    """``launch.py export``: a checkpoint in the serving engines' format (``DrafterFamily.export``)."""
    HELP_GROUPS: ClassVar[dict[str, tuple[str, ...]]] = {
        "checkpoint and target": ("drafter", "target", "trust_remote_code"),
        "output": ("output", "dtype", "overwrite"),
    }
    REQUIRED: ClassVar[tuple[str, ...]] = ("drafter",)
    output: str = setting(path=True, help="directory to write")
    overwrite: bool = setting(False, switch=True, help="replace a non-empty --output directory")

    def __post_init__(self):
        check_fields(self)


@dataclass(kw_only=True)
class RegenerateConfig(TargetOptions, RemoteCodeOptions, DtypeOptions, GenerationOptions, ProgressOptions):
    """``launch.py regenerate``: training data written by the target (``specring.shared.data.regenerate``)."""
    HELP_GROUPS: ClassVar[dict[str, tuple[str, ...]]] = {
        "target": ("target", "trust_remote_code", "dtype"),
        "data": ("input", "output", "max_samples", "prefix_len", "stride", "include_input"),
        "generation": ("max_new_tokens", "temperature", "seed"),
        "running": ("devices", "backend", "batch_size", "shard_size", "no_progress"),
    }
    REQUIRED: ClassVar[tuple[str, ...]] = ("target",)
    input: str = setting(path=True, help="Arrow file from `launch.py prepare`")
    output: str = setting(path=True, help="Arrow file to write (sidecar .json beside it)")
    max_samples: int = num(0, ge=0, le=2**40, help="regenerate only the first M input samples (0: all)")
    prefix_len: int = num(256, ge=1, le=MAX_INT32, help="plain text: prompt tokens")
    stride: int = num(0, ge=0, le=MAX_INT32, help="plain text: a prompt every S tokens (0: one per sample)")
    include_input: bool = setting(False, switch=True, help="also write the input samples unchanged (a mix)")
    devices: str = setting("auto", metavar="DEVICES", help="cpu, cuda:0,cuda:1, ... (auto: every GPU, else cpu)")
    backend: str = setting("auto", choices=BACKENDS,
                           help="how the target generates; auto: vllm or sglang when installed, else transformers")
    batch_size: int = num(256, ge=1, le=2**20, help="prompts per generate call (transformers backend)")
    shard_size: int = num(1024, ge=1, le=2**30, help="input samples per resumable shard")

    def __post_init__(self):
        check_fields(self)


@dataclass(kw_only=True)
class PrepareConfig(RemoteCodeOptions, ProgressOptions):
    """``launch.py prepare``: rows tokenized into an Arrow file (``specring.shared.data.prepare``), or the demo
    corpus (``specring.shared.data.demo``). ``max_length``/``workers`` none: the command's default (see their
    help)."""
    HELP_GROUPS: ClassVar[dict[str, tuple[str, ...]]] = {
        "input and output": ("inputs", "input", "output"),
        "tokenizer": ("tokenizer", "trust_remote_code", "chat_template"),
        "samples": ("max_length", "overlong", "strict"),
        "running": ("workers", "no_progress"),
        "demo corpus": ("demo", "demo_dir"),
    }
    inputs: list[str] = setting([], positional=True, nargs="*", help="JSONL/Parquet files, directories or globs")
    input: list[str] = setting([], path=True, repeat=True, default_text="none",
                               help="another input (repeatable)")
    output: str | None = setting(None, path=True,
                                 help="Arrow file to write, its sidecar beside it with the suffix .json (required "
                                      "unless --demo)")
    tokenizer: str = setting(str(DEFAULT_TARGET), path=True, metavar="DIR|ORG/NAME", default_text="assets/tiny-code-lm",
                             help="the target's tokenizer: a directory or a hub id (Qwen/Qwen3-8B), resolved from the "
                                  "local Hugging Face cache")
    chat_template: str | None = setting(None, path=True,
                                        help="a Jinja chat template file to use instead of the tokenizer's")
    max_length: int | None = num(None, ge=1, le=MAX_INT32,
                                 default_text=f"{PREPARE_MAX_LENGTH}; {DEMO_MAX_LENGTH} for --demo",
                                 help="tokens per sample")
    overlong: str = setting("truncate", choices=("truncate", "drop"),
                            help="what to do with samples longer than --max-length")
    strict: bool = setting(False, switch=True, help="stop with an error at the first bad row")
    workers: int | None = num(None, ge=1, le=1024,
                              default_text="min(8, CPUs); 1 for --demo, whose whole-file batches the Rust tokenizer "
                                           "already spreads over threads",
                              help="tokenizer processes, 1 = in this process")
    demo: bool = setting(False, switch=True, help="build the stdlib demo corpus (train + held-out)")
    demo_dir: str | None = setting(None, path=True, default_text="./data/demo", help="where --demo writes")

    def __post_init__(self):
        check_fields(self)


# ------------------------------------------------------------------------ commands that talk to a run

def _latest_run() -> str:
    """``runs/latest`` of the current directory (``RunDir.latest_link``), as the flag's value."""
    return str(RunDir.latest_link())


@dataclass(kw_only=True)
class StatusConfig:
    """``launch.py status``: one line per process of a running run, or (``serve``) its live page
    (``specring.supervisor.live_page``). ``port``/``refresh_s`` are checked only with ``--serve`` (by the
    command)."""
    HELP_GROUPS: ClassVar[dict[str, tuple[str, ...]]] = {
        OPTIONS: ("run_dir", "json"),
        "live page (--serve: the plots of `launch.py report` and this table, in a browser)":
            ("serve", "port", "host", "refresh_s"),
    }
    run_dir: str = setting("runs/latest", metavar="RUN_DIR", default_text="runs/latest", machine_default=_latest_run,
                           help="the run to ask")
    json: bool = setting(False, switch=True, help="print the raw status as JSON")
    serve: bool = setting(False, switch=True,
                          help="serve a read-only live page of the run (refreshed from the run directory) until "
                               "Ctrl-C; prints its URL, which holds a random token")
    port: int = num(0, metavar="PORT", help="port of --serve (0: a free one)")
    host: str = setting("127.0.0.1", metavar="HOST", help="address --serve listens on (loopback unless told)")
    refresh_s: float = num(5.0, metavar="REFRESH_S", help="seconds between two refreshes of the live page")

    def __post_init__(self):
        check_fields(self)


@dataclass(kw_only=True)
class RestartConfig:
    """``launch.py restart producer N``: a graceful restart of one producer of a running run. ``index`` is
    checked by the command (``0 <= N < 2**16``)."""
    HELP_GROUPS: ClassVar[dict[str, tuple[str, ...]]] = {
        POSITIONALS: ("role", "index"),
        OPTIONS: ("run_dir",),
    }
    role: str = setting(positional=True, choices=("producer",), help="only producers can be restarted")
    index: int = num(positional=True, help="producer index (the number after producer- in `launch.py status`)")
    run_dir: str = setting("runs/latest", metavar="RUN_DIR", default_text="runs/latest", machine_default=_latest_run,
                           help="the run")

    def __post_init__(self):
        check_fields(self)


@dataclass(kw_only=True)
class CleanConfig:
    """``launch.py clean``: what runs whose supervisor died left behind (``./runs`` is always looked in)."""
    HELP_GROUPS: ClassVar[dict[str, tuple[str, ...]]] = {OPTIONS: ("run_dir",)}
    run_dir: list[str] = setting([], repeat=True, metavar="RUN_DIR", default_text="none",
                                 help="also look in this run directory (repeatable)")

    def __post_init__(self):
        check_fields(self)


@dataclass(kw_only=True)
class ReportConfig:
    """``launch.py report``: the report of one run or several (``specring.supervisor.report.write_report``);
    ``output`` empty: its default."""
    HELP_GROUPS: ClassVar[dict[str, tuple[str, ...]]] = {
        POSITIONALS: ("run_dirs",),
        OPTIONS: ("output", "eval"),
    }
    run_dirs: list[str] = setting(positional=True, nargs="+", metavar="RUN_DIR",
                                  help="run directories (several: compared)")
    output: str = setting("", metavar="OUTPUT",
                          default_text="RUN_DIR/report for one run, ./reports/A-vs-B for several",
                          help="directory for index.html and the PNGs")
    eval: list[str] = setting([], repeat=True, metavar="FILE", default_text="none",
                              help="an eval JSON of `launch.py eval --output-json` (repeatable): its prompt-lookup and "
                                   "untrained rows become lines on the tau plot")

    def __post_init__(self):
        check_fields(self)


COMMAND_CONFIGS: dict[str, type] = {"eval": EvalConfig, "export": ExportConfig, "regenerate": RegenerateConfig,
                                    "prepare": PrepareConfig, "status": StatusConfig, "restart": RestartConfig,
                                    "clean": CleanConfig, "report": ReportConfig}
