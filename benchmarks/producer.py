"""Producer benchmark: tokens/s of the producer (forward + layer capture + packing + slot write) against a
bare forward of the same model on the same batches.

``python benchmarks/producer.py --device cuda --shape qwen3-8b --batches 20 --seq-len 2048 --batch-size 4``
(and ``--device cpu --shape tiny`` as a smoke test anywhere).

The target is random-initialised (no download, no checkpoint): ``tiny`` is the fixture's shape
(assets/tiny-code-lm, a ``Qwen3Config``: 8 layers, H = 256), ``qwen3-8b`` Qwen3-8B's (36 layers, H = 4096,
~8.2 B parameters), ``qwen3.5-27b`` a hybrid stack of Qwen3.5-27B's layer shape (``Qwen3_5TextConfig`` as in
tests/fixtures/target-configs/qwen3.5-27b/config.json: H = 5120, three Gated DeltaNet linear-attention layers
to one full-attention layer, 48 value / 16 key heads of 128) with ``--num-layers`` of its 64 layers (default
16, to keep the torch fallback's run short). Built directly on the device in the target dtype (bfloat16 on
CUDA, float32 on CPU).

Linear-attention kernels (``--linear-attention``): transformers picks its Gated DeltaNet implementation when
the model module is imported, flash-linear-attention's Triton kernels (package ``fla``) if importable, else
its own torch reference code. ``torch`` hides ``fla`` from the import system before transformers is imported
(the fallback, whatever is installed); ``fla`` requires it (``SystemExit`` naming the package if absent);
``auto`` takes what is installed. ``--compare-linear-attention`` runs this script twice in child processes
(``torch`` then ``fla``, the same other flags) and prints ``producer_fla_vs_torch=<ratio>`` of their
``producer`` rates (and ``bare_forward_fla_vs_torch``)::

    python benchmarks/producer.py --device cuda --shape qwen3.5-27b --batches 8 --seq-len 2048 \
        --batch-size 2 --compare-linear-attention
Batches: ``--batch-size`` sequences of random tokens, lengths uniform in ``[seq_len/2, seq_len]``, right
padded to the longest of the batch (as ``shared.data`` does); tokens/s counts real tokens only.

Rows printed (median over ``--repeats`` rounds; in each round every method runs all batches once, the
order of methods rotating from round to round):

* ``bare_forward``: the baseline. The base model only (``model.model(...)``: no LM head, no hooks), the
  same host-to-device input copies as the producer, one device synchronisation at the end.
* ``producer``: what ``producers/main.py`` does when leases queue up: ``Producer.submit`` of batch k, then
  ``complete`` of batch k-1 (the copy of k-1 into its pinned slot overlaps the forward of k), two slots
  used in turn and released (``mark_empty``) after each publish as a consumer would.
* ``producer_sync``: ``Producer.run_batch`` (forward, copy, wait, publish; nothing overlaps).
* ``producer_full_depth``: as ``producer`` but without the early exit after the deepest captured layer
  (so it also computes the layers above it, as the baseline does): isolates the cost of capture and write.

Final lines: ``producer_full_depth_vs_bare_forward=<ratio>``, ``producer_sync_vs_bare_forward=<ratio>``
and ``producer_vs_bare_forward=<ratio>`` (goal on an H200 with qwen3-8b: >= 0.95).
"""

from __future__ import annotations

import argparse
import importlib.abc
import importlib.util
import json
import os
import re
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import torch  # noqa: E402

from specring.producers.producer import Producer  # noqa: E402
from specring.shared.config.run_config import DEFAULT_TARGET  # noqa: E402
from specring.shared.machine.devices import resolve_device_group, resolve_dtype  # noqa: E402
from specring.shared.models.layer_ids import default_target_layer_ids  # noqa: E402
from specring.shared.models.target import base_model  # noqa: E402
from specring.shared.transport import messages, ring  # noqa: E402

QWEN3_8B = dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
                num_key_value_heads=8, head_dim=128, vocab_size=151936, max_position_embeddings=40960,
                rms_norm_eps=1e-6, tie_word_embeddings=False,
                rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0})


QWEN3_5_27B_CONFIG = os.path.join(ROOT, "tests", "fixtures", "target-configs", "qwen3.5-27b", "config.json")


class _HideFla(importlib.abc.MetaPathFinder):
    """Refuses ``fla`` and its submodules, so transformers takes its torch fallback (``--linear-attention torch``)."""

    def find_spec(self, name, path=None, target=None):
        if name == "fla" or name.startswith("fla."):
            raise ModuleNotFoundError(f"No module named {name!r} (hidden: --linear-attention torch)", name=name)
        return None


def select_linear_attention(choice: str) -> str:
    """Apply ``--linear-attention`` before transformers is imported; returns the kernels in use (fla, torch).

    Raises ``SystemExit`` when ``choice`` is ``fla`` and the package is not importable, or transformers is
    already imported (its modelling modules would have chosen already)."""
    if "transformers.models.qwen3_5" in sys.modules:
        raise SystemExit("--linear-attention must be applied before transformers' Qwen3.5 module is imported")
    have = importlib.util.find_spec("fla") is not None
    if choice == "torch":
        sys.meta_path.insert(0, _HideFla())
        return "torch"
    if choice == "fla" and not have:
        raise SystemExit("--linear-attention fla: flash-linear-attention (import name fla) is not installed")
    return "fla" if have else "torch"


def build_config(shape: str, num_layers: int | None = None):
    """The transformers config of ``shape`` (module docstring); ``num_layers`` cuts a hybrid stack."""
    from transformers import Qwen3Config

    if shape == "tiny":
        return Qwen3Config.from_pretrained(DEFAULT_TARGET)
    if shape == "qwen3-8b":
        return Qwen3Config(**QWEN3_8B)
    from transformers import Qwen3_5TextConfig
    with open(QWEN3_5_27B_CONFIG) as f:
        text = json.load(f)["text_config"]
    text = {k: v for k, v in text.items() if k not in ("model_type", "architectures")}
    n = int(num_layers or 16)
    text["layer_types"] = text["layer_types"][:n]
    text["num_hidden_layers"] = n
    text["rope_parameters"] = {k: v for k, v in text["rope_parameters"].items()
                               if k not in ("mrope_interleaved", "mrope_section")}  # text-only positions
    return Qwen3_5TextConfig(**text)


def build_model(shape: str, device: torch.device, dtype: torch.dtype, num_layers: int | None = None):
    """A random-initialised causal LM of ``shape``, created directly on ``device`` in ``dtype``."""
    from transformers import AutoModelForCausalLM

    cfg = build_config(shape, num_layers)
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    model.eval()
    model.requires_grad_(False)
    return model, cfg


def make_batches(n: int, batch_size: int, seq_len: int, vocab: int, seed: int = 0) -> list[dict]:
    """``n`` right-padded batches in ``shared.data.dataset.collate``'s form (CPU tensors) plus ``batch_id``."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for k in range(n):
        lengths = torch.randint(max(1, seq_len // 2), seq_len + 1, (batch_size,), generator=g)
        pad_to = int(lengths.max())
        ids = torch.randint(0, vocab, (batch_size, pad_to), generator=g)
        am = (torch.arange(pad_to)[None, :] < lengths[:, None]).to(torch.int64)
        ids = ids * am
        out.append({"input_ids": ids, "attention_mask": am, "loss_mask": am.to(torch.uint8),
                    "lengths": lengths, "batch_id": k})
    return out


def sync(device: torch.device) -> None:
    """Wait for every CUDA device (a split target runs on several)."""
    if device.type == "cuda":
        for i in range(torch.cuda.device_count()):
            torch.cuda.synchronize(i)


def run_bare(prod: Producer, batches: list[dict]) -> None:
    base = base_model(prod.model)
    with torch.inference_mode():
        for b in batches:
            base(input_ids=prod.to_device(b["input_ids"]), attention_mask=prod.to_device(b["attention_mask"]),
                 use_cache=False)


def _release(prod: Producer, msg) -> None:
    """What the coordinator does once the consumer released the slot (a BadBatch already freed it)."""
    if isinstance(msg, messages.SlotReady):
        prod.ring.mark_empty(msg.slot)


def run_sync(prod: Producer, batches: list[dict]) -> None:
    for k, b in enumerate(batches):
        _release(prod, prod.run_batch(b, slot=k % prod.ring.num_slots, seq=k))


def run_pipelined(prod: Producer, batches: list[dict]) -> None:
    pending = None
    for k, b in enumerate(batches):
        new = prod.submit(b, slot=k % prod.ring.num_slots, seq=k)
        if pending is not None:
            _release(prod, prod.complete(pending))
        pending = new
    if pending is not None:
        _release(prod, prod.complete(pending))


def timed(fn, prod: Producer, batches: list[dict], device: torch.device) -> float:
    """Seconds for ``fn`` over ``batches``, from a synchronised start to a synchronised end."""
    sync(device)
    t0 = time.perf_counter()
    fn(prod, batches)
    sync(device)
    return time.perf_counter() - t0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N, or a device group the target is split "
                                                    "over, e.g. cuda:0+cuda:1 (compare with cuda:0 alone)")
    ap.add_argument("--shape", choices=["tiny", "qwen3-8b", "qwen3.5-27b"], default="tiny")
    ap.add_argument("--num-layers", type=int, default=None, help="qwen3.5-27b: layers of its 64 (default 16)")
    ap.add_argument("--linear-attention", choices=["auto", "fla", "torch"], default="auto",
                    help="Gated DeltaNet kernels: flash-linear-attention's or transformers' torch fallback")
    ap.add_argument("--compare-linear-attention", action="store_true",
                    help="run with torch then fla kernels in child processes; print their ratio")
    ap.add_argument("--batches", type=int, default=8, help="timed batches per method and round")
    ap.add_argument("--seq-len", type=int, default=256, help="longest sequence; lengths in [seq_len/2, seq_len]")
    ap.add_argument("--batch-size", type=int, default=4, help="sequences per batch")
    ap.add_argument("--layers", type=int, default=5, help="number of captured layers (DFlash default ids)")
    ap.add_argument("--dtype", default="auto", help="auto (bfloat16 on CUDA, float32 on CPU), bfloat16, float32")
    ap.add_argument("--warmup", type=int, default=2, help="untimed batches per method before the rounds")
    ap.add_argument("--repeats", type=int, default=3, help="rounds; the median is reported")
    args = ap.parse_args(argv)
    if args.compare_linear_attention:
        return compare_linear_attention(argv if argv is not None else sys.argv[1:])
    kernels = select_linear_attention(args.linear_attention)

    group = resolve_device_group(args.device)
    device = group[0]
    dtype = resolve_dtype(args.dtype, device)
    if device.type == "cpu":
        torch.set_flush_denormal(True)  # random weights give denormals, 3x slower on x86 CPUs otherwise
    t0 = time.perf_counter()
    model, cfg = build_model(args.shape, device, dtype, args.num_layers)
    if len(group) > 1:  # split over the group as a producer does (shared.models.target.layer_device_map)
        from specring.shared.models.target import layer_device_map, place_target
        place_target(model, layer_device_map(model, group))
    sync(device)
    build_s = time.perf_counter() - t0
    layer_ids = default_target_layer_ids(cfg.num_hidden_layers, args.layers)
    batches = make_batches(args.batches, args.batch_size, args.seq_len, cfg.vocab_size)
    warm = make_batches(args.warmup, args.batch_size, args.seq_len, cfg.vocab_size, seed=1)
    real_tokens = sum(int(b["lengths"].sum()) for b in batches)
    padded_tokens = sum(b["input_ids"].numel() for b in batches)

    n_params = sum(p.numel() for p in model.parameters())
    probe = Producer(model, layer_ids, ring=None, generation=1, device=device)  # sizes only
    slot_bytes = probe.payload_bytes(args.batch_size * args.seq_len, args.batch_size)
    r = ring.Ring.create(ring.segment_name(ring.new_run_id(), "bench"), num_slots=2, slot_bytes=slot_bytes)
    try:
        pinned = r.pin()
        print(f"device={args.device} ({torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu'}) "
              f"shape={args.shape} params={n_params / 1e9:.2f}B dtype={str(dtype).replace('torch.', '')} "
              f"layers={cfg.num_hidden_layers} captured={layer_ids} build_s={build_s:.1f} linear_attention={kernels}")
        print(f"batches={args.batches} batch_size={args.batch_size} seq_len={args.seq_len} "
              f"real_tokens={real_tokens} padded_tokens={padded_tokens} slot_mib={r.slot_bytes / 2**20:.1f} "
              f"pinned={pinned} repeats={args.repeats} threads={torch.get_num_threads()}")
        prods = {"bare_forward": Producer(model, layer_ids, r, 1, device),
                 "producer": Producer(model, layer_ids, r, 1, device),
                 "producer_sync": Producer(model, layer_ids, r, 1, device),
                 "producer_full_depth": Producer(model, layer_ids, r, 1, device, stop_early=False)}
        fns = {"bare_forward": run_bare, "producer": run_pipelined, "producer_sync": run_sync,
               "producer_full_depth": run_pipelined}
        names = list(fns)
        for name in names:
            if warm:
                fns[name](prods[name], warm)
        # one untimed pass over the timed batches themselves: kernel selection for these exact shapes is
        # paid here, not by whichever method happens to be timed first (with --repeats 1 on the H200 the
        # first-timed bare_forward absorbed it and read 3x slow)
        for name in names:
            fns[name](prods[name], batches)
        sync(device)
        times: dict[str, list[float]] = {n: [] for n in names}
        for rep in range(args.repeats):
            order = names[rep % len(names):] + names[:rep % len(names)]
            for name in order:
                times[name].append(timed(fns[name], prods[name], batches, device))
        rate = {n: real_tokens / statistics.median(ts) for n, ts in times.items()}
        for n in names:
            spread = ", ".join(f"{real_tokens / t:,.0f}" for t in times[n])
            print(f"{n:<20} tokens_per_s={rate[n]:,.0f}  (rounds: {spread})")
        if device.type == "cuda":
            print(f"gpu_mem_max_allocated_gib={torch.cuda.max_memory_allocated(device) / 2**30:.1f}")
        bad = sum(p.stats.bad_batches for p in prods.values())
        if bad:
            print(f"WARNING: {bad} batches came back bad (non-finite states from random weights?)")
        print(f"producer_full_depth_vs_bare_forward={rate['producer_full_depth'] / rate['bare_forward']:.3f}")
        print(f"producer_sync_vs_bare_forward={rate['producer_sync'] / rate['bare_forward']:.3f}")
        print(f"producer_vs_bare_forward={rate['producer'] / rate['bare_forward']:.3f}")
    finally:
        r.close()
        r.unlink()
    return 0


def compare_linear_attention(argv: list[str]) -> int:
    """``--compare-linear-attention``: this script with ``--linear-attention torch`` then ``fla`` (child processes,
    the other flags unchanged); prints each child's output and the ratios of their rates. Returns 1 when a
    child fails or prints no rate."""
    rest = [a for a in argv if a != "--compare-linear-attention"]
    if "--linear-attention" in rest:
        i = rest.index("--linear-attention")
        del rest[i:i + 2]
    rates: dict[str, dict[str, float]] = {}
    for kernels in ("torch", "fla"):
        proc = subprocess.run([sys.executable, os.path.abspath(__file__), *rest, "--linear-attention", kernels],
                              capture_output=True, text=True)
        print(f"--- linear_attention={kernels} rc={proc.returncode}")
        print(proc.stdout, end="")
        if proc.returncode:
            print(proc.stderr[-4000:], end="")
            return 1
        rates[kernels] = {m.group(1): float(m.group(2).replace(",", ""))
                          for m in re.finditer(r"^(\w+)\s+tokens_per_s=([\d,.]+)", proc.stdout, re.M)}
    for name in ("producer", "bare_forward"):
        if name not in rates["torch"] or name not in rates["fla"]:
            print(f"no {name} rate in a child's output")
            return 1
        print(f"{name}_fla_vs_torch={rates['fla'][name] / rates['torch'][name]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
