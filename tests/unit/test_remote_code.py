"""--trust-remote-code reaches transformers (shared/models/hub.py load_pretrained): a target whose model type, model
class and tokenizer class live in the checkpoint directory's own code loads with it, and is refused by name
without it, through the loaders every process uses (load_target, check_checkpoint, the tokenizer)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support import TARGET

ROOT = Path(__file__).resolve().parents[2]

CONFIGURATION = '''from transformers import Qwen3Config


class RemoteQwenConfig(Qwen3Config):
    model_type = "specring_remote_qwen"
'''
MODELING = '''from transformers import Qwen3ForCausalLM

from .configuration_remote import RemoteQwenConfig


class RemoteQwenForCausalLM(Qwen3ForCausalLM):
    config_class = RemoteQwenConfig
'''
TOKENIZATION = '''from transformers import PreTrainedTokenizerFast


class RemoteTokenizer(PreTrainedTokenizerFast):
    pass
'''

# runs in a fresh interpreter: transformers copies remote code into HF_MODULES_CACHE, read at its import
PROBE = r'''
import json, sys
from specring.shared.errors import ConfigError
from specring.shared.models.hub import load_pretrained
from specring.shared.models.dflash import resolve_mask_token_id
from specring.shared.models.target import check_checkpoint, load_target
d = sys.argv[1]
out = {}
for name, call in [("config", lambda t: type(load_pretrained("config", d, trust_remote_code=t)).__name__),
                   ("check", lambda t: type(check_checkpoint(d, t)).__name__),
                   ("model", lambda t: type(load_target(d, "cpu", trust_remote_code=t)[0]).__name__),
                   ("tokenizer", lambda t: type(load_pretrained("tokenizer", d, trust_remote_code=t)).__name__),
                   ("mask", lambda t: resolve_mask_token_id(d, t))]:
    for trust in (False, True):
        try:
            out[f"{name}-{trust}"] = call(trust)
        except (ConfigError, ValueError) as e:
            out[f"{name}-{trust}"] = "error: " + str(e)
print(json.dumps(out))
'''


def remote_checkpoint(root: Path) -> Path:
    """The fixture target renamed to a model type transformers does not know, its classes in its own files."""
    d = root / "remote-qwen"
    shutil.copytree(TARGET, d)
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(model_type="specring_remote_qwen", architectures=["RemoteQwenForCausalLM"],
               auto_map={"AutoConfig": "configuration_remote.RemoteQwenConfig",
                         "AutoModelForCausalLM": "modeling_remote.RemoteQwenForCausalLM"})
    (d / "config.json").write_text(json.dumps(cfg))
    tok = json.loads((d / "tokenizer_config.json").read_text())
    tok.update(tokenizer_class="RemoteTokenizer",
               auto_map={"AutoTokenizer": [None, "tokenization_remote.RemoteTokenizer"]})
    (d / "tokenizer_config.json").write_text(json.dumps(tok))
    (d / "configuration_remote.py").write_text(CONFIGURATION)
    (d / "modeling_remote.py").write_text(MODELING)
    (d / "tokenization_remote.py").write_text(TOKENIZATION)
    return d


@pytest.mark.timeout(180)
def test_trust_remote_code_reaches_every_loader_and_is_named_when_missing(tmp_path):
    d = remote_checkpoint(tmp_path)
    env = dict(os.environ, HF_MODULES_CACHE=str(tmp_path / "modules"), HF_HUB_OFFLINE="1", PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, "-c", PROBE, str(d)], env=env, capture_output=True, text=True,
                          timeout=170, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["config-True"] == "RemoteQwenConfig"
    assert got["check-True"] == "RemoteQwenConfig"
    assert got["model-True"] == "RemoteQwenForCausalLM"
    assert got["tokenizer-True"] == "RemoteTokenizer"
    assert got["mask-True"] == 3  # the fixture's pad token, read through the remote tokenizer class
    for name in ("config", "check", "model", "tokenizer", "mask"):
        assert got[f"{name}-False"].startswith("error: "), (name, got[f"{name}-False"])
    for name in ("config", "check", "model", "tokenizer", "mask"):
        assert "pass --trust-remote-code" in got[f"{name}-False"], got[f"{name}-False"]
    assert (tmp_path / "modules").is_dir()  # transformers imported the directory's code from there
