"""A target split over a producer's device group (``--producers cpu+cpu``, ``cuda:0+cuda:1``).

On CPU the group's devices are all ``cpu``, so what is checked here is what can be: the group parser, the
explicit device map (layers spread over the group, computed on a ``meta`` model with CUDA device names, which
needs no GPU), that the loaded model sits where its map says (and that a misplaced module is caught), and that a
producer over the split target writes the same slot as one over a single device. Moving activations between
distinct devices (accelerate's hooks, installed by transformers) needs several GPUs and is not exercised here.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from specring.producers.producer import Producer
from specring.shared.config.run_config import DEFAULT_TARGET, ProducerConfig
from specring.shared.errors import ConfigError
from specring.shared.machine.device_groups import group_members, is_cpu_group
from specring.shared.machine.devices import resolve_device_group
from specring.shared.models.target import (
    check_checkpoint,
    check_placement,
    layer_device_map,
    load_target,
    meta_model,
)
from specring.shared.transport import layout, messages
from tests.support import temp_ring
from tests.unit.test_producer import make_batch, sequences


@pytest.fixture
def slot_ring():
    with temp_ring(2, 1 << 22) as r:
        yield r


def test_device_groups_are_parsed_and_bad_ones_named():
    assert resolve_device_group("cpu") == [torch.device("cpu")]
    assert resolve_device_group("cpu+cpu") == [torch.device("cpu")] * 2
    assert group_members(" cuda:0 + cuda:1 ") == ["cuda:0", "cuda:1"]
    assert is_cpu_group("cpu") and is_cpu_group(" cpu + cpu ")
    assert not is_cpu_group("cpu+cuda:0") and not is_cpu_group("cpu+") and not is_cpu_group("cuda:0")
    with pytest.raises(ConfigError, match=r"'cpu\+' has an empty member"):
        resolve_device_group("cpu+")
    with pytest.raises(ConfigError, match="'tpu:0' is not understood"):
        resolve_device_group("cpu+tpu:0")
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="'cuda:0' does not exist"):
            resolve_device_group("cpu+cuda:0")


def test_layer_device_map_spreads_the_layers_over_the_group():
    meta = meta_model(check_checkpoint(DEFAULT_TARGET))  # 8 layers, tied embedding and LM head
    two = layer_device_map(meta, ["cuda:0", "cuda:1"])
    assert [two[f"model.layers.{i}"] for i in range(8)] == ["cuda:0"] * 4 + ["cuda:1"] * 4
    assert two["model.embed_tokens"] == "cuda:0" and two["model.rotary_emb"] == "cuda:0"
    assert two["model.norm"] == "cuda:1"
    assert two["lm_head"] == "cuda:0", "a tied LM head stays with the embedding it shares its weight with"
    three = layer_device_map(meta, ["cuda:0", "cuda:1", "cuda:2"])
    assert [three[f"model.layers.{i}"][-1] for i in range(8)] == list("00011122")
    # the map covers every parameter of the model exactly once
    covered = [n for n, _ in meta.named_parameters() if any(n == k or n.startswith(k + ".") for k in two)]
    assert covered == [n for n, _ in meta.named_parameters()]


def test_an_untied_lm_head_goes_to_the_last_device(tmp_path):
    d = tmp_path / "untied"
    shutil.copytree(DEFAULT_TARGET, d)
    cfg = json.loads((d / "config.json").read_text())
    cfg["tie_word_embeddings"] = False
    (d / "config.json").write_text(json.dumps(cfg))
    dmap = layer_device_map(meta_model(check_checkpoint(d)), ["cuda:0", "cuda:1"])
    assert dmap["lm_head"] == "cuda:1" and dmap["model.embed_tokens"] == "cuda:0"


def test_a_split_target_sits_where_its_map_says_and_a_misplaced_module_is_named():
    model, cfg = load_target(DEFAULT_TARGET, "cpu+cpu")
    assert model.hf_device_map == layer_device_map(meta_model(cfg), ["cpu", "cpu"])
    check_placement(model, model.hf_device_map)
    model.model.layers[5].to("meta")  # as if the loader had put layer 5 somewhere else
    with pytest.raises(ConfigError, match=r"model\.layers\.5\..* is on meta, its device map says cpu"):
        check_placement(model, model.hf_device_map)


@pytest.mark.parametrize("label_source", ["data", "target"])
def test_a_producer_over_a_device_group_writes_the_slot_of_a_single_device(slot_ring, label_source):
    batch = make_batch(sequences([9, 23, 4]), pad_to=24, batch_id=7)
    slots = []
    for slot, devices in enumerate((["cpu"], ["cpu+cpu"])):
        cfg = ProducerConfig(target=str(DEFAULT_TARGET), devices=devices, target_layer_ids=[1, 4, 7])
        p = Producer.from_config(cfg, 0, slot_ring, generation=1, label_source=label_source,
                                 topk=4 if label_source == "target" else 0)
        if devices == ["cpu+cpu"]:
            assert p.model.hf_device_map["model.layers.0"] == "cpu" and len(p.model.hf_device_map) == 12
        msg = p.run_batch(batch, slot=slot, seq=0)
        assert isinstance(msg, messages.SlotReady), msg
        slots.append({k: v.clone() for k, v in layout.read_tensors(slot_ring.payload(slot), msg.descriptor).items()})
    single, split = slots
    assert single.keys() == split.keys()
    assert ("target_ids" in split) == (label_source == "target")
    for k in single:
        assert torch.equal(single[k], split[k]), k
