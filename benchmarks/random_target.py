"""A Qwen3-8B-shaped target checkpoint directory without the 16 GB of weights, for GPU benchmarks.

It holds ``config.json`` (Qwen3-8B's shape), random ``model.embed_tokens.weight`` and ``lm_head.weight``
(bf16, the tensors the drafter shares with the target) and the fixture's tokenizer files. Producers load it
with ``--random-target-weights`` (every other weight random, built on the GPU); the trainer reads the
embedding and head from it as from any target.

    python benchmarks/random_target.py --output /tmp/qwen3-8b-random
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

import torch

QWEN3_8B = {
    "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 4096, "intermediate_size": 12288,
    "num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
    "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "vocab_size": 151936, "max_position_embeddings": 40960,
    "tie_word_embeddings": False, "bos_token_id": 0, "eos_token_id": 0, "pad_token_id": 3,
    "attention_bias": False, "hidden_act": "silu",
}
FIXTURE = Path(__file__).resolve().parent.parent / "assets" / "tiny-code-lm"


def write_random_target(dirname: Path, seed: int = 0) -> Path:
    """Write the directory described in the module docstring; returns it."""
    from safetensors.torch import save_file
    dirname = Path(dirname)
    dirname.mkdir(parents=True, exist_ok=True)
    (dirname / "config.json").write_text(json.dumps(QWEN3_8B, indent=1))
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (FIXTURE / name).is_file():
            shutil.copy(FIXTURE / name, dirname / name)
    g = torch.Generator().manual_seed(seed)
    v, h = QWEN3_8B["vocab_size"], QWEN3_8B["hidden_size"]
    save_file({"model.embed_tokens.weight": (torch.randn(v, h, generator=g) * 0.02).to(torch.bfloat16),
               "lm_head.weight": (torch.randn(v, h, generator=g) * 0.02).to(torch.bfloat16)},
              str(dirname / "model.safetensors"))
    return dirname


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--output", required=True)
    args = ap.parse_args()
    print(write_random_target(Path(args.output)))
    sys.exit(0)
