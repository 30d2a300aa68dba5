"""Unit tests of shared/models/target.py: layer ids, device and checkpoint validation, forward-hook capture.

The capture tests use the fixture target (assets/tiny-code-lm: Qwen3, 8 layers, H = 256) on the CPU in
float32, and compare against Hugging Face's own ``output_hidden_states``.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from specring.shared.config.run_config import DEFAULT_TARGET
from specring.shared.errors import ConfigError
from specring.shared.machine.devices import resolve_device
from specring.shared.models import target
from specring.shared.models.layer_ids import default_target_layer_ids
from specring.shared.models.target import (
    LayerCapture,
    StopForward,
    load_target,
    resolve_layer_ids,
)


@pytest.fixture(scope="module")
def tiny():
    model, cfg = load_target(DEFAULT_TARGET, "cpu")
    return model, cfg


def tokens(n: int, seed: int) -> torch.Tensor:
    return torch.randint(4, 8192, (1, n), generator=torch.Generator().manual_seed(seed))


# ------------------------------------------------------------------------------------------ layer ids
@pytest.mark.parametrize("num_layers,n,expected", [
    (36, 5, [1, 9, 17, 25, 33]),      # Qwen3-8B, the DFlash default
    (36, 1, [18]),
    (36, 2, [1, 33]),
    (8, 5, [1, 2, 3, 4, 5]),          # the fixture
    (28, 3, [1, 13, 25]),
    (7, 1, [3]),
])
def test_default_layer_ids(num_layers, n, expected):
    assert default_target_layer_ids(num_layers, n) == expected


def test_default_layer_ids_reject_nonsense():
    with pytest.raises(ConfigError, match="num_target_layers"):
        default_target_layer_ids(8, 0)
    with pytest.raises(ConfigError, match="num_layers"):
        default_target_layer_ids(0, 3)


def test_resolve_layer_ids_uses_given_ids_in_order_or_defaults():
    assert resolve_layer_ids(8, [5, 0, 7], 3) == [5, 0, 7]
    assert resolve_layer_ids(8, None, 5) == [1, 2, 3, 4, 5]


def test_resolve_layer_ids_names_out_of_range_ids():
    with pytest.raises(ConfigError) as e:
        resolve_layer_ids(8, [1, 8, -1, 3], 4)
    assert "[8, -1]" in str(e.value) and "[0, 8)" in str(e.value)


def test_resolve_layer_ids_names_duplicates():
    with pytest.raises(ConfigError, match=r"duplicate layer ids \[3\]"):
        resolve_layer_ids(8, [3, 1, 3], 3)


def test_default_ids_on_a_shallow_model_are_fewer_and_an_explicit_count_that_does_not_fit_is_named():
    # L = 5, n = 5 used to give round(1 + k/4) = 1, 1, 2, 2, 2
    assert resolve_layer_ids(5, None) == [1, 2]
    assert resolve_layer_ids(5, None, 5, exact=False) == [1, 2]
    with pytest.raises(ConfigError, match=r"num_target_layers: a target with 5 decoder layers gives at most 2"):
        resolve_layer_ids(5, None, 5)


@pytest.mark.parametrize("num_layers", range(1, 201))
def test_default_layer_ids_are_distinct_valid_and_keep_the_dflash_spread(num_layers):
    """Every depth, every count: distinct ids in [0, L), as many as asked when the DFlash range 1..L-3 has
    room, else every id of that range; where the old formula gave distinct ids (L >= 4), the same ids."""
    for n in range(1, 40):
        ids = default_target_layer_ids(num_layers, n)
        assert len(set(ids)) == len(ids) and all(0 <= i < num_layers for i in ids), (num_layers, n, ids)
        room = max(1, num_layers - 3)
        assert len(ids) == (1 if n == 1 else min(n, room)), (num_layers, n, ids)
        old = [num_layers // 2] if n == 1 else [int(round(1 + k * (num_layers - 4) / (n - 1))) for k in range(n)]
        if num_layers >= 4 and len(set(old)) == n and all(0 <= i < num_layers for i in old):
            assert ids == old


def test_resolve_layer_ids_rejects_empty():
    with pytest.raises(ConfigError, match="no layer ids"):
        resolve_layer_ids(8, [], 1)


# ------------------------------------------------------------------------------------------ devices
def test_resolve_device_accepts_cpu():
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device(torch.device("cpu")) == torch.device("cpu")


@pytest.mark.skipif(torch.cuda.is_available() and torch.cuda.device_count() > 7, reason="this machine has cuda:7")
def test_resolve_device_names_a_missing_gpu():
    with pytest.raises(ConfigError, match=r"'cuda:7' does not exist"):
        resolve_device("cuda:7")


@pytest.mark.parametrize("spec", ["tpu", "cuda:x", "gpu0", "cpu:3", ""])
def test_resolve_device_names_garbage(spec):
    with pytest.raises(ConfigError, match="device"):
        resolve_device(spec)


# ------------------------------------------------------------------------------------------ loading
def test_load_target_on_cpu_is_float32_eval_and_frozen(tiny):
    model, cfg = tiny
    assert cfg.num_hidden_layers == 8 and cfg.hidden_size == 256
    assert next(model.parameters()).dtype == torch.float32
    assert not model.training
    assert not any(p.requires_grad for p in model.parameters())
    assert target.num_decoder_layers(model) == 8 and target.hidden_size(model) == 256
    assert target.base_model(model) is model.model


def test_load_target_honours_an_explicit_dtype():
    model, _ = load_target(DEFAULT_TARGET, "cpu", "bfloat16")
    assert next(model.parameters()).dtype == torch.bfloat16


def test_missing_checkpoint_directory_is_named(tmp_path):
    missing = tmp_path / "no-such-model"
    with pytest.raises(ConfigError) as e:
        load_target(missing, "cpu")
    assert str(missing) in str(e.value) and "does not exist" in str(e.value)


def test_a_file_is_not_a_checkpoint_directory(tmp_path):
    f = tmp_path / "model.bin"
    f.write_bytes(b"x")
    with pytest.raises(ConfigError, match="not a directory"):
        load_target(f, "cpu")


def test_a_directory_without_config_is_named(tmp_path):
    with pytest.raises(ConfigError, match="no config.json"):
        load_target(tmp_path, "cpu")


def test_a_vision_model_is_not_a_causal_lm(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "vit", "architectures": ["ViTModel"]}))
    with pytest.raises(ConfigError) as e:
        load_target(tmp_path, "cpu")
    assert "not a causal language model" in str(e.value) and "'vit'" in str(e.value)


def test_a_masked_lm_checkpoint_is_not_a_causal_lm(tmp_path):
    # BERT has an AutoModelForCausalLM class, but a BertForMaskedLM checkpoint is an encoder
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "bert", "architectures": ["BertForMaskedLM"]}))
    with pytest.raises(ConfigError) as e:
        load_target(tmp_path, "cpu")
    assert "BertForMaskedLM" in str(e.value) and "not a causal language model" in str(e.value)


def test_a_checkpoint_without_safetensors_is_named(tmp_path):
    shutil.copy(DEFAULT_TARGET / "config.json", tmp_path / "config.json")
    with pytest.raises(ConfigError, match="no \\*.safetensors weights"):
        load_target(tmp_path, "cpu")


def test_broken_weights_are_named(tmp_path):
    shutil.copy(DEFAULT_TARGET / "config.json", tmp_path / "config.json")
    (tmp_path / "model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(ConfigError, match="failed to load as a causal LM"):
        load_target(tmp_path, "cpu")


@pytest.mark.skipif(torch.cuda.is_available() and torch.cuda.device_count() > 7, reason="this machine has cuda:7")
def test_load_target_on_a_missing_device_names_it():
    with pytest.raises(ConfigError, match="cuda:7"):
        load_target(DEFAULT_TARGET, "cuda:7")


# ------------------------------------------------------------------------------------------ capture
ALL_IDS = [0, 1, 3, 5, 6, 7]


def test_capture_equals_hf_hidden_states_in_the_same_forward(tiny):
    """Hooks run during a forward that also returns hidden_states: the tensors must be the same values."""
    model, _ = tiny
    ids = tokens(23, seed=1)
    with torch.inference_mode(), LayerCapture(model, ALL_IDS) as cap:
        out = model.model(input_ids=ids, output_hidden_states=True, use_cache=False)
        parts = cap.outputs()
    assert len(out.hidden_states) == 9
    for lid, h in zip(ALL_IDS, parts):
        assert h.shape == (1, 23, 256)
        assert torch.equal(h, out.hidden_states[lid + 1]), f"layer id {lid}"
    # id L-1 is Hugging Face's normed last state; every other id is the raw residual stream
    assert not torch.equal(parts[ALL_IDS.index(6)], out.hidden_states[6])


def test_early_stop_gives_the_same_states_and_skips_the_rest(tiny):
    model, _ = tiny
    ids = tokens(17, seed=2)
    with torch.inference_mode():
        ref = model.model(input_ids=ids, output_hidden_states=True, use_cache=False).hidden_states
        calls = []
        probe = model.model.layers[4].register_forward_hook(lambda *a: calls.append(1))
        try:
            with LayerCapture(model, [3, 1], stop_after_last=True) as cap:
                with pytest.raises(StopForward):
                    model.model(input_ids=ids, use_cache=False)
                parts = cap.outputs()
        finally:
            probe.remove()
    assert calls == [], "layer 4 must not run when the deepest captured layer is 3"
    assert torch.equal(parts[0], ref[4]) and torch.equal(parts[1], ref[2])


def test_token_index_gathers_inside_the_hook(tiny):
    model, _ = tiny
    ids = tokens(12, seed=3).repeat(2, 1)
    index = torch.tensor([0, 1, 2, 12, 13])
    with torch.inference_mode():
        ref = model.model(input_ids=ids, output_hidden_states=True, use_cache=False).hidden_states
        with LayerCapture(model, [2]) as cap:
            cap.token_index = index
            model.model(input_ids=ids, use_cache=False)
            (h,) = cap.outputs()
    assert h.shape == (5, 256)
    assert torch.equal(h, ref[3].reshape(-1, 256)[index])


def test_hooks_are_removed_on_exit_even_after_an_error(tiny):
    model, _ = tiny
    layers = model.model.layers
    before = [len(layer._forward_hooks) for layer in layers] + [len(model.model.norm._forward_hooks)]
    with pytest.raises(RuntimeError, match="boom"):
        with LayerCapture(model, [0, 7]):
            raise RuntimeError("boom")
    after = [len(layer._forward_hooks) for layer in layers] + [len(model.model.norm._forward_hooks)]
    assert before == after


def test_outputs_before_a_forward_names_the_missing_ids(tiny):
    model, _ = tiny
    with LayerCapture(model, [2, 4]) as cap:
        with pytest.raises(RuntimeError, match=r"\[2, 4\] were not captured"):
            cap.outputs()


def test_capture_rejects_bad_ids(tiny):
    model, _ = tiny
    with pytest.raises(ConfigError, match=r"\[8\]"):
        LayerCapture(model, [1, 8])


# ------------------------------------------------------------------------------------------ hybrid and MoE targets
def test_a_vision_language_qwen3_5_checkpoint_loads_as_its_language_model(tmp_path):
    """Qwen3.5 publishes Qwen3_5ForConditionalGeneration checkpoints (text_config nested); specring takes them as
    targets: transformers loads the language model alone, with the full model's logits."""
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration

    from specring.shared.models.dflash import DFlashConfig
    from tests.support import tiny_target_config

    text = tiny_target_config("qwen3_5", vocab_size=512).to_dict()
    cfg = Qwen3_5Config(text_config=text, vision_config=dict(depth=1, hidden_size=16, intermediate_size=32,
                                                             num_heads=2, out_hidden_size=32),
                        tie_word_embeddings=False)
    torch.manual_seed(0)
    full = Qwen3_5ForConditionalGeneration(cfg).eval()
    full.save_pretrained(tmp_path / "q35")
    assert json.loads((tmp_path / "q35" / "config.json").read_text())["architectures"] == \
        ["Qwen3_5ForConditionalGeneration"]
    model, _ = load_target(tmp_path / "q35", "cpu", "float32")
    assert type(model).__name__ == "Qwen3_5ForCausalLM"
    ids = torch.tensor([[5, 9, 2, 7, 11, 3]])
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids).logits, full(input_ids=ids).logits)
    dcfg = DFlashConfig.from_target(tmp_path / "q35", [1, 2], mask_token_id=3)
    assert (dcfg.hidden_size, dcfg.vocab_size, dcfg.intermediate_size) == (32, 512, 64)


def test_layer_kinds_come_from_layer_types_or_the_full_attention_interval():
    from specring.shared.models.layer_ids import describe_capture, layer_kinds

    assert layer_kinds({"num_hidden_layers": 4, "layer_types": ["linear_attention"] * 3 + ["full_attention"]}) == \
        ["linear_attention"] * 3 + ["full_attention"]
    assert layer_kinds({"num_hidden_layers": 8, "full_attention_interval": 4}) == \
        (["linear_attention"] * 3 + ["full_attention"]) * 2            # Qwen3-Next's published form
    assert layer_kinds({"num_hidden_layers": 4}) is None                 # a homogeneous stack says nothing
    assert layer_kinds({"num_hidden_layers": 4, "layer_types": ["full_attention"] * 3}) is None  # inconsistent
    line = describe_capture(["linear_attention"] * 3 + ["full_attention"], [1, 3])
    assert line.startswith("hybrid stack (3 linear_attention + 1 full_attention); captured: 1 linear_attention, "
                           "3 full_attention")
    assert describe_capture(["full_attention"] * 4, [1, 2]) is None and describe_capture(None, [1]) is None


def test_a_moe_only_target_sizes_a_dense_drafter_mlp():
    """Qwen3.5-MoE publishes no dense intermediate_size; the drafter's MLP takes 3 x hidden (z-lab's
    Qwen3.6-35B-A3B-DFlash: 6144 for hidden 2048), and the raw config is left as it was."""
    from specring.shared.models.target_config import dense_intermediate_size, text_config

    raw = {"model_type": "qwen3_5_moe", "text_config": {"hidden_size": 2048, "moe_intermediate_size": 512,
                                                        "num_hidden_layers": 40}}
    assert text_config(raw)["intermediate_size"] == 6144 and "intermediate_size" not in raw["text_config"]
    assert dense_intermediate_size({"hidden_size": 2048, "intermediate_size": 5120}) == 5120   # Qwen3-Next
    assert text_config({"hidden_size": 8, "intermediate_size": 16}) == {"hidden_size": 8, "intermediate_size": 16}
