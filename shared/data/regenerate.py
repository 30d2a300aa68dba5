"""The regeneration pipeline behind ``launch.py regenerate``: training data written by the target itself.

What it makes and why is in ``cli/regenerate.py``'s docstring (the command); this module holds the work: the
jobs cut from each input sample (``plan_job``), the generation backends (transformers, vLLM, SGLang), the
resumable shards with their argument-carrying sidecars and manifest, the worker processes, and the merge into one
Arrow file (``regenerate`` runs them all for the command, after it has checked its flags).
"""

from __future__ import annotations

import collections
import json
import logging
import multiprocessing as mp
import os
import shutil
import signal
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Sequence

import numpy as np

from specring.shared.errors import ConfigError

logger = logging.getLogger(__name__)

MANIFEST_VERSION = 1
EXAMPLES = 5


# ------------------------------------------------------------------------------------------------ what to do
@dataclass
class Job:
    """One input sample's regeneration: plain-text prompts, or the assistant spans of a chat sample.

    ``prompts``: ``(start, end)`` token ranges of the sample used as prompts (plain text); ``spans``:
    ``(start, end)`` ranges of the assistant turns to replace (chat). Exactly one of the two is non-empty.
    """
    index: int
    prompts: list[tuple[int, int]] = field(default_factory=list)
    spans: list[tuple[int, int]] = field(default_factory=list)


def runs_of_ones(mask: np.ndarray) -> list[tuple[int, int]]:
    """``[(start, end), ...]`` of the maximal runs of 1 in a 0/1 array (end exclusive)."""
    m = np.concatenate([[0], (np.asarray(mask) > 0).astype(np.int8), [0]])
    d = np.diff(m)
    return list(zip(np.nonzero(d == 1)[0].tolist(), np.nonzero(d == -1)[0].tolist()))


def plan_job(index: int, ids: np.ndarray, mask: np.ndarray, prefix_len: int, stride: int,
             vocab_size: int) -> Job:
    """The ``Job`` of sample ``index`` (see the module docstring). Raises ``ValueError`` with a short kind
    (``empty``, ``token_out_of_range``, ``no_prompt``, ``no_loss``) for a sample that cannot be regenerated."""
    n = len(ids)
    if n == 0:
        raise ValueError("empty: the sample has no tokens")
    if int(ids.min()) < 0 or int(ids.max()) >= vocab_size:
        raise ValueError(f"token_out_of_range: token ids must lie in 0..{vocab_size - 1}")
    runs = runs_of_ones(mask)
    if not runs:
        raise ValueError("no_loss: no token carries loss, nothing to regenerate")
    if runs[0][0] == 0:  # plain text: the loss starts at the first token
        if n < 2 and prefix_len >= 1:
            return Job(index, prompts=[(0, n)])
        starts = [0] + (list(range(stride, n - prefix_len + 1, stride)) if stride > 0 else [])
        return Job(index, prompts=[(s, min(n, s + prefix_len)) for s in starts])
    return Job(index, spans=runs)


# ------------------------------------------------------------------------------------------------ backends
CACHES = ("auto", "static", "dynamic")
STATIC_MIN_WIDTH = 64


def static_width(width: int) -> int:
    """The prompt width a batch of longest prompt ``width`` tokens is left-padded to with the static cache: the
    next power of two, at least ``STATIC_MIN_WIDTH`` (so prompts of any lengths make a handful of shapes, each
    compiled once; the recipe's 256-token prompts stay 256 wide)."""
    return max(STATIC_MIN_WIDTH, 1 << (int(width) - 1).bit_length())


def static_rows(rows: int, batch_size: int) -> int:
    """The rows a batch of ``rows`` prompts is filled to with the static cache: the next power of two, at most
    ``batch_size`` (a shard's last, smaller batch then reuses one of a few compiled shapes instead of compiling
    its own, about 25 s each on an H200 and beyond torch.compile's recompile limit after eight)."""
    return min(int(batch_size), 1 << max(0, int(rows) - 1).bit_length())


class TransformersBackend:
    """Batched generation with ``transformers`` ``generate`` (left padding, batches of similar length).

    ``cache``: ``dynamic`` is transformers' growing KV cache, every decode step a chain of small kernel launches
    from Python; ``static`` is its preallocated ``StaticCache`` (``cache_implementation="static"``), with which
    transformers compiles the decode step (``torch.compile`` mode ``reduce-overhead``: CUDA graphs) on a GPU, so
    a step is one graph replay; prompts are then left-padded to ``static_width`` tokens and a batch is filled to
    ``static_rows`` rows, so that the batches of a run share a few shapes, each compiled once. ``auto``:
    ``static`` on CUDA, else ``dynamic`` (on CPU nothing is compiled and the static cache only costs its
    preallocation). Greedy outputs are the same with either cache up to the rounding of the dtype.
    ``benchmarks/regenerate.py`` measures both. Raises ``ValueError`` for another ``cache``.
    """

    name = "transformers"

    def __init__(self, target: str, device: str, dtype: str, batch_size: int, trust_remote_code: bool = False,
                 cache: str = "auto"):
        import torch

        from specring.shared.machine.devices import resolve_device, resolve_dtype
        from specring.shared.models.hub import load_pretrained
        if cache not in CACHES:
            raise ValueError(f"cache: must be one of {', '.join(CACHES)}, got {cache!r}")
        dev = resolve_device(device)
        self.device = dev
        self.model = load_pretrained("causal_lm", target, dtype=resolve_dtype(dtype, dev),
                                     trust_remote_code=trust_remote_code).to(dev).eval()
        self.batch_size = int(batch_size)
        self.cache = ("static" if torch.device(dev).type == "cuda" else "dynamic") if cache == "auto" else cache
        self.torch = torch

    def generate(self, prompts: list[list[int]], max_new_tokens: int, temperature: float, stop_ids: list[int],
                 pad_id: int, seed: int, progress=None) -> list[list[int]]:
        """Continuations of ``prompts`` (each cut after its first stop token, at most ``max_new_tokens``)."""
        torch = self.torch
        order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
        out: list[list[int]] = [[] for _ in prompts]
        torch.manual_seed(seed)
        for b in range(0, len(order), self.batch_size):
            idx = order[b:b + self.batch_size]
            width = max(len(prompts[i]) for i in idx)
            if self.cache == "static":
                width = static_width(width)
            rows = static_rows(len(idx), self.batch_size) if self.cache == "static" else len(idx)
            ids = torch.full((rows, width), pad_id, dtype=torch.long)
            att = torch.zeros_like(ids)
            for r, i in enumerate(idx):
                p = prompts[i]
                ids[r, width - len(p):] = torch.tensor(p, dtype=torch.long)
                att[r, width - len(p):] = 1
            ids[len(idx):, -1] = ids[0, -1]  # filler rows (static shapes): one real token each, output dropped
            att[len(idx):, -1] = 1
            kw = dict(do_sample=True, temperature=float(temperature), top_k=0, top_p=1.0) if temperature > 0 \
                else dict(do_sample=False)
            if self.cache == "static":
                kw["cache_implementation"] = "static"
            with torch.inference_mode():
                gen = self.model.generate(input_ids=ids.to(self.device), attention_mask=att.to(self.device),
                                          max_new_tokens=max_new_tokens, eos_token_id=stop_ids or None,
                                          pad_token_id=pad_id, **kw)
            for r, i in enumerate(idx):
                out[i] = cut_at_stop(gen[r, width:].tolist(), stop_ids, max_new_tokens)
            if progress is not None:
                progress(len(idx))
        return out


class VllmBackend:
    """``vllm.LLM`` offline generation on token prompts (``TokensPrompt``), one engine."""

    name = "vllm"

    def __init__(self, target: str, device: str, dtype: str, trust_remote_code: bool = False):
        from vllm import LLM
        self.llm = LLM(model=target, dtype="auto" if dtype == "auto" else dtype, trust_remote_code=trust_remote_code,
                       skip_tokenizer_init=True)

    def generate(self, prompts, max_new_tokens, temperature, stop_ids, pad_id, seed, progress=None):
        from vllm import SamplingParams
        params = SamplingParams(temperature=float(temperature), max_tokens=int(max_new_tokens),
                                stop_token_ids=list(stop_ids), seed=int(seed), detokenize=False)
        outs = self.llm.generate([{"prompt_token_ids": list(p)} for p in prompts], params, use_tqdm=False)
        res = [cut_at_stop(list(o.outputs[0].token_ids), stop_ids, max_new_tokens) for o in outs]
        if progress is not None:
            progress(len(prompts))
        return res


class SglangBackend:
    """``sglang.Engine`` offline generation on token prompts, one engine."""

    name = "sglang"

    def __init__(self, target: str, device: str, dtype: str, trust_remote_code: bool = False):
        import sglang
        self.engine = sglang.Engine(model_path=target, dtype=dtype, trust_remote_code=trust_remote_code,
                                    skip_tokenizer_init=True)

    def generate(self, prompts, max_new_tokens, temperature, stop_ids, pad_id, seed, progress=None):
        params = {"temperature": float(temperature), "max_new_tokens": int(max_new_tokens),
                  "stop_token_ids": list(stop_ids), "sampling_seed": int(seed)}
        outs = self.engine.generate(input_ids=[list(p) for p in prompts], sampling_params=params)
        res = [cut_at_stop(list(o["output_ids"]), stop_ids, max_new_tokens) for o in outs]
        if progress is not None:
            progress(len(prompts))
        return res


def cut_at_stop(tokens: Sequence[int], stop_ids: Sequence[int], limit: int) -> list[int]:
    """``tokens`` up to and including the first stop token, at most ``limit`` of them."""
    stop = set(int(s) for s in stop_ids)
    out = []
    for t in list(tokens)[:limit]:
        out.append(int(t))
        if out[-1] in stop:
            break
    return out


def pick_backend(name: str) -> str:
    """``auto`` -> ``vllm`` or ``sglang`` when importable, else ``transformers``. Raises ``ConfigError``
    naming ``--backend`` when the one asked for is not installed."""
    import importlib.util
    if name == "auto":
        for cand in ("vllm", "sglang"):
            if importlib.util.find_spec(cand) is not None:
                return cand
        return "transformers"
    if name in ("vllm", "sglang") and importlib.util.find_spec(name) is None:
        raise ConfigError(f"--backend {name}: {name} is not installed (pip install {name}), or use "
                          "--backend transformers")
    if name not in ("vllm", "sglang", "transformers"):
        raise ConfigError(f"--backend: must be auto, transformers, vllm or sglang, got {name!r}")
    return name


def make_backend(name: str, args: "Settings", device: str):
    if name == "vllm":
        return VllmBackend(args.target, device, args.dtype, args.trust_remote_code)
    if name == "sglang":
        return SglangBackend(args.target, device, args.dtype, args.trust_remote_code)
    return TransformersBackend(args.target, device, args.dtype, args.batch_size, args.trust_remote_code)


# ------------------------------------------------------------------------------------------------ shards
@dataclass
class Settings:
    """Everything that decides the output (the manifest compares these on resume) plus how to run."""
    target: str
    input: str
    input_fingerprint: str
    max_new_tokens: int
    temperature: float
    prefix_len: int
    stride: int
    max_samples: int
    include_input: bool
    seed: int
    shard_size: int
    dtype: str = "auto"
    batch_size: int = 256
    backend: str = "transformers"
    trust_remote_code: bool = False

    DECIDING = ("target", "input_fingerprint", "max_new_tokens", "temperature", "prefix_len", "stride",
                "max_samples", "include_input", "seed", "shard_size")


def stop_and_pad_ids(target: str, trust_remote_code: bool = False) -> tuple[list[int], int]:
    """The target's stop tokens (generation config's, else config's ``eos_token_id``) and pad id."""
    from specring.shared.models.hub import load_pretrained
    stop = None
    try:
        stop = load_pretrained("generation_config", target).eos_token_id
    except (OSError, ValueError):
        pass
    cfg = load_pretrained("config", target, trust_remote_code=trust_remote_code)
    if stop is None:
        stop = getattr(cfg, "eos_token_id", None)
    stop_ids = [] if stop is None else [int(s) for s in (stop if isinstance(stop, (list, tuple)) else [stop])]
    pad = getattr(cfg, "pad_token_id", None)
    return stop_ids, int(pad if pad is not None else (stop_ids[0] if stop_ids else 0))


def run_shard(backend, ds, jobs: list[Job], st: Settings, stop_ids: list[int], pad_id: int, shard: int,
              progress=None):
    """Regenerate one shard's jobs; returns a ``shared.data.encode.ChunkResult`` with its samples, in job order."""
    from specring.shared.data.encode import _result
    rows: dict[int, list[tuple[np.ndarray, np.ndarray]]] = collections.defaultdict(list)
    # plain text: all prompts of the shard in one generate call
    plain = [(j, s, e) for j in jobs for s, e in j.prompts]
    if plain:
        prompts = [ds[j.index][0][s:e].astype(np.int64).tolist() for j, s, e in plain]
        gens = backend.generate(prompts, st.max_new_tokens, st.temperature, stop_ids, pad_id,
                                st.seed * 1_000_003 + shard, progress)
        for (j, s, e), p, g in zip(plain, prompts, gens):
            rows[j.index].append((np.asarray(p + g, np.int32),
                                  np.concatenate([np.zeros(len(p), np.uint8), np.ones(len(g), np.uint8)])))
    # chat: round r regenerates the r-th assistant turn of every sample that has one
    chats = [j for j in jobs if j.spans]
    source = {j.index: ds[j.index][0].astype(np.int64).tolist() for j in chats}
    done_upto = {j.index: 0 for j in chats}   # source tokens consumed so far
    out_ids = {j.index: [] for j in chats}
    out_mask = {j.index: [] for j in chats}
    for r in range(max((len(j.spans) for j in chats), default=0)):
        active = [j for j in chats if r < len(j.spans)]
        prompts = []
        for j in active:
            src = source[j.index]
            a, b = j.spans[r]
            keep = src[done_upto[j.index]:a]
            out_ids[j.index] += keep
            out_mask[j.index] += [0] * len(keep)
            done_upto[j.index] = b
            prompts.append(list(out_ids[j.index]))
        gens = backend.generate(prompts, st.max_new_tokens, st.temperature, stop_ids, pad_id,
                                st.seed * 1_000_003 + shard * 101 + r, progress)
        for j, g in zip(active, gens):
            out_ids[j.index] += g
            out_mask[j.index] += [1] * len(g)
    for j in chats:
        tail = source[j.index][done_upto[j.index]:]
        rows[j.index].append((np.asarray(out_ids[j.index] + tail, np.int32),
                              np.asarray(out_mask[j.index] + [0] * len(tail), np.uint8)))
    ids, masks, lens, files, srcrows = [], [], [], [], []
    for j in jobs:
        f, row = ds.source(j.index)
        for i, m in rows[j.index]:
            if not m.any():
                continue  # the target stopped at once: nothing to learn from this prompt
            ids.append(i), masks.append(m), lens.append(len(i)), files.append(f), srcrows.append(row)
    return _result(ids, masks, lens, files, srcrows, len(jobs), collections.Counter(), [])


def _shard_path(parts: Path, k: int) -> Path:
    return parts / f"shard-{k:05d}.arrow"


def _worker(device: str, backend_name: str, st: Settings, shards: list[int], parts: str, queue,
            parent_pid: int = 0) -> None:
    """One device's process: regenerate ``shards`` (indices) and write each as it finishes.

    It dies with its launcher (``PR_SET_PDEATHSIG``: SIGKILL when the launcher dies, whatever killed it; it exits
    at once when the launcher is already gone) and leaves the terminal's SIGINT/SIGHUP to the launcher, which
    stops it. A shard is written only while ``parts/manifest.json`` is this regeneration's (``write_shard``)."""
    from specring.shared.process.procs import set_parent_death_signal
    set_parent_death_signal(signal.SIGKILL)
    if parent_pid and os.getppid() != parent_pid:  # the launcher died before the line above took effect
        return
    for sig in (signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)
    try:
        from specring.shared.data.dataset import TokenDataset
        from specring.shared.process import faults
        ds = TokenDataset(st.input)
        jobs_by_shard = shard_jobs(ds, st)[0]
        stop_ids, pad_id = stop_and_pad_ids(st.target, st.trust_remote_code)
        backend = make_backend(backend_name, st, device)
        for k in shards:
            res = run_shard(backend, ds, jobs_by_shard[k], st, stop_ids, pad_id, k,
                            progress=lambda n: queue.put(("prompts", n)))
            write_shard(Path(parts), k, res, st)
            queue.put(("shard", k))
            if faults.slow_shard_s():
                time.sleep(faults.slow_shard_s())
    except BaseException as e:  # reported to the parent, which names the device
        queue.put(("error", f"{device}: {type(e).__name__}: {e}"))
        raise


def deciding(st: Settings) -> dict:
    """The arguments that decide a regeneration's output (``Settings.DECIDING``), as the manifest and every
    shard record them."""
    return {k: getattr(st, k) for k in Settings.DECIDING}


def write_shard(parts: Path, k: int, res, st: Settings) -> None:
    """Write one finished shard atomically (``ArrowSink`` renames at commit), its sidecar recording the
    arguments it was made with (``deciding``). Raises ``RuntimeError`` without writing when ``parts`` no longer
    holds this regeneration's manifest (deleted, or another run with other arguments took the directory)."""
    from specring.shared.data.writer import ArrowSink
    try:
        manifest = json.loads((parts / "manifest.json").read_text())
    except (OSError, ValueError):
        manifest = None
    mine = deciding(st)
    if not isinstance(manifest, dict) or any(manifest.get(key) != v for key, v in mine.items()):
        raise RuntimeError(f"{parts} no longer holds this regeneration's manifest: shard {k} is not written")
    sink = ArrowSink(_shard_path(parts, k))
    sink.add(res)
    sink.commit({"shard": k, "settings": mine})


def stale_shards(parts: Path, st: Settings) -> list[tuple[Path, str]]:
    """The shards of ``parts`` that were not made with ``st``'s deciding arguments (their sidecar records other
    ones, or none, or cannot be read: made by a worker of an earlier run with other arguments, or by a version
    before shards carried them), each with what differs."""
    from specring.shared.data.dataset import sidecar_path
    mine = deciding(st)
    out = []
    for shard in sorted(parts.glob("shard-*.arrow")):
        try:
            made = json.loads(sidecar_path(shard).read_text()).get("settings")
        except (OSError, ValueError, AttributeError):
            made = None
        if not isinstance(made, dict):
            out.append((shard, "its arguments are not recorded"))
            continue
        diff = [f"{key} {made.get(key)!r} -> {v!r}" for key, v in mine.items() if made.get(key) != v]
        if diff:
            out.append((shard, "made with other arguments: " + ", ".join(diff)))
    return out


def discard_stale_shards(parts: Path, st: Settings) -> list[str]:
    """Remove the shards of ``parts`` that ``stale_shards`` finds (they are generated again); returns one line
    per shard removed."""
    from specring.shared.data.dataset import sidecar_path
    lines = []
    for shard, why in stale_shards(parts, st):
        shard.unlink(missing_ok=True)
        sidecar_path(shard).unlink(missing_ok=True)
        lines.append(f"discarded {shard.name} ({why}); it is generated again")
    return lines


def shard_jobs(ds, st: Settings) -> tuple[list[list[Job]], list[tuple[str, int, int, str]], collections.Counter]:
    """Plan every sample (``plan_job``), cut the good ones into shards of ``st.shard_size`` samples.
    Returns ``(shards, bad examples (kind, sample, source_row, detail), bad counts by kind)``."""
    n = len(ds) if st.max_samples <= 0 else min(len(ds), st.max_samples)
    vocab = target_vocab_size(st.target, st.trust_remote_code)
    jobs, bad, counts = [], [], collections.Counter()
    for i in range(n):
        ids, mask = ds[i]
        try:
            jobs.append(plan_job(i, ids, mask, st.prefix_len, st.stride, vocab))
        except ValueError as e:
            kind, _, detail = str(e).partition(": ")
            counts[kind] += 1
            if counts[kind] <= EXAMPLES:
                bad.append((kind, i, ds.source(i)[1], detail))
    shards = [jobs[k:k + st.shard_size] for k in range(0, len(jobs), st.shard_size)]
    return shards, bad, counts


_VOCAB: dict[str, int] = {}


def target_vocab_size(target: str, trust_remote_code: bool = False) -> int:
    """``vocab_size`` of the target's config (cached per path)."""
    if target not in _VOCAB:
        from specring.shared.models.target import check_checkpoint
        _VOCAB[target] = int(check_checkpoint(target, trust_remote_code).vocab_size)
    return _VOCAB[target]


def check_manifest(parts: Path, st: Settings) -> None:
    """Create ``parts/manifest.json`` or check it against ``st``; raises ``ConfigError`` naming the
    arguments that differ from the interrupted run's (its finished shards would not fit)."""
    path = parts / "manifest.json"
    mine = deciding(st)
    if path.is_file():
        old = json.loads(path.read_text())
        diff = sorted(k for k in Settings.DECIDING if old.get(k) != mine[k])
        if diff:
            raise ConfigError(f"{parts} holds shards of a regeneration with other arguments ({', '.join(diff)}); "
                              f"rerun with those, or delete {parts} to start over")
        return
    parts.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"version": MANIFEST_VERSION, **mine}, indent=1) + "\n")


def merge(parts: Path, num_shards: int, output: Path, st: Settings, meta: dict) -> dict:
    """Concatenate the shards (and the input with ``include_input``) into ``output``; returns the sidecar.
    Raises ``ConfigError`` when a shard was not made with ``st``'s arguments (``stale_shards``)."""
    from specring.shared.data.dataset import TokenDataset
    from specring.shared.data.encode import _result
    from specring.shared.data.writer import ArrowSink
    stale = stale_shards(parts, st)
    if stale:  # discarded at the start of this run: a shard written since is no part of it
        raise ConfigError(f"{stale[0][0]}: {stale[0][1]}; rerun the same command to generate it again")
    sink = ArrowSink(output)
    try:
        generated = 0
        for k in range(num_shards):
            part = TokenDataset(_shard_path(parts, k))
            ids = [part[i][0] for i in range(len(part))]
            masks = [part[i][1] for i in range(len(part))]
            src = [part.source(i) for i in range(len(part))]
            generated += int(sum(int(m.sum()) for m in masks))
            sink.add(_result(ids, masks, [len(x) for x in ids], [s[0] for s in src], [s[1] for s in src],
                             len(part), collections.Counter(), []))
        if st.include_input:
            ds = TokenDataset(st.input)
            for a in range(0, len(ds), 4096):
                rng = range(a, min(len(ds), a + 4096))
                src = [ds.source(i) for i in rng]
                sink.add(_result([ds[i][0] for i in rng], [ds[i][1] for i in rng], [int(ds.lengths[i]) for i in rng],
                                 [s[0] for s in src], [s[1] for s in src], len(rng), collections.Counter(), []))
        side = dict(meta, **sink.stats(), content_sha1=sink.sha1.hexdigest(), generated_tokens=generated)
        sink.commit(side)
    except BaseException:
        sink.abort()
        raise
    return side


# ------------------------------------------------------------------------------------------------ command
def check_output_names(output: Path, input_path: Path, target: Path) -> None:
    """Refuse an ``--output`` whose data file, sidecar, temporary names or shard directory (``OUTPUT.parts``)
    collide with one another, with ``--input`` or its sidecar, or with a file of the target's directory
    (``shared.config.outputs.check_outputs``; ``ConfigError`` naming ``--output``)."""
    from specring.shared.config.outputs import check_outputs
    from specring.shared.data.dataset import sidecar_path

    side = sidecar_path(output)
    check_outputs("--output", {"data file": output, "sidecar": side,
                               "temporary data file": output.with_name(output.name + ".tmp"),
                               "temporary sidecar": side.with_name(side.name + ".tmp"),
                               "shard directory": output.with_name(output.name + ".parts")},
                  {"--input": input_path, "sidecar of --input": sidecar_path(input_path), "target directory": target})


def resolve_devices(text: str) -> list[str]:
    if text == "auto":
        import torch
        n = torch.cuda.device_count() if torch.cuda.is_available() else 0
        return [f"cuda:{i}" for i in range(n)] or ["cpu"]
    out = [d.strip() for d in text.split(",") if d.strip()]
    if not out:
        raise ConfigError("--devices: give a device list such as cpu or cuda:0,cuda:1")
    from specring.shared.machine.devices import resolve_device
    for d in out:
        resolve_device(d)
    return out




def regenerate(ds, st: "Settings", output: Path, devices: list[str], backend: str, shards, bad, counts,
               parts: Path, no_progress: bool = False) -> int:
    """Generate every shard not yet in ``parts`` with one worker process per device (one engine for vLLM/SGLang),
    then merge them into ``output``; returns the command's exit status: 0 done, 1 when a worker failed (the
    finished shards kept), 130 when a signal of ``shared.process.procs.STOP_SIGNALS`` stopped it (its workers with it).
    ``shards, bad, counts`` come from ``shard_jobs(ds, st)``; progress on stderr (tqdm unless ``no_progress``)."""
    from tqdm import tqdm

    for kind, i, row, detail in bad:
        print(f"regenerate: skipped sample {i} (source row {row}): {kind}: {detail}", file=sys.stderr)
    if sum(counts.values()) > len(bad):
        print(f"regenerate: skipped {sum(counts.values())} samples in all: {dict(counts)}", file=sys.stderr)
    todo = [k for k in range(len(shards)) if not _shard_path(parts, k).is_file()]
    num_prompts = sum(len(j.prompts) + len(j.spans) for k in todo for j in shards[k])
    t0 = time.perf_counter()
    print(f"regenerate: {len(ds)} input samples -> {sum(len(s) for s in shards)} to regenerate in {len(shards)} "
          f"shards ({len(shards) - len(todo)} already done); {num_prompts} prompts to generate with {backend} on "
          f"{', '.join(devices)}", file=sys.stderr)
    workers = devices if backend == "transformers" else devices[:1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = []
    for w, dev in enumerate(workers):
        mine = todo[w::len(workers)]
        if mine:
            procs.append(ctx.Process(target=_worker, args=(dev, backend, st, mine, str(parts), queue, os.getpid())))
    failed = []
    interrupted = ""
    from specring.shared.process.procs import install_stop_handlers, restore_handlers

    def on_signal(signum, _frame):
        raise KeyboardInterrupt(signal.Signals(signum).name)

    old_handlers = install_stop_handlers(on_signal)  # INT, TERM, HUP, ...: stop the workers, keep their shards
    bar = tqdm(total=num_prompts, unit="prompt", desc="regenerate", disable=no_progress, file=sys.stderr)
    try:
        for p in procs:
            p.start()
        while any(p.is_alive() for p in procs) or not queue.empty():
            try:
                kind, value = queue.get(timeout=0.5)
            except Exception:
                continue
            if kind == "prompts":
                bar.update(value)
            elif kind == "error":
                failed.append(value)
    except KeyboardInterrupt as e:
        interrupted = str(e) or "SIGINT"
    finally:
        bar.close()
        for p in procs:
            if interrupted and p.is_alive():
                p.kill()
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
        restore_handlers(old_handlers)
    if interrupted:
        done = sum(_shard_path(parts, k).is_file() for k in range(len(shards)))
        print(f"regenerate: interrupted ({interrupted}): its workers are stopped; {done}/{len(shards)} shards are done "
              f"and kept in {parts}: rerun the same command to resume", file=sys.stderr)
        return 130
    missing = [k for k in range(len(shards)) if not _shard_path(parts, k).is_file()]
    if failed or missing:
        print(f"regenerate: error: {'; '.join(failed) or 'a worker died'}; {len(shards) - len(missing)}/{len(shards)} "
              f"shards are done and kept in {parts}: rerun the same command to resume", file=sys.stderr)
        return 1
    meta = dict({k: v for k, v in ds.meta.items() if k in ("tokenizer", "tokenizer_path", "vocab_size", "pad_id",
                                                           "eos_id", "max_length")},
                regenerated={**asdict(st), "backend": backend, "devices": devices,
                             "skipped_samples": dict(counts), "time_s": round(time.perf_counter() - t0, 2)},
                inputs=[str(st.input)])
    side = merge(parts, len(shards), output, st, meta)
    shutil.rmtree(parts, ignore_errors=True)
    print(f"regenerate: wrote {output}: {side['num_samples']} samples, {side['num_tokens']} tokens, "
          f"{side['generated_tokens']} generated, in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    return 0
