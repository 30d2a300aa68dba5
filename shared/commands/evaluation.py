"""τ of a checkpoint or export beside the baselines, by real speculative decoding: the library side of ``launch.py
eval`` (``specring.cli.eval`` parses its flags into ``shared.commands.command_config.EvalConfig`` and calls
``run_eval``).

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
(negative or non-finite temperature, ``--top-p`` outside (0, 1], negative ``--top-k`` or seed) are refused
by ``EvalConfig`` itself (a ``ConfigError`` naming the flag, exit code 2) before anything is loaded.

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

import logging
import sys
from pathlib import Path
from typing import Any

import torch

from specring.shared.commands.command_config import EvalConfig
from specring.shared.data.prompts import load_prompts
from specring.shared.drafters import DEFAULT_FAMILY, family_of_export, get_family
from specring.shared.errors import ConfigError
from specring.shared.models.batched_decode import (
    batched_greedy_generate,
    decode_attention_backends,
    decode_prompts,
    target_batch_support,
)
from specring.shared.models.ngram import PromptLookupProposer
from specring.shared.models.speculative import (
    SamplingParams,
    check_same_head,
    greedy_generate,
    summarize,
    target_vocab_size,
)

logger = logging.getLogger(__name__)


def _stop_ids(hf_config) -> list[int]:
    eos = getattr(hf_config, "eos_token_id", None)
    if eos is None:
        return []
    return [int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos])]


def sampling_params(cfg: EvalConfig) -> SamplingParams:
    """``SamplingParams`` of ``--temperature``/``--top-p``/``--top-k`` (temperature 0: greedy); their ranges are
    ``EvalConfig``'s. Logs a warning when top-p/top-k are set at temperature 0 (greedy decoding ignores them)."""
    if cfg.temperature == 0 and (cfg.top_p < 1 or cfg.top_k > 0):
        logger.warning("--top-p/--top-k have no effect at --temperature 0 (greedy decoding)")
    return SamplingParams(cfg.temperature, cfg.top_p, cfg.top_k)


def run_eval(cfg: EvalConfig) -> dict[str, Any]:
    """Load the target and the drafter of ``cfg`` and decode every row on every dataset; returns the report, the
    JSON ``launch.py eval --output-json`` writes (``rows``: one dict per dataset x drafter). Raises
    ``ConfigError`` naming the flag for what only the loaded drafter tells (``--num-draft-tokens`` of a block
    drafter, a verify block under 2), ``ValueError``/``FileNotFoundError`` for an unreadable checkpoint or
    target; a failure while decoding propagates as raised."""
    from specring.shared.drafters import checkpoint as ckpt
    from specring.shared.models.hub import resolve_model_dir
    from specring.shared.models.target import load_target
    from specring.shared.paths import DEFAULT_TARGET

    batch_size = cfg.batch_size
    sampling = sampling_params(cfg)
    sampled = not sampling.greedy
    sampling_seed = cfg.sampling_seed
    step_dir = ckpt.resolve_checkpoint(cfg.drafter) if cfg.uses_drafter else None
    target_dir = resolve_model_dir(cfg.target or (step_dir and ckpt.target_of_checkpoint(step_dir)) or DEFAULT_TARGET,
                                   "--target")
    trust = cfg.trust_remote_code
    device = "cuda" if cfg.device == "auto" and torch.cuda.is_available() else (
        "cpu" if cfg.device == "auto" else cfg.device)
    target, hf_config = load_target(target_dir, device, cfg.dtype, trust_remote_code=trust)
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
        dcfg = get_family(DEFAULT_FAMILY).config_cls.from_target(target_dir, None, block_size=cfg.block_size or 16,
                                                                 trust_remote_code=trust)
        layer_ids = list(dcfg.target_layer_ids)
    chain = family is not None and family.drafts_chain   # a chain drafter drafts --num-draft-tokens one by one
    if cfg.num_draft_tokens is not None and not chain:
        raise ConfigError("--num-draft-tokens: only for a chain drafter such as EAGLE-3 (a block drafter drafts "
                          "--block-size - 1)")
    if family is not None:
        bsz = family.verify_block_size(drafter, cfg.block_size, cfg.num_draft_tokens)
    else:
        bsz = int(cfg.block_size or 16)
    if bsz < 2:
        raise ConfigError(f"--block-size: must be >= 2, got {bsz}")
    rows_spec: list[tuple[str, Any]] = []
    if drafter is not None:
        label = f"{family.name} {step_dir.name}" + (f" (chain k={bsz - 1})" if chain else "")
        rows_spec.append((label, family.proposer(drafter, block_size=bsz, num_draft_tokens=bsz - 1)))
    baselines = set(cfg.baselines)
    if not cfg.no_baselines or drafter is None:
        if "untrained" in baselines:
            fam = family or get_family(DEFAULT_FAMILY)
            like = drafter if drafter is not None else fam.build(dcfg)
            fresh = fam.untrained_like(like, target_dir, device, dtype, cfg.seed)
            rows_spec.append((f"{fam.name} untrained", fam.proposer(fresh, block_size=bsz, num_draft_tokens=bsz - 1)))
        if "prompt-lookup" in baselines:
            rows_spec.append((f"prompt-lookup (n<={cfg.ngram_max})",
                              PromptLookupProposer(cfg.ngram_max, vocab_size=target_vocab_size(target))))
    stop = [] if cfg.ignore_eos else _stop_ids(hf_config)
    data = [Path(d) for d in cfg.data] if cfg.data else None
    if data is None:
        from specring.shared.data.demo import ensure_demo
        data = [ensure_demo()[1]]
    with decode_attention_backends():  # warm-up: keep one-time costs out of tokens/s, on the decode's kernels
        greedy_generate(target, [0, 1, 2, 3], 4)
        if batch_size > 1 and target_batch_support(target) is None:
            batched_greedy_generate(target, [[0, 1, 2, 3], [0, 1]], 4)
    rows = []
    for path in data:
        prompts = load_prompts(path, cfg.num_prompts, cfg.prompt_len)
        ref, greedy_rate = None, None
        if not cfg.no_lossless_check:
            # sampled rows decode one prompt at a time (batch_support): so does their speed baseline
            ref, info = _decode(target, None, prompts, cfg.max_new_tokens, bsz, None, stop,
                                f"{path.stem}: target greedy", batch_size=1 if sampled else batch_size)
            if sampled and batch_size > 1:
                info["batched_reason"] = "speed baseline of the sampled rows, which decode one prompt at a time"
            rows.append({"dataset": path.stem,
                         "drafter": "target greedy (speed baseline)" if sampled else "target greedy (reference)",
                         **summarize(ref, bsz), "speedup": 1.0, **info})
            greedy_rate = rows[-1]["tokens_per_s"]
        for name, proposer in rows_spec:
            gen = torch.Generator().manual_seed(sampling_seed) if sampled else None  # per row: reproducible alone
            res, info = _decode(target, proposer, prompts, cfg.max_new_tokens, bsz, layer_ids, stop,
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
            "dtype": str(dtype).replace("torch.", ""), "block_size": bsz, "num_prompts": cfg.num_prompts,
            "prompt_len": cfg.prompt_len, "max_new_tokens": cfg.max_new_tokens, "stop_token_ids": stop,
            "batch_size": batch_size,
            "target_layer_ids": layer_ids,
            "sampling": {**sampling.to_dict(), "seed": sampling_seed if sampled else None},
            "lossless_check": ("not applicable: sampled decoding (temperature > 0)" if sampled else
                               ("skipped" if cfg.no_lossless_check else "token equality with greedy decoding")),
            "rows": rows}


def _decode(target, proposer, prompts: list[list[int]], max_new_tokens: int, bsz: int, layer_ids, stop, desc: str,
            **kw) -> tuple[list, dict[str, Any]]:
    """``decode_prompts`` under a progress bar (one tick per finished prompt); returns its results and its info
    (``batched``, ``batch_size``, ``batched_reason``, ``batch_forwards``: the row's fields in the report)."""
    from tqdm import tqdm
    with tqdm(total=len(prompts), desc=desc, unit="prompt", file=sys.stderr, leave=False, dynamic_ncols=True) as bar:
        return decode_prompts(target, proposer, prompts, max_new_tokens, bsz, layer_ids, stop, on_done=bar.update,
                              **kw)


def close_progress_bars() -> None:
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


def decoding_line(sampling: dict[str, Any]) -> str:
    """How the report's rows decoded: ``greedy``, or the sampling parameters."""
    if not sampling["temperature"] > 0:
        return "greedy"
    return (f"sampling T={sampling['temperature']:g} top-p={sampling['top_p']:g} top-k={sampling['top_k']} "
            f"seed={sampling['seed']} (lossless check n/a)")


def check_eval_output(cfg: EvalConfig) -> None:
    """Refuse an ``--output-json`` that names a file the evaluation reads or that describes it: a file of the
    checkpoint or export, a record of its run directory (``shared.run.run_dir.RunDir.records``), a file of the
    target's directory, a ``--data`` file or its sidecar (``shared.config.outputs.check_outputs``; ``ConfigError``
    naming ``--output-json``). Nothing to check without ``--output-json``."""
    from specring.shared.config.outputs import check_outputs
    from specring.shared.data.dataset import sidecar_path
    from specring.shared.drafters import checkpoint as ckpt
    from specring.shared.run.run_dir import RunDir

    if not cfg.output_json:
        return
    inputs: dict[str, Any] = {}
    if cfg.uses_drafter:
        step_dir = ckpt.resolve_checkpoint(cfg.drafter)
        inputs["drafter"] = step_dir
        run = RunDir.of_checkpoint(step_dir)
        if run.is_run and not ckpt.is_export(step_dir):
            inputs.update(run.records(dirs=False))
        inputs["target directory"] = ckpt.target_of_checkpoint(step_dir)
    if cfg.target and Path(cfg.target).is_dir():
        inputs["target directory"] = cfg.target
    for d in cfg.data:
        inputs.update({f"--data {d}": d, f"sidecar of --data {d}": sidecar_path(d)})
    check_outputs("--output-json", {"report": cfg.output_json}, inputs)


def report_lines(report: dict[str, Any]) -> list[str]:
    """What ``launch.py eval`` prints of a report: a header line (target, drafter, block, prompt, device, dtype,
    decoding), the table (``format_table``), one line per row that was asked to batch and decoded one prompt at
    a time, and a note when a linear-attention cache was replayed."""
    lines = [f"target {report['target']}  drafter {report['drafter'] or 'none'}  B={report['block_size']}  "
             f"prompt {report['prompt_len']} tokens, {report['max_new_tokens']} new, {report['device']} "
             f"{report['dtype']}, {decoding_line(report['sampling'])}", format_table(report)]
    for r in report["rows"]:
        if report.get("batch_size", 1) > 1 and r.get("batched") is False:
            lines.append(f"{r['drafter']}: decoded one prompt at a time ({r.get('batched_reason')})")
    if any(r.get("cache_rollback") == "replay" for r in report["rows"]):
        lines.append("target cache: linear-attention states restored after a partial acceptance and the accepted "
                     "tokens re-run (counted in fwd/tok)")
    return lines


def lossless_verdict(report: dict[str, Any]) -> tuple[int, str | None]:
    """``(exit code, line for stderr or None)`` of the lossless check: 1 with an ``error:`` line when, in
    float32, a greedy speculative output differed from greedy decoding (a bug: decoding is lossless); in
    bfloat16/float16 only a ``warning:`` line (exit 0): the verify forward over ``k + 1`` tokens and the one-token
    greedy step round differently, so a near-tie of the two best logits can flip; (0, None) when every row
    matched (sampled rows have no token check)."""
    bad = [r["drafter"] for r in report["rows"] if r.get("lossless_mismatches")]
    if not bad:
        return 0, None
    if report["dtype"] == "float32":
        return 1, f"error: speculative output differs from greedy decoding for {bad}"
    return 0, (f"warning: speculative output differs from greedy decoding for {bad} in {report['dtype']}; "
               "rerun with --dtype float32 to tell a numerical near-tie from a bug")
