"""Export to the DFlash serving format (consumer/export.py): layout, names, reload, refusals.

Names and config fields are checked against the public draft definition (z-lab/dflash ``dflash/model.py``,
``DFlashDraftModel``) and what the serving loaders read (SGLang ``speculative/dflash_utils.py``
``parse_dflash_draft_config``, vLLM ``models/qwen3_dflash.py``); see consumer/export.py.
"""

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from consumer import checkpoint as ckpt
from consumer.dflash import EMBED_KEY, HEAD_KEY, DFlashConfig, build_drafter
from consumer.export import export_drafter, load_exported, main, reference_weight_names

TARGET = Path(__file__).resolve().parents[2] / "assets" / "tiny-code-lm"
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
    assert (cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]) == (256, 4, 2, 64)
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
