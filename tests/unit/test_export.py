"""Export to the DFlash serving format (shared/drafters/dflash_export.py): layout, names, reload, refusals.

Names and config fields are checked against the public draft definition (z-lab/dflash ``dflash/model.py``,
``DFlashDraftModel``) and what the serving loaders read (SGLang ``speculative/dflash_utils.py``
``parse_dflash_draft_config``, vLLM ``models/qwen3_dflash.py``); see shared/drafters/dflash_export.py.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from specring.cli.export import main
from specring.shared.data.dataset import TokenDataset
from specring.shared.drafters import checkpoint as ckpt
from specring.shared.drafters.dflash_export import (
    export_drafter,
    load_exported,
    load_exported_as_served,
    reference_weight_names,
)
from specring.shared.models.dflash import (
    EMBED_KEY,
    HEAD_KEY,
    DFlashConfig,
    build_drafter,
)
from tests.support import TARGET, make_dataset

LAYERS = [1, 3, 5]


@pytest.fixture(scope="module")
def dcfg():
    return DFlashConfig.from_target(TARGET, LAYERS, block_size=8, mask_token_id=3, num_draft_layers=2)


@pytest.fixture(scope="module")
def drafter(dcfg):
    torch.manual_seed(0)
    model = build_drafter(dcfg, TARGET)
    with torch.no_grad():   # norms away from 1 so a swapped or missing norm weight shows in the logits
        for p in model.parameters():
            if p.requires_grad and p.dim() == 1:
                p.add_(0.1 * torch.randn_like(p))
    return model.eval()


def _save(run_dir, drafter, dcfg, drop=(), config_edit=None, tensor_edit=None):
    tensors = {**drafter.trainable_state_dict(), **drafter.frozen_state_dict()}
    for k in drop:
        tensors.pop(k)
    if tensor_edit:
        tensor_edit(tensors)
    cfg = dcfg.to_dict()
    if config_edit:
        config_edit(cfg)
    return ckpt.save_checkpoint(Path(run_dir) / "checkpoints", 100, tensors, {"step": 100}, cfg)


def _inputs(dcfg, ctx_len=20, seed=0):
    g = torch.Generator().manual_seed(seed)
    b = dcfg.block_size
    ids = torch.full((b,), dcfg.mask_token_id)
    ids[0] = 1234
    ctx = torch.randn(ctx_len, dcfg.num_target_layers * dcfg.hidden_size, generator=g)
    return ids, torch.arange(ctx_len, ctx_len + b), ctx, torch.arange(ctx_len)


def _logits(model, dcfg):
    ids, pos, ctx, cpos = _inputs(dcfg)
    with torch.no_grad():
        return model.logits(model(ids, pos, ctx, cpos, None)).float()


def test_export_writes_the_reference_layout(tmp_path, drafter, dcfg):
    _save(tmp_path / "run", drafter, dcfg)
    out = export_drafter(tmp_path / "run", tmp_path / "export", TARGET)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["DFlashDraftModel"] and cfg["model_type"] == "qwen3"
    assert cfg["block_size"] == 8 and cfg["dflash_config"]["block_size"] == 8
    assert cfg["dflash_config"]["mask_token_id"] == 3 and cfg["dflash_config"]["mask_token"] == "<|pad|>"
    assert cfg["dflash_config"]["target_layer_ids"] == LAYERS
    assert cfg["eagle_aux_hidden_state_layer_ids"] == [2, 4, 6]
    assert cfg["num_target_layers"] == 8                      # the target's depth, as in z-lab's configs
    assert cfg["num_hidden_layers"] == 2 and cfg["layer_types"] == ["full_attention"] * 2
    shape = (cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"])
    assert shape == (256, 4, 2, 64)
    assert cfg["intermediate_size"] == 768 and cfg["vocab_size"] == 8192 and cfg["rope_theta"] == 10000.0
    assert cfg["dtype"] == "bfloat16"                          # auto = the target's dtype
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        names = set(f.keys())
        assert f.metadata()["format"] == "pt"
        assert {f.get_tensor(k).dtype for k in names} == {torch.bfloat16}
        assert tuple(f.get_tensor("fc.weight").shape) == (256, 3 * 256)
    assert names == reference_weight_names(2)                 # the public definition's names, nothing else
    assert EMBED_KEY not in names and HEAD_KEY not in names
    prov = json.loads((out / "specring_export.json").read_text())
    assert prov["step_dir"] == "step-000100" and Path(prov["target"]) == TARGET.resolve()


def test_reference_names_spelled_out_for_one_layer():
    assert reference_weight_names(1) == {
        "fc.weight", "hidden_norm.weight", "norm.weight",
        "layers.0.self_attn.q_proj.weight", "layers.0.self_attn.k_proj.weight", "layers.0.self_attn.v_proj.weight",
        "layers.0.self_attn.o_proj.weight", "layers.0.self_attn.q_norm.weight", "layers.0.self_attn.k_norm.weight",
        "layers.0.mlp.gate_proj.weight", "layers.0.mlp.up_proj.weight", "layers.0.mlp.down_proj.weight",
        "layers.0.input_layernorm.weight", "layers.0.post_attention_layernorm.weight"}


def test_transformers_reads_the_config_as_a_qwen3_draft(tmp_path, drafter, dcfg):
    from transformers import AutoConfig

    _save(tmp_path / "run", drafter, dcfg)
    out = export_drafter(tmp_path / "run", tmp_path / "export", TARGET)
    hf = AutoConfig.from_pretrained(str(out))
    assert type(hf).__name__ == "Qwen3Config" and hf.num_hidden_layers == 2
    assert hf.dflash_config["target_layer_ids"] == LAYERS and hf.block_size == 8
    theta = hf.rope_parameters["rope_theta"] if getattr(hf, "rope_parameters", None) else hf.rope_theta
    assert theta == 10000.0


def test_reload_gives_identical_logits(tmp_path, drafter, dcfg):
    _save(tmp_path / "run", drafter, dcfg)
    out32 = export_drafter(tmp_path / "run", tmp_path / "e32", TARGET, dtype="float32")
    again = load_exported(out32, TARGET)
    assert torch.equal(_logits(again, dcfg), _logits(drafter, dcfg))
    # bf16 export: identical to the checkpoint's drafter with its weights rounded to bf16
    out16 = export_drafter(tmp_path / "run", tmp_path / "e16", TARGET)
    rounded = build_drafter(dcfg, TARGET)
    with torch.no_grad():
        for (name, p), (_, q) in zip(rounded.named_parameters(), drafter.named_parameters()):
            if p.requires_grad:
                p.copy_(q.to(torch.bfloat16).float())
    assert torch.equal(_logits(load_exported(out16, TARGET), dcfg), _logits(rounded, dcfg))


def test_export_follows_the_run_to_its_target_and_latest_checkpoint(tmp_path, drafter, dcfg):
    run = tmp_path / "run"
    _save(run, drafter, dcfg)
    (run / "config.json").write_text(json.dumps({"producer": {"target": str(TARGET)}}))
    assert main(["--drafter", str(run), "--output", str(tmp_path / "x")]) == 0
    assert (tmp_path / "x" / "model.safetensors").is_file()
    assert main(["--drafter", str(run), "--output", str(tmp_path / "x")]) == 2        # not empty: refused
    assert main(["--drafter", str(run), "--output", str(tmp_path / "x"), "--overwrite"]) == 0


@pytest.mark.parametrize("missing", [HEAD_KEY, EMBED_KEY])
def test_a_checkpoint_without_head_or_embedding_is_refused(tmp_path, drafter, dcfg, missing, capsys):
    _save(tmp_path / "run", drafter, dcfg, drop=[missing])
    with pytest.raises(ValueError, match=missing.replace(".", r"\.")):
        export_drafter(tmp_path / "run", tmp_path / "out", TARGET)
    assert not (tmp_path / "out").exists()
    assert main(["--drafter", str(tmp_path / "run"), "--output", str(tmp_path / "out"), "--target", str(TARGET)]) == 2
    assert missing in capsys.readouterr().err and not (tmp_path / "out").exists()


def test_unrecorded_or_impossible_layer_ids_are_refused(tmp_path, drafter, dcfg):
    _save(tmp_path / "a", drafter, dcfg, config_edit=lambda c: c.pop("target_layer_ids"))
    with pytest.raises(ValueError, match="target_layer_ids not recorded"):
        export_drafter(tmp_path / "a", tmp_path / "out", TARGET)
    _save(tmp_path / "b", drafter, dcfg, config_edit=lambda c: c.update(target_layer_ids=[1, 3, 9]))
    with pytest.raises(ValueError, match=r"\[9\] do not exist in the 8-layer target"):
        export_drafter(tmp_path / "b", tmp_path / "out", TARGET)
    assert not (tmp_path / "out").exists()


def test_a_head_that_is_not_the_targets_is_refused(tmp_path, drafter, dcfg):
    def perturb(t):
        t[EMBED_KEY] = t[EMBED_KEY].clone()
        t[EMBED_KEY][5, 0] += 1
    _save(tmp_path / "run", drafter, dcfg, tensor_edit=perturb)
    with pytest.raises(ValueError, match="differs from the target's"):
        export_drafter(tmp_path / "run", tmp_path / "out", TARGET)


def test_load_exported_refuses_foreign_or_incomplete_exports(tmp_path, drafter, dcfg):
    _save(tmp_path / "run", drafter, dcfg)
    out = export_drafter(tmp_path / "run", tmp_path / "e", TARGET, dtype="float32")
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    tensors.pop("norm.weight")
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match="norm.weight"):
        load_exported(out, TARGET)
    cfg = json.loads((out / "config.json").read_text())
    cfg["num_target_layers"] = 36
    (out / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="num_target_layers 36"):
        load_exported(out, TARGET)


# ------------------------------------------------------------------------------ as users load it (item 10)
LOAD_AS_USERS_DO = r"""
import json, sys, torch
from transformers import AutoModel, AutoModelForCausalLM
export_dir, target_dir, case = sys.argv[1], sys.argv[2], sys.argv[3]
ref = torch.load(case)
draft, info = AutoModel.from_pretrained(export_dir, trust_remote_code=True, dtype="auto", output_loading_info=True)
draft.eval()
target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=draft.dtype).eval()
with torch.no_grad():
    hidden = draft(position_ids=torch.cat([ref["cpos"], ref["pos"]])[None],
                   noise_embedding=target.get_input_embeddings()(ref["ids"])[None], target_hidden=ref["ctx"][None])
    logits = draft.compute_logits(hidden, target.lm_head)[0].float()
    prompt = ref["prompt"][None]       # lossless in float32 (a bf16 target's greedy has near-ties)
    target32 = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    spec = draft.spec_generate(target32, prompt, max_new_tokens=20, stop_token_ids=None)
    greedy = target32.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=False, max_new_tokens=20,
                               min_new_tokens=20, pad_token_id=0)
print(json.dumps({"class": type(draft).__name__, "module": type(draft).__module__, "dtype": str(draft.dtype),
                  "file": sys.modules[type(draft).__module__].__file__,
                  "missing": list(info["missing_keys"]), "unexpected": list(info["unexpected_keys"]),
                  "logits_equal": bool(torch.equal(logits, ref["logits"])),
                  "max_diff": float((logits - ref["logits"]).abs().max()),
                  "lossless": spec.tolist() == greedy.tolist(),
                  "specring_modules": sorted(m for m in sys.modules
                                             if m.split(".")[0] in ("consumer", "shared", "producers", "supervisor"))}))
"""


@pytest.mark.parametrize("dtype", ["float32", "auto"])
def test_automodel_loads_the_export_as_our_class_with_the_drafters_logits(tmp_path, drafter, dcfg, dtype):
    """In a fresh interpreter, as the reference's README loads drafts: ``AutoModel.from_pretrained(dir,
    trust_remote_code=True, dtype="auto")`` gives specring's DFlashDraftModel (no missing weights) whose
    draft logits equal specring's drafter's in the exported dtype, and whose spec_generate is lossless."""
    _save(tmp_path / "run", drafter, dcfg)
    out = export_drafter(tmp_path / "run", tmp_path / "export", TARGET, dtype=dtype)
    exported = json.loads((out / "config.json").read_text())["dtype"]
    served = load_exported(out, TARGET, dtype=getattr(torch, exported))
    ids, pos, ctx, cpos = _inputs(dcfg)
    with torch.no_grad():
        want = served.logits(served(ids, pos, ctx.to(served.fc.weight.dtype), cpos, None)).float()
    prompt = torch.tensor(TokenDataset(make_dataset(tmp_path / "d.arrow", 1))[0][0][:24], dtype=torch.long)
    torch.save({"ids": ids, "pos": pos, "ctx": ctx, "cpos": cpos, "logits": want, "prompt": prompt},
               tmp_path / "case.pt")
    env = dict(os.environ, HF_MODULES_CACHE=str(tmp_path / "hf_modules"), HF_HUB_OFFLINE="1", PYTHONPATH="")
    res = subprocess.run([sys.executable, "-c", LOAD_AS_USERS_DO, str(out), str(TARGET), str(tmp_path / "case.pt")],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)
    assert res.returncode == 0, res.stderr[-3000:]
    got = json.loads(res.stdout.strip().splitlines()[-1])
    assert got["class"] == "DFlashDraftModel" and got["file"].endswith("modeling_dflash.py"), got
    assert got["missing"] == [] and got["unexpected"] == [], got
    assert got["specring_modules"] == [], got           # the export's own file, nothing imported from specring
    assert got["dtype"] == f"torch.{exported}"
    assert got["logits_equal"], got
    assert got["lossless"], got
    with pytest.raises(ValueError, match="is an export, not a checkpoint"):
        ckpt.load_drafter(out)
    evaluated = load_exported_as_served(out)              # what `launch.py eval --drafter EXPORT` measures
    assert evaluated.fc.weight.dtype == served.fc.weight.dtype
    assert torch.equal(evaluated.logits(evaluated(ids, pos, ctx.to(served.fc.weight.dtype), cpos, None)).float(), want)


def test_export_files_have_the_usual_modes_and_record_the_measured_dtype(tmp_path, drafter, dcfg, capsys):
    run = tmp_path / "run"
    _save(run, drafter, dcfg)
    (run / "eval.jsonl").write_text(json.dumps({"step": 100, "tau_mean": 1.25}) + "\n")
    assert main(["--drafter", str(run), "--output", str(tmp_path / "x"), "--target", str(TARGET)]) == 0
    umask = os.umask(0o022)
    os.umask(umask)
    out = tmp_path / "x"
    modes = {f.name: f.stat().st_mode & 0o777 for f in out.iterdir()}
    assert set(modes) == {"config.json", "model.safetensors", "modeling_dflash.py", "specring_export.json"}
    assert set(modes.values()) == {0o666 & ~umask} and (out.stat().st_mode & 0o777) == 0o777 & ~umask
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["auto_map"] == {"AutoModel": "modeling_dflash.DFlashDraftModel"}
    prov = json.loads((out / "specring_export.json").read_text())
    assert prov["dtype"] == "bfloat16" and prov["checkpoint_dtype"] == "float32"
    assert prov["tau_measured"] == {"step": 100, "tau_mean": 1.25, "dtype": "float32"}
    assert "launch.py eval --drafter" in prov["dtype_note"] and "note: exported in bfloat16" in capsys.readouterr().out
    step = ckpt.resolve_checkpoint(run)
    assert {f.stat().st_mode & 0o777 for f in step.iterdir()} == {0o666 & ~umask}   # checkpoints too


@pytest.mark.parametrize("right", [99, 2, 0])
def test_spec_generate_keeps_the_agreeing_prefix_and_stays_lossless(tmp_path, drafter, dcfg, right):
    """spec_generate with a draft that proposes the target's own greedy tokens for the first ``right`` slots
    of each block (then wrong ones): whole blocks, partial blocks and no acceptance all give exactly the
    target's greedy tokens, in ceil(N / (right + 1)) verify rounds."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from specring.shared.drafters.dflash_hf_model import DFlashDraftModel

    _save(tmp_path / "run", drafter, dcfg)
    out = export_drafter(tmp_path / "run", tmp_path / "e", TARGET, dtype="float32")
    target = AutoModelForCausalLM.from_pretrained(str(TARGET), dtype=torch.float32).eval()
    prompt = torch.tensor([[5, 17, 99, 250, 31, 8, 64, 77]])
    n = 21
    greedy = target.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=False, max_new_tokens=n,
                             min_new_tokens=n, pad_token_id=0)[0]

    class Oracle(DFlashDraftModel):
        def draft(self, noise_embedding, positions, cache):
            self.at = positions
            return super().draft(noise_embedding, positions, cache)

        def compute_logits(self, hidden, output_head):
            want = greedy[self.at[1:].clamp(max=len(greedy) - 1)].clone()
            want[right:] = (want[right:] + 1) % dcfg.vocab_size
            return torch.nn.functional.one_hot(want, dcfg.vocab_size).float()

    model = Oracle.from_pretrained(str(out), config=AutoConfig.from_pretrained(str(out))).eval()
    calls = []
    target.register_forward_hook(lambda *a: calls.append(1))
    got = model.spec_generate(target, prompt, max_new_tokens=n)
    assert got[0].tolist() == greedy.tolist()
    per_round = min(right, dcfg.block_size - 1) + 1
    assert len(calls) == 1 + -(-(n - 1) // per_round)       # prefill, then one verify per round
    stop = int(greedy[len(prompt[0]) + 5])
    cut = model.spec_generate(target, prompt, max_new_tokens=n, stop_token_ids=[stop])[0].tolist()
    first = greedy.tolist().index(stop, len(prompt[0]))
    assert cut == greedy[:first + 1].tolist()
