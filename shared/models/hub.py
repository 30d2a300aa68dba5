"""Targets named by Hugging Face hub id (``Qwen/Qwen3-8B``) as well as by directory.

``resolve_model_dir`` turns either into a local directory: a directory as it is; a hub id through the local
Hugging Face cache (``huggingface_hub.snapshot_download`` with ``local_files_only``: ``HF_HOME`` /
``HF_HUB_CACHE`` say where it is), and, when it is not cached and downloads are allowed (``HF_HUB_OFFLINE`` not
set), downloaded into that cache (config, tokenizer, safetensors and modelling files only). The directory
is what every process then uses, so a run's recorded configuration names a path that exists.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from specring.shared import envs
from specring.shared.errors import ConfigError

HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*$")
ALLOW = ["*.json", "*.safetensors", "*.jinja", "*.txt", "*.model", "*.tiktoken", "*.py"]


def hub_cache_dir() -> Path:
    """The Hugging Face hub cache the environment names now (``HF_HUB_CACHE``, else ``HF_HOME``/hub, else
    ``~/.cache/huggingface/hub``); read at call time, since huggingface_hub reads it once at its import."""
    if envs.get("HF_HUB_CACHE"):
        return Path(envs.get("HF_HUB_CACHE")).expanduser()
    home = envs.get("HF_HOME") or os.path.join(envs.get("XDG_CACHE_HOME", "~/.cache"), "huggingface")
    return Path(home).expanduser() / "hub"


def resolve_model_dir(spec: str | Path, flag: str = "--target") -> Path:
    """A local checkpoint directory for ``spec`` (a directory or a hub id ``org/name[@revision]``).

    Raises ``ConfigError`` naming ``flag`` when ``spec`` is neither an existing directory nor a hub id, or a hub
    id that is not in the local cache while downloads are off (or the download fails), saying what to run; for
    ``@revision`` the message names the revision and the revisions the cache does hold (``cached_revisions``).
    """
    path = Path(str(spec)).expanduser()
    if path.is_dir():
        return path
    text = str(spec)
    repo, _, revision = text.partition("@")
    if not HUB_ID.match(repo) or text.startswith((".", "/", "~")):
        raise ConfigError(f"{flag}: {text!r} is neither a directory nor a Hugging Face hub id (org/name)")
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError
    cache = hub_cache_dir()
    try:
        return Path(snapshot_download(repo, revision=revision or None, local_files_only=True, allow_patterns=ALLOW,
                                      cache_dir=cache))
    except (LocalEntryNotFoundError, FileNotFoundError, OSError):
        pass
    offline = envs.truthy("HF_HUB_OFFLINE")
    what = f"{repo} at revision {revision!r}" if revision else repo
    have = cached_revisions(repo, cache)
    cached = (f"; the cache holds {repo} only at {', '.join(have)} (name one as {repo}@REVISION)"
              if revision and have else "")
    if offline:
        download = f"huggingface-cli download {repo}" + (f" --revision {revision}" if revision else "")
        raise ConfigError(f"{flag}: {what} is not in the local Hugging Face cache ({cache}) and downloads are off "
                          f"(HF_HUB_OFFLINE){cached}: run `{download}` where there is network, or "
                          "pass the checkpoint's directory")
    try:
        return Path(snapshot_download(repo, revision=revision or None, allow_patterns=ALLOW, cache_dir=cache))
    except Exception as e:  # noqa: BLE001 - network, authentication, a repository that does not exist
        raise ConfigError(f"{flag}: {what} is not in the local Hugging Face cache ({cache}) and could not be "
                          f"downloaded ({type(e).__name__}: {str(e)[:200]}){cached}; pass the checkpoint's "
                          "directory or fill the cache first") from None


def cached_revisions(repo: str, cache: Path) -> list[str]:
    """The revisions of ``repo`` the hub cache ``cache`` holds a snapshot of: its refs (``main``, ``refs/pr/1``),
    each with the commit it names (``main (commit 0123456789ab)``), then snapshots no ref names (by commit)."""
    root = Path(cache) / f"models--{repo.replace('/', '--')}"
    snaps = {p.name for p in (root / "snapshots").glob("*") if p.is_dir()}
    out, named = [], set()
    refs = root / "refs"
    for ref in sorted(p for p in refs.rglob("*") if p.is_file()) if refs.is_dir() else []:
        try:
            commit = ref.read_text().strip()
        except OSError:
            continue
        if commit in snaps:
            named.add(commit)
            out.append(f"{ref.relative_to(refs).as_posix()} (commit {commit[:12]})")
    return out + sorted(c[:12] for c in snaps - named)


# transformers' loaders by what they load: every from_pretrained of a target, its tokenizer or its configs
LOADERS = {"config": "AutoConfig", "tokenizer": "AutoTokenizer", "causal_lm": "AutoModelForCausalLM",
           "generation_config": "GenerationConfig"}


def load_pretrained(kind: str, model_dir: str | Path, *, trust_remote_code: bool = False, flag: str = "--target",
                    **kwargs):
    """``transformers.<Auto class>.from_pretrained(model_dir, local_files_only=True, trust_remote_code=...,
    **kwargs)``: the one place where specring asks transformers for a target's config (``kind="config"``),
    tokenizer (``"tokenizer"``), model (``"causal_lm"``) or generation config (``"generation_config"``), so that
    ``--trust-remote-code`` reaches every such load in every process.

    ``model_dir`` is a local directory (hub ids are resolved once, at start, by ``resolve_model_dir``); nothing
    is downloaded. ``trust_remote_code`` lets transformers import the Python modules the directory names in its
    ``auto_map`` (model families outside transformers). A load refused because the directory ships its own
    code and ``trust_remote_code`` is off raises ``ConfigError`` naming ``flag`` and ``--trust-remote-code``;
    any other error of transformers propagates unchanged.
    """
    import transformers

    cls = getattr(transformers, LOADERS[kind])
    try:
        return cls.from_pretrained(str(model_dir), local_files_only=True, trust_remote_code=trust_remote_code,
                                   **kwargs)
    except ValueError as e:
        if not trust_remote_code and "trust_remote_code" in str(e):
            raise ConfigError(f"{flag}: {model_dir} ships its own modelling or tokenizer code (auto_map); pass "
                              f"--trust-remote-code to let transformers run it") from None
        raise
