"""Drafter training throughput: target tokens per second consumed by ``Trainer.step``.

Reports the figure issue 5 asks for (training tokens/s for a Qwen3-8B-shaped target, 5 layers, B = 16,
512 anchors, sequences of 2,048 tokens); no speed goal is attached to it, so no baseline ratio.

Shapes: ``--shape tiny`` (the fixture target) or ``--shape qwen3-8b`` (a Qwen3-8B-shaped target built
from its config: hidden 4096, 36 layers, vocab 151936; the embedding and LM head are random and written
to a temporary checkpoint directory, since the trainer reads them from the target's safetensors). The
packed batch holds ``--seqs`` sequences of ``--seq-len`` tokens with random hidden states of the captured
layers (``[T, n*H]``, bf16 on GPU).

    python benchmarks/trainer.py --device cuda --shape qwen3-8b --seq-len 2048 --num-anchors 512
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from consumer.dflash import DFlashConfig  # noqa: E402
from consumer.trainer import Trainer  # noqa: E402
from shared.config import DEFAULT_TARGET, TrainerConfig  # noqa: E402
from benchmarks.random_target import QWEN3_8B, write_random_target  # noqa: E402

def make_batch(dcfg: DFlashConfig, seqs: int, seq_len: int, device, dtype) -> dict[str, torch.Tensor]:
    t = seqs * seq_len
    n, h = dcfg.num_target_layers, dcfg.hidden_size
    g = torch.Generator().manual_seed(1)
    return {
        "hidden": torch.randn(t, n * h, generator=g).to(device=device, dtype=dtype),
        "input_ids": torch.randint(4, dcfg.vocab_size, (t,), generator=g, dtype=torch.int32).to(device),
        "loss_mask": torch.ones(t, dtype=torch.uint8, device=device),
        "cu_seqlens": torch.arange(0, t + 1, seq_len, dtype=torch.int32, device=device),
    }


def sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--shape", choices=["tiny", "qwen3-8b"], default="tiny")
    ap.add_argument("--seqs", type=int, default=1)
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--num-anchors", type=int, default=512)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--num-layers", type=int, default=5, help="captured target layers = drafter layers")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    tmp = tempfile.TemporaryDirectory()
    if args.shape == "tiny":
        target, layers = DEFAULT_TARGET, 8
    else:
        target, layers = write_random_target(Path(tmp.name) / "qwen3-8b"), QWEN3_8B["num_hidden_layers"]
    from producers.target import default_target_layer_ids
    ids = default_target_layer_ids(layers, args.num_layers)
    dcfg = DFlashConfig.from_target(target, ids, args.block_size, mask_token_id=None)
    cfg = TrainerConfig(devices=[str(device)], block_size=args.block_size, num_anchors=args.num_anchors,
                        max_steps=args.steps + args.warmup + 5, warmup_steps=1)
    trainer = Trainer(cfg, dcfg, target, device, tmp.name, write_metrics=False)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    batch = make_batch(dcfg, args.seqs, args.seq_len, device, dtype)
    tokens = args.seqs * args.seq_len
    for i in range(args.warmup):
        trainer.step(batch, [i])
    sync(device)
    t0 = time.perf_counter()
    for i in range(args.steps):
        r = trainer.step(batch, [1000 + i])
    sync(device)
    train_s = (time.perf_counter() - t0) / args.steps
    mem = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else 0.0
    print(f"shape={args.shape} device={device} layers_captured={ids} draft_layers={dcfg.num_hidden_layers} "
          f"block_size={args.block_size} anchors={args.num_anchors} seqs={args.seqs} seq_len={args.seq_len}")
    print(f"train_step_s={train_s:.4f} loss={r['loss']:.3f} peak_gpu_mem_gib={mem:.1f}")
    print(f"train_tokens_per_s={tokens / train_s:,.0f}")
    print(f"train_blocks_per_s={r['num_blocks'] / train_s:,.0f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
