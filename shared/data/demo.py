"""The embedded default corpus: the running interpreter's standard library, split by the fixture target's
held-out rule into ``train.arrow`` and ``heldout.arrow`` (``build_demo``; ``ensure_demo`` builds it once, under
a lock, where the runs' data lives).
"""

from __future__ import annotations

import hashlib
import json
import logging
import sys
from pathlib import Path

from specring.shared import paths
from specring.shared.data.encode import (
    EncoderConfig,
    Runner,
    Task,
    load_tokenizer,
    vocab_size_of,
)
from specring.shared.data.writer import _tokenizer_meta, report, write_dataset
from specring.shared.paths import DEFAULT_TARGET

logger = logging.getLogger(__name__)






DEMO_MAX_LENGTH = 1024


DEMO_VERSION = 1


def stdlib_files() -> tuple[Path, list[tuple[str, str]], int]:
    """``(stdlib root, [(relative path, text)], files skipped as not UTF-8)``: the running interpreter's
    standard library ``.py`` files (tests included, site-packages excluded, under 200 characters dropped),
    sorted by relative path: the corpus kind of ``assets/tiny-code-lm`` (see its README)."""
    import sysconfig

    root = Path(sysconfig.get_paths()["stdlib"])
    out, undecodable = [], 0
    for p in sorted(root.rglob("*.py")):
        rel = p.relative_to(root)
        if "site-packages" in rel.parts or not p.is_file():
            continue
        try:
            text = p.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            undecodable += 1
            continue
        if len(text) >= 200:
            out.append((rel.as_posix(), text))
    return root, out, undecodable


def is_heldout(rel_path: str) -> bool:
    """The fixture's held-out rule: ``int(sha1(relative path).hexdigest(), 16) % 20 == 0``."""
    return int(hashlib.sha1(rel_path.encode()).hexdigest(), 16) % 20 == 0


def build_demo(out_dir: Path, *, tokenizer: Path = DEFAULT_TARGET, max_length: int = DEMO_MAX_LENGTH,
               workers: int = 1, progress: bool = True) -> tuple[Path, Path]:
    """Write ``out_dir/train.arrow`` and ``out_dir/heldout.arrow`` (+ sidecars) from the stdlib corpus.

    Each file is tokenized, an EOS token appended, and cut into ``ceil(n / max_length)`` near-equal
    samples (loss on every token); ``source_file`` indexes the sidecar's ``inputs`` (relative paths) and
    ``source_row`` is the piece number within the file. Returns ``(train_path, heldout_path)``.

    ``workers=1`` is the fast choice here: whole files go to the tokenizer's batch encoder, which is already
    multi-threaded in Rust, while worker processes pay a few seconds each to import ``transformers``.
    """
    root, docs, undecodable = stdlib_files()
    tok = load_tokenizer(tokenizer)
    cfg = EncoderConfig(str(tokenizer), max_length, "truncate", vocab_size_of(tokenizer, tok))
    runner = Runner(cfg, workers)
    paths = []
    try:
        for split in ("train", "heldout"):
            part = [(rel, text) for rel, text in docs if is_heldout(rel) == (split == "heldout")]
            names = [rel for rel, _ in part]
            tasks = (Task(i, "doc", list(range(i, min(i + 16, len(part)))), [t for _, t in part[i:i + 16]])
                     for i in range(0, len(part), 16))
            meta = dict(_tokenizer_meta(tokenizer, tok, cfg, "split"), corpus="stdlib", demo_version=DEMO_VERSION,
                        python=sys.version.split()[0], stdlib_root=str(root), num_files=len(part),
                        num_chars=sum(len(t) for _, t in part), undecodable_files_skipped=undecodable)
            path = Path(out_dir) / f"{split}.arrow"
            side = write_dataset(runner, tasks, path, inputs=names, total_rows=len(part), strict=False,
                                 progress=progress, meta=meta)
            print(report(side, path))
            paths.append(path)
    finally:
        runner.close()
    return paths[0], paths[1]


def ensure_demo(work_root: str | Path | None = None) -> tuple[Path, Path]:
    """The demo files under ``WORK_ROOT/data/demo`` (default: the current directory's, ``shared.paths``), built
    first when missing or of an older demo version.

    Safe to call from several processes at once (an ``flock`` on ``data/demo/.lock``).
    Returns ``(train_path, heldout_path)``.
    """
    import fcntl

    from specring.shared.data.dataset import sidecar_path

    out_dir = Path(work_root if work_root is not None else paths.work_root()) / "data" / "demo"
    train, heldout = out_dir / "train.arrow", out_dir / "heldout.arrow"

    def ready() -> bool:
        for p in (train, heldout):
            side = sidecar_path(p)
            if not (p.is_file() and side.is_file()):
                return False
            try:
                if json.loads(side.read_text()).get("demo_version") != DEMO_VERSION:
                    return False
            except ValueError:
                return False
        return True

    if ready():
        return train, heldout
    out_dir.mkdir(parents=True, exist_ok=True)
    with open(out_dir / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not ready():
            logger.info("building the demo corpus in %s", out_dir)
            build_demo(out_dir, workers=1, progress=False)
    return train, heldout
