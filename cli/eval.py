"""``launch.py eval``: τ of a checkpoint or export beside the baselines, by real speculative decoding.

The table rows: plain greedy decoding (the reference, and the lossless check), the drafter, and the
baselines (an untrained drafter of the same family, prompt lookup), on held-out prompts. The drafter decodes
through its family's proposer (``shared/drafters``): a DFlash or DFlash2 drafter drafts blocks of
``--block-size - 1`` (DFlash2 through its candidate selector); an EAGLE-3 drafter drafts a chain of
``--num-draft-tokens`` one by one, and every row then verifies blocks of ``--num-draft-tokens + 1``; see
docs/evaluation.md for the
standard setting and ``specring.shared.models.speculative`` for what is counted.

Decoding is greedy by default. ``--temperature T`` (> 0), with ``--top-p`` and ``--top-k``, makes every drafter
and baseline row decode by lossless speculative sampling (``SamplingParams``, ``rejection_sample``: the output is
distributed as sampling from the target itself), each row's draws from its own CPU generator seeded with
``--sampling-seed`` (so a row is reproducible on its own). The greedy reference row still runs, as the speed
baseline of ``speedup``, but token equality with it does not apply: the lossless column reads ``n/a`` and
``lossless_mismatches`` is null. The JSON output records the parameters under ``sampling``. Bad values
(negative or non-finite temperature, ``--top-p`` outside (0, 1], negative ``--top-k`` or seed) are a
``ConfigError`` (exit code 2) before anything is loaded.

Batching: the greedy reference and every greedy row decode ``--batch-size`` prompts together (default 64, so the
standard setting's 24 in one group; ``shared.models.batched_decode``): one target forward per step for all of
them, each prompt with its own cache length, acceptance and stop, the same tokens and acceptance lengths as
one prompt at a time (``--batch-size 1``). Sampled rows (``--temperature > 0``), their speed baseline, and
every row on a target with linear-attention or sliding-window layers decode one prompt at a time; each row
of the JSON report says ``batched`` (true/false), ``batch_size``, ``batched_reason`` (why not, when it was
asked) and ``batch_forwards`` (target forwards run), and the table is followed by one line per row that was
not batched. ``tokens_per_s`` is then the group's throughput (the wall time of a group shared by its prompts).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path
from typing import Any

import torch

from specring.shared.drafters import DEFAULT_FAMILY, family_of_export, get_family
from specring.shared.models.batched_decode import batched_greedy_generate, decode_prompts, target_batch_support
from specring.shared.models.ngram import PromptLookupProposer
from specring.shared.models.speculative import (
    SamplingParams,
    check_same_head,
    greedy_generate,
    load_prompts,
    summarize,
    target_vocab_size,
)

logger = logging.getLogger(__name__)


HELP_EXAMPLES = """\
examples:
  launch.py eval --drafter runs/latest                  the run's latest checkpoint on the demo held-out split
  launch.py eval --drafter exported/ --target Qwen/Qwen3-8B --data data/heldout.arrow --num-prompts 64
  launch.py eval --baselines-only --target /models/Qwen3-8B --data data/heldout.arrow
  launch.py eval --drafter runs/latest --temperature 0.7 --top-p 0.95 --sampling-seed 1   speculative sampling"""


def build_parser() -> argparse.ArgumentParser:
    """The parser of ``launch.py eval``, its options grouped by concern, each with its default."""
    from specring.cli.flags import CommandHelpFormatter

    p = argparse.ArgumentParser(prog="launch.py eval", formatter_class=CommandHelpFormatter, epilog=HELP_EXAMPLES,
                                description=(
        "Acceptance length tau by real block-verify speculative decoding with the target (greedy, or lossless "
        "speculative sampling with --temperature > 0), next to the baselines (untrained drafter, prompt lookup); "
        "greedy decoding is checked lossless against plain greedy decoding."))
    m = p.add_argument_group("target and drafter")
    m.add_argument("--drafter", default="none", help="checkpoint step directory, run directory (its latest "
                                                     "checkpoint) or export; none: baselines only")
    m.add_argument("--target", metavar="DIR|ORG/NAME",
                   help="target checkpoint: a directory or a hub id (Qwen/Qwen3-8B) resolved from the local Hugging "
                        "Face cache (default: the run's target, else assets/tiny-code-lm)")
    m.add_argument("--trust-remote-code", action="store_true",
                   help="let transformers run the modelling and tokenizer code the target ships")
    m.add_argument("--device", default="auto", help="auto (cuda when present), cpu, cuda or cuda:N")
    m.add_argument("--dtype", default="auto", help="auto (bfloat16 on CUDA, float32 on CPU), bfloat16, float32")
    d = p.add_argument_group("prompts")
    d.add_argument("--data", nargs="+", help="held-out Arrow file(s) from `launch.py prepare` "
                                             "(default: data/demo/heldout.arrow, built when missing)")
    d.add_argument("--num-prompts", type=int, default=24, help="prompts per dataset")
    d.add_argument("--prompt-len", type=int, default=256, help="prompt = first N tokens of a sample")
    g = p.add_argument_group("decoding")
    g.add_argument("--max-new-tokens", type=int, default=256, help="tokens generated per prompt")
    g.add_argument("--block-size", type=int, help="verify block size B (default: the drafter's, else 16); an "
                                                  "EAGLE-3 drafter drafts B-1 tokens (see --num-draft-tokens)")
    g.add_argument("--num-draft-tokens", type=int,
                   help="EAGLE-3: tokens drafted one by one per verify step (chain drafting; the verify block is "
                        "K+1, also for the baselines); default: the drafter's TTT steps")
    g.add_argument("--batch-size", type=int, default=64,
                   help="prompts decoded together: the greedy reference and every row run all their prompts "
                        "through the target at once (shared.models.batched_decode; the same tokens and acceptance "
                        "lengths); 1: one prompt at a time. Sampling and hybrid linear-attention targets decode one "
                        "prompt at a time whatever this says (the report says why)")
    g.add_argument("--ignore-eos", action="store_true", help="do not stop at the target's EOS token")
    g.add_argument("--no-lossless-check", action="store_true", help="skip the greedy reference decode")
    g.add_argument("--temperature", type=float, default=0.0,
                   help="0: greedy decoding (checked lossless); > 0: speculative sampling at this temperature "
                        "(the greedy row stays as the speed baseline, the lossless check is n/a)")
    g.add_argument("--top-p", type=float, default=1.0,
                   help="nucleus sampling mass in (0, 1] (1: off); with --temperature > 0")
    g.add_argument("--top-k", type=int, default=0, help="sample among the K most likely tokens (0: off); with "
                                                        "--temperature > 0")
    g.add_argument("--sampling-seed", type=int, default=0,
                   help="seed of each row's sampling generator (with --temperature > 0)")
    b = p.add_argument_group("baselines")
    b.add_argument("--baselines-only", action="store_true", help="evaluate only the baselines")
    b.add_argument("--no-baselines", action="store_true", help="skip the untrained-drafter and prompt-lookup rows")
    b.add_argument("--baselines", default="untrained,prompt-lookup",
                   help="comma list of baseline rows: untrained, prompt-lookup")
    b.add_argument("--ngram-max", type=int, default=3, help="longest n-gram of the prompt-lookup baseline")
    b.add_argument("--seed", type=int, default=0, help="initialisation seed of the untrained drafter")
    o = p.add_argument_group("output")
    o.add_argument("--output-json", help="write every figure to this JSON file")
    return p


def _stop_ids(hf_config) -> list[int]:
    eos = getattr(hf_config, "eos_token_id", None)
    if eos is None:
        return []
    return [int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos])]


def sampling_params(args: argparse.Namespace) -> SamplingParams:
    """``SamplingParams`` of ``--temperature``/``--top-p``/``--top-k`` (temperature 0: greedy). Raises
    ``ConfigError`` naming the flag for a negative or non-finite temperature, a top-p outside (0, 1], a
    negative top-k or a negative ``--sampling-seed``; logs a warning when top-p/top-k are set at temperature 0
    (greedy decoding ignores them)."""
    import math

    from specring.shared.errors import ConfigError

    t = float(getattr(args, "temperature", 0.0))
    top_p = float(getattr(args, "top_p", 1.0))
    top_k = int(getattr(args, "top_k", 0))
    seed = int(getattr(args, "sampling_seed", 0))
    if not math.isfinite(t) or t < 0:
        raise ConfigError(f"--temperature: must be a finite number >= 0 (0 = greedy), got {t}")
    if not 0 < top_p <= 1:
        raise ConfigError(f"--top-p: must be in (0, 1] (1 = off), got {top_p}")
    if top_k < 0:
        raise ConfigError(f"--top-k: must be >= 0 (0 = off), got {top_k}")
    if seed < 0:
        raise ConfigError(f"--sampling-seed: must be >= 0, got {seed}")
    if t == 0 and (top_p < 1 or top_k > 0):
        logger.warning("--top-p/--top-k have no effect at --temperature 0 (greedy decoding)")
    return SamplingParams(t, top_p, top_k)


def run_eval(args: argparse.Namespace) -> dict[str, Any]:
    """Everything ``main`` computes, as the JSON it writes (``rows``: one dict per dataset x drafter)."""
    from specring.shared import checkpoint as ckpt
    from specring.shared.config import DEFAULT_TARGET
    from specring.shared.errors import ConfigError
    from specring.shared.models.target import load_target

    batch_size = int(getattr(args, "batch_size", 1))
    for flag, v in (("--num-prompts", args.num_prompts), ("--max-new-tokens", args.max_new_tokens),
                    ("--prompt-len", args.prompt_len), ("--batch-size", batch_size)):
        if v < 1:
            raise ConfigError(f"{flag}: must be >= 1, got {v}")
    sampling = sampling_params(args)
    sampled = not sampling.greedy
    sampling_seed = int(getattr(args, "sampling_seed", 0))
    use_drafter = not args.baselines_only and str(args.drafter).lower() not in ("none", "")
    step_dir = ckpt.resolve_checkpoint(args.drafter) if use_drafter else None
    from specring.shared.hub import resolve_model_dir
    target_dir = resolve_model_dir(args.target or (step_dir and ckpt.target_of_checkpoint(step_dir)) or DEFAULT_TARGET,
                                   "--target")
    trust = bool(getattr(args, "trust_remote_code", False))
    device = "cuda" if args.device == "auto" and torch.cuda.is_available() else (
        "cpu" if args.device == "auto" else args.device)
    target, hf_config = load_target(target_dir, device, args.dtype, trust_remote_code=trust)
    dtype = next(target.parameters()).dtype
    family = None
    if step_dir is not None:
        if ckpt.is_export(step_dir):   # evaluated as served: in its exported dtype, whatever --dtype says
            family = family_of_export(step_dir)
            drafter = family.load_export(step_dir, device)
        else:
            family = get_family(ckpt.drafter_kind(step_dir))
            drafter = ckpt.load_drafter(step_dir, device=device, dtype=dtype)
        check_same_head(drafter, target)
        dcfg = drafter.config
        layer_ids = list(dcfg.target_layer_ids)
    else:  # baselines only: the untrained row is a drafter of the default family sized like the target
        drafter = None
        dcfg = get_family(DEFAULT_FAMILY).config_cls.from_target(target_dir, None, block_size=args.block_size or 16,
                                                                 trust_remote_code=trust)
        layer_ids = list(dcfg.target_layer_ids)
    chain = family is not None and family.drafts_chain   # a chain drafter drafts --num-draft-tokens one by one
    if args.num_draft_tokens is not None and not chain:
        raise ConfigError("--num-draft-tokens: only for a chain drafter such as EAGLE-3 (a block drafter drafts "
                          "--block-size - 1)")
    if args.num_draft_tokens is not None and args.num_draft_tokens < 1:
        raise ConfigError(f"--num-draft-tokens: must be >= 1, got {args.num_draft_tokens}")
    if family is not None:
        bsz = family.verify_block_size(drafter, args.block_size, args.num_draft_tokens)
    else:
        bsz = int(args.block_size or 16)
    if bsz < 2:
        raise ConfigError(f"--block-size: must be >= 2, got {bsz}")
    rows_spec: list[tuple[str, Any]] = []
    if drafter is not None:
        label = f"{family.name} {step_dir.name}" + (f" (chain k={bsz - 1})" if chain else "")
        rows_spec.append((label, family.proposer(drafter, block_size=bsz, num_draft_tokens=bsz - 1)))
    baselines = {b.strip() for b in args.baselines.split(",") if b.strip()}
    if baselines - {"untrained", "prompt-lookup"}:
        raise ConfigError(f"--baselines: unknown {sorted(baselines - {'untrained', 'prompt-lookup'})} "
                          "(known: untrained, prompt-lookup)")
    if not args.no_baselines or drafter is None:
        if "untrained" in baselines:
            fam = family or get_family(DEFAULT_FAMILY)
            like = drafter if drafter is not None else fam.build(dcfg)
            fresh = fam.untrained_like(like, target_dir, device, dtype, args.seed)
            rows_spec.append((f"{fam.name} untrained", fam.proposer(fresh, block_size=bsz, num_draft_tokens=bsz - 1)))
        if "prompt-lookup" in baselines:
            rows_spec.append((f"prompt-lookup (n<={args.ngram_max})",
                              PromptLookupProposer(args.ngram_max, vocab_size=target_vocab_size(target))))
    stop = [] if args.ignore_eos else _stop_ids(hf_config)
    data = [Path(d) for d in args.data] if args.data else None
    if data is None:
        from specring.shared.data.demo import ensure_demo
        data = [ensure_demo()[1]]
    greedy_generate(target, [0, 1, 2, 3], 4)  # warm-up: keep one-time costs out of tokens/s
    if batch_size > 1 and target_batch_support(target) is None:
        batched_greedy_generate(target, [[0, 1, 2, 3], [0, 1]], 4)
    rows = []
    for path in data:
        prompts = load_prompts(path, args.num_prompts, args.prompt_len)
        ref, greedy_rate = None, None
        if not args.no_lossless_check:
            # sampled rows decode one prompt at a time (batch_support): so does their speed baseline
            ref, info = _decode(target, None, prompts, args.max_new_tokens, bsz, None, stop,
                                f"{path.stem}: target greedy", batch_size=1 if sampled else batch_size)
            if sampled and batch_size > 1:
                info["batched_reason"] = "speed baseline of the sampled rows, which decode one prompt at a time"
            rows.append({"dataset": path.stem,
                         "drafter": "target greedy (speed baseline)" if sampled else "target greedy (reference)",
                         **summarize(ref, bsz), "speedup": 1.0, **info})
            greedy_rate = rows[-1]["tokens_per_s"]
        for name, proposer in rows_spec:
            gen = torch.Generator().manual_seed(sampling_seed) if sampled else None  # per row: reproducible alone
            res, info = _decode(target, proposer, prompts, args.max_new_tokens, bsz, layer_ids, stop,
                                f"{path.stem}: {name}", batch_size=batch_size,
                                sampling=sampling if sampled else None, generator=gen)
            row = {"dataset": path.stem, "drafter": name, **summarize(res, bsz), **info}
            if ref is not None:
                row["lossless_mismatches"] = None if sampled else sum(r.tokens != g.tokens for r, g in zip(res, ref))
                row["speedup"] = row["tokens_per_s"] / greedy_rate if greedy_rate and row["tokens_per_s"] else None
            rows.append(row)
            logger.info("eval dataset=%s drafter=%r tau_mean=%s", path.stem, name, row["tau_mean"])
    return {"target": str(target_dir), "drafter": str(step_dir) if step_dir else None,
            "drafter_kind": family.name if family is not None else None, "device": device,
            "dtype": str(dtype).replace("torch.", ""), "block_size": bsz, "num_prompts": args.num_prompts,
            "prompt_len": args.prompt_len, "max_new_tokens": args.max_new_tokens, "stop_token_ids": stop,
            "batch_size": batch_size,
            "target_layer_ids": layer_ids,
            "sampling": {**sampling.to_dict(), "seed": sampling_seed if sampled else None},
            "lossless_check": ("not applicable: sampled decoding (temperature > 0)" if sampled else
                               ("skipped" if args.no_lossless_check else "token equality with greedy decoding")),
            "rows": rows}


def _decode(target, proposer, prompts: list[list[int]], max_new_tokens: int, bsz: int, layer_ids, stop, desc: str,
            **kw) -> tuple[list, dict[str, Any]]:
    """``decode_prompts`` under a progress bar (one tick per finished prompt); returns its results and its info
    (``batched``, ``batch_size``, ``batched_reason``, ``batch_forwards``: the row's fields in the report)."""
    from tqdm import tqdm
    with tqdm(total=len(prompts), desc=desc, unit="prompt", file=sys.stderr, leave=False, dynamic_ncols=True) as bar:
        return decode_prompts(target, proposer, prompts, max_new_tokens, bsz, layer_ids, stop, on_done=bar.update,
                              **kw)


def _close_progress_bars() -> None:
    """Close the tqdm bars still open (a decode raised inside one), ending their line on stderr."""
    from tqdm import tqdm
    bars = list(getattr(tqdm, "_instances", ()))
    for bar in bars:
        bar.close()
    if bars and not sys.stderr.isatty():  # off a terminal a closed bar leaves its last state on the line
        sys.stderr.write("\n")


def format_table(report: dict[str, Any]) -> str:
    """The report's rows as a fixed-width table."""
    def f(v, spec):
        return "-" if v is None else format(v, spec)

    head = (f"{'dataset':<12} {'drafter':<30} {'prompts':>7} {'tau mean':>8} {'p50':>5} {'p90':>5} "
            f"{'fwd/tok':>7} {'tok/s':>8} {'speedup':>7} {'lossless':>8}")
    lines = [head, "-" * len(head)]
    sampled = (report.get("sampling") or {}).get("temperature", 0) > 0
    for r in report["rows"]:
        mism = r.get("lossless_mismatches")
        if sampled and not r["drafter"].startswith("target greedy"):
            lossless = "n/a"
        else:
            lossless = "-" if mism is None else ("yes" if mism == 0 else f"NO ({mism})")
        lines.append(f"{r['dataset'][:12]:<12} {r['drafter'][:30]:<30} {r['num_prompts']:>7} "
                     f"{f(r['tau_mean'], '.3f'):>8} {f(r['tau_p50'], '.1f'):>5} {f(r['tau_p90'], '.1f'):>5} "
                     f"{f(r['forwards_per_token'], '.3f'):>7} {f(r['tokens_per_s'], '.1f'):>8} "
                     f"{f(r.get('speedup'), '.2f'):>7} {lossless:>8}")
    return "\n".join(lines)


def _decoding_line(sampling: dict[str, Any]) -> str:
    if not sampling["temperature"] > 0:
        return "greedy"
    return (f"sampling T={sampling['temperature']:g} top-p={sampling['top_p']:g} top-k={sampling['top_k']} "
            f"seed={sampling['seed']} (lossless check n/a)")


def check_eval_output(args: argparse.Namespace) -> None:
    """Refuse an ``--output-json`` that names a file the evaluation reads or that describes it: a file of the
    checkpoint or export, a record of its run directory (``shared.run_dir.RECORD_FILES``), a file of the
    target's directory, a ``--data`` file or its sidecar (``shared.outputs.check_outputs``; ``ConfigError``
    naming ``--output-json``)."""
    from specring.shared import checkpoint as ckpt
    from specring.shared.data.dataset import sidecar_path
    from specring.shared.outputs import check_outputs
    from specring.shared.run_dir import RECORD_FILES

    inputs: dict[str, Any] = {}
    if not args.baselines_only and str(args.drafter).lower() not in ("none", ""):
        step_dir = ckpt.resolve_checkpoint(args.drafter)
        inputs["drafter"] = step_dir
        run_dir = Path(step_dir).resolve().parent.parent
        if (run_dir / "config.json").is_file() and not ckpt.is_export(step_dir):
            inputs.update({f"run record {name}": run_dir / name for name in RECORD_FILES})
        inputs["target directory"] = ckpt.target_of_checkpoint(step_dir)
    if args.target and Path(args.target).is_dir():
        inputs["target directory"] = args.target
    for d in args.data or []:
        inputs.update({f"--data {d}": d, f"sidecar of --data {d}": sidecar_path(d)})
    check_outputs("--output-json", {"report": args.output_json}, inputs)


def main(argv: list[str] | None = None) -> int:
    """``launch.py eval``: print the τ table (and write ``--output-json``). Exit code 0; 2 for a bad flag
    or input (an ``--output-json`` that names what the evaluation reads: ``check_eval_output``); 1, with one
    ``error: evaluation failed: <type>: <message>`` line (no traceback), when decoding
    raised; 1 when, in float32, a greedy speculative output differed from greedy decoding (a bug: decoding
    is lossless; with ``--temperature > 0`` there is no token check). In bfloat16/float16 that is only a
    warning: the verify forward over ``k + 1`` tokens and the one-token greedy step round differently, so a
    near-tie of the two best logits can flip."""
    from specring.shared.errors import ConfigError

    args = build_parser().parse_args(argv)
    from specring.shared.logs import configure_logging
    configure_logging("eval")
    try:
        if args.output_json:
            check_eval_output(args)
        report = run_eval(args)
    except (ConfigError, ValueError, FileNotFoundError, KeyError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except Exception as e:  # noqa: BLE001 - decoding failed: one clear line, the traceback in the log at debug
        logger.debug("eval failed", exc_info=True)
        _close_progress_bars()  # the interrupted prompt bar would otherwise share the error's line
        msg = " ".join(str(e).split())
        print(f"error: evaluation failed: {type(e).__name__}: {msg}", file=sys.stderr)
        return 1
    print(f"target {report['target']}  drafter {report['drafter'] or 'none'}  B={report['block_size']}  "
          f"prompt {report['prompt_len']} tokens, {report['max_new_tokens']} new, {report['device']} "
          f"{report['dtype']}, {_decoding_line(report['sampling'])}")
    print(format_table(report))
    unbatched = [r for r in report["rows"] if report.get("batch_size", 1) > 1 and r.get("batched") is False]
    for r in unbatched:
        print(f"{r['drafter']}: decoded one prompt at a time ({r.get('batched_reason')})")
    if any(r.get("cache_rollback") == "replay" for r in report["rows"]):
        print("target cache: linear-attention states restored after a partial acceptance and the accepted tokens "
              "re-run (counted in fwd/tok)")
    if args.output_json:
        Path(args.output_json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.output_json).write_text(json.dumps(report, indent=1) + "\n")
    bad = [r["drafter"] for r in report["rows"] if r.get("lossless_mismatches")]
    if bad and report["dtype"] == "float32":
        print(f"error: speculative output differs from greedy decoding for {bad}", file=sys.stderr)
        return 1
    if bad:  # 16-bit: a (k+1)-token verify and a 1-token step round differently; a near-tie can flip
        print(f"warning: speculative output differs from greedy decoding for {bad} in {report['dtype']}; "
              "rerun with --dtype float32 to tell a numerical near-tie from a bug", file=sys.stderr)
    return 0
