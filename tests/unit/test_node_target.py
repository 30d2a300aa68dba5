"""Several nodes must run one target (issue 27, kind 1): the target compared by content, cheaply
(``shared.models.fingerprint``), in the plan every node's supervisor checks at the rendezvous (``supervisor.nodes``),
and ``restart producer N`` of another node's producer passed to that node, or answered with the owning node."""

from __future__ import annotations

import json
import shutil
from types import SimpleNamespace

import torch
from safetensors.torch import load_file, save_file

from specring.shared.models.fingerprint import target_fingerprint
from specring.shared.transport import messages as m
from specring.supervisor import nodes
from specring.supervisor.nodes import NodeTopology, plan_differences
from tests.support import TARGET


def perturbed_copy(dst, scale: float = 0.05):
    """A copy of the fixture target whose weights differ in one tensor, as a fine-tune of one layer's would (same
    names, shapes and file sizes: only the content)."""
    shutil.copytree(TARGET, dst)
    shard = sorted(dst.glob("model-*.safetensors"))[-1]
    tensors = load_file(str(shard))
    name = sorted(k for k in tensors if k.endswith("v_proj.weight"))[-1]
    tensors[name] = tensors[name] + scale * torch.ones_like(tensors[name])   # visible in bfloat16
    save_file(tensors, str(shard), metadata={"format": "pt"})
    return dst


def test_the_fingerprint_is_by_content_not_by_path(tmp_path):
    base = target_fingerprint(TARGET)
    copy = shutil.copytree(TARGET, tmp_path / "copy")
    cfg = json.loads((copy / "config.json").read_text())
    cfg.update(_name_or_path="/somewhere/else", transformers_version="9.9.9")   # a re-save elsewhere
    (copy / "config.json").write_text(json.dumps(cfg, indent=4))
    assert target_fingerprint(copy) == base
    other = target_fingerprint(perturbed_copy(tmp_path / "tuned"))
    assert other["target weights"] != base["target weights"]
    assert other["target config"] == base["target config"] and other["tokenizer"] == base["tokenizer"]
    tok = shutil.copytree(TARGET, tmp_path / "tok")
    t = json.loads((tok / "tokenizer_config.json").read_text())
    t["eos_token"] = "<|endoftext|>" if t.get("eos_token") != "<|endoftext|>" else "<|im_end|>"
    (tok / "tokenizer_config.json").write_text(json.dumps(t))
    assert target_fingerprint(tok)["tokenizer"] != base["tokenizer"]


def _cfg(target, random_weights=False):
    from specring.shared.config.run_config import ProducerConfig, TrainerConfig
    return SimpleNamespace(producer=ProducerConfig(target=str(target), devices=["cpu"], random_weights=random_weights),
                           trainer=TrainerConfig(devices=["cpu"]))


def test_the_plan_names_another_target_tokenizer_or_capture(tmp_path):
    plan = SimpleNamespace(order=[SimpleNamespace(batch_id=1)], data_digest="d", slot_bytes=4096,
                           target_layer_ids=[1, 5], total_steps=1)
    base = nodes.plan_record(_cfg(TARGET), plan)
    assert plan_differences(base, nodes.plan_record(_cfg(shutil.copytree(TARGET, tmp_path / "copy")), plan)) == []
    diff = plan_differences(base, nodes.plan_record(_cfg(perturbed_copy(tmp_path / "tuned"), True), plan))
    assert diff == ["producer.random_weights", "target weights"], diff
    assert "target weights (the target checkpoints' weights differ (compared by content" in \
        nodes.explain_differences(diff)


def _dispatcher(rank: int, sent: list):
    """``MessageDispatch`` over stubs: a two-node topology (node 0: producer 0, node 1: producers 1 and 2
    globally, 0 and 1 locally), a link that records what it sends, local producers that are alive."""
    from specring.supervisor.context import RunContext
    from specring.supervisor.dispatch import MessageDispatch
    from specring.supervisor.monitor import Child

    topo = NodeTopology(2, rank, [1, 2], [1, 1], "127.0.0.1:1", "p/", "/tmp/ckpt")
    producers = [Child("producer", i) for i in range(topo.producers[rank])]
    for c in producers:
        c.alive = lambda: True
    context = RunContext(cfg=None, plan=None, run_dir=None, run_id="r", monitor=None, producers=producers,
                         consumers=[], balance={}, coordinator=SimpleNamespace(generation=lambda role, index: 1))
    nodes = SimpleNamespace(topo=topo, relay=None if rank == 0 else object(), dead_nodes=set(),
                            link=SimpleNamespace(send=lambda msg, to=None: sent.append((to, msg)) or True))
    d = MessageDispatch(context, nodes, records=None)
    d.send = lambda role, index, msg: sent.append(("child", role, index, msg)) or True
    return d, nodes


def test_restart_of_another_nodes_producer_is_passed_to_its_node():
    sent = []
    d0, nodes0 = _dispatcher(0, sent)
    reply = d0._restart_elsewhere(2)
    assert reply.ok and reply.text.startswith("producer 2 is producer 1 of node 1: restart passed to node 1"), reply
    assert sent == [(1, m.NodeMsg(node=0, event="restart", role="producer", index=2))]
    assert not d0._restart_elsewhere(3).ok and "producers 0..2" in d0._restart_elsewhere(3).text
    nodes0.dead_nodes.add(1)
    r = d0._restart_elsewhere(1)
    assert not r.ok and "run `launch.py restart producer 0` on node 1" in r.text, r

    sent.clear()   # node 1 takes it: its local producer 1 restarts gracefully
    d1, _ = _dispatcher(1, sent)
    ok, text = d1.restart_producer(1)
    assert ok and d1.context.producers[1].graceful_restart and sent[-1][:3] == ("child", "producer", 1)
    assert isinstance(sent[-1][3], m.Shutdown) and sent[-1][3].reason == "restart requested"
    r = d1._restart_elsewhere(2)
    assert not r.ok and "node 1 has producers 0..1 (local indices)" in r.text, r
