"""What a target directory holds, by content, cheaply: the fingerprints the nodes of a run compare.

Every node of a run loads its own copy of the target (a local disk, another path, another hub snapshot); the
nodes must run the same target, by content, not by path, with the same tokenizer. Hashing a 100 GB checkpoint
would take minutes, so ``target_fingerprint`` reads, of each weight file, its size, its safetensors header (every
tensor's name, dtype, shape and offsets) and ``TENSOR_SAMPLE_BYTES`` at the start, middle and end of every tensor
(3 KiB per tensor: a few MiB for a 100 GB checkpoint of some hundred tensors); another weight format gives
``SAMPLES`` evenly spaced chunks of ``SAMPLE_BYTES`` (a file smaller than that is read whole). Two checkpoints of
one architecture whose weights differ (another fine-tune, even of one tensor; a random initialisation) differ in
the sampled bytes; a copy at another path, a re-save by another transformers version (``transformers_version``,
``_name_or_path`` are left out of the config) is the same.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

SAMPLES = 16                         # other weight files: this many evenly spaced chunks ...
SAMPLE_BYTES = 1 << 16               # ... of this many bytes
TENSOR_SAMPLE_BYTES = 1 << 10        # safetensors: this many bytes at the start, middle and end of every tensor
MAX_HEADER_BYTES = 1 << 27           # a safetensors header larger than this is sampled like the data
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
CONFIG_FILES = ("config.json",)      # with *.index.json and the modelling code (*.py) the directory ships
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "vocab.json", "vocab.txt", "merges.txt", "tokenizer.model", "spiece.model", "chat_template.jinja",
                   "chat_template.json")
VOLATILE_KEYS = ("_name_or_path", "name_or_path", "_commit_hash", "transformers_version")


def _canonical_json(path: Path) -> bytes:
    """A JSON file's value without the keys that name where or by what it was saved (``VOLATILE_KEYS``); the
    raw bytes when it is not JSON."""
    raw = path.read_bytes()
    try:
        value = json.loads(raw)
    except ValueError:
        return raw
    if isinstance(value, dict):
        value = {k: v for k, v in value.items() if k not in VOLATILE_KEYS}
    return json.dumps(value, sort_keys=True, separators=(",", ":")).encode()


def _sample_tensors(f, header: bytes, base: int, h) -> bool:
    """Of a safetensors file (``f``, its ``header``, data from ``base``): ``TENSOR_SAMPLE_BYTES`` at the start,
    middle and end of every tensor (a fine-tune changes almost every element of a tensor it changes). False when
    the header is not what safetensors writes."""
    try:
        meta = json.loads(header)
        spans = sorted(tuple(v["data_offsets"]) for k, v in meta.items() if k != "__metadata__")
    except (ValueError, TypeError, KeyError, AttributeError):
        return False
    for a, b in spans:
        n = b - a
        for off in sorted({0, max(0, n // 2 - TENSOR_SAMPLE_BYTES // 2), max(0, n - TENSOR_SAMPLE_BYTES)}):
            f.seek(base + a + off)
            h.update(f.read(min(TENSOR_SAMPLE_BYTES, n)))
    return True


def _sample_file(path: Path, h) -> None:
    size = path.stat().st_size
    h.update(f"{path.name}\0{size}\0".encode())
    with open(path, "rb") as f:
        if path.suffix == ".safetensors" and size >= 8:
            n = int.from_bytes(f.read(8), "little")
            if 0 < n <= min(MAX_HEADER_BYTES, size - 8):
                header = f.read(n)
                h.update(header)
                if _sample_tensors(f, header, 8 + n, h):
                    return
        if size <= SAMPLES * SAMPLE_BYTES:
            f.seek(0)
            h.update(f.read())
            return
        for k in range(SAMPLES):
            f.seek((size - SAMPLE_BYTES) * k // (SAMPLES - 1))
            h.update(f.read(SAMPLE_BYTES))


def _digest(parts) -> str:
    h = hashlib.sha256(b"specring-fingerprint-v1\0")
    for part in parts:
        h.update(part if isinstance(part, bytes) else str(part).encode())
        h.update(b"\0")
    return h.hexdigest()[:16]


def target_fingerprint(target_dir: str | Path) -> dict[str, str]:
    """``{"target config": ..., "target weights": ..., "tokenizer": ...}``: short content digests of the target
    directory (module docstring): its config (``config.json``, the weight index, the modelling code it ships),
    its weight files (sampled) and its tokenizer files. A part the directory does not have digests as empty.
    Raises ``OSError`` for a file that cannot be read."""
    d = Path(target_dir)
    files = sorted(p for p in d.iterdir() if p.is_file()) if d.is_dir() else []
    config = [n.encode() + b"\0" + _canonical_json(p) for p in files for n in [p.name]
              if n in CONFIG_FILES or n.endswith(".index.json")]
    config += [p.name.encode() + b"\0" + p.read_bytes() for p in files if p.suffix == ".py"]
    h = hashlib.sha256(b"specring-weights-v1\0")
    for p in files:
        if p.suffix in WEIGHT_SUFFIXES:
            _sample_file(p, h)
    tokenizer = [p.name.encode() + b"\0" + (_canonical_json(p) if p.suffix == ".json" else p.read_bytes())
                 for p in files if p.name in TOKENIZER_FILES or p.suffix == ".tiktoken"]
    return {"target config": _digest(config), "target weights": h.hexdigest()[:16], "tokenizer": _digest(tokenizer)}
