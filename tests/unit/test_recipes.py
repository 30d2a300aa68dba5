"""The recipes in configs/ (issues 17 and 24): each loads with --config and plans (--plan) against its target's
published config.json (tests/fixtures/target-configs/NAME/config.json, architecture fields only, nested under
``text_config`` where the published file nests them: Qwen3.5 and Qwen3.5-MoE are vision-language checkpoints).

The plan runs on this machine, so the test moves the recipe's processes to CPU, as many producers (each over as
many devices: ``cpu+cpu`` for a producer split over two GPUs) and consumers as the recipe has, with the dtype
"auto" gives them on CUDA (bfloat16): every other value, the layer ids, drafter size, block size, anchors and
batch size included, is the recipe's. On a hybrid stack (linear and full attention) the plan names each captured
layer's kind."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from specring.cli.flags import load_config_file
from specring.cli.train import train_main
from specring.shared.models.dflash import DFlashConfig
from specring.shared.models.hub import HUB_ID
from specring.shared.models.layer_ids import default_target_layer_ids, layer_kinds
from specring.shared.models.target_config import dense_intermediate_size
from tests.support import REPO, make_dataset

RECIPES = sorted((REPO / "configs").glob("*.toml"))
FIXTURES = REPO / "tests" / "fixtures" / "target-configs"
ARCH_KEYS = {"model_type", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
             "intermediate_size", "vocab_size", "rope_theta", "max_position_embeddings", "tie_word_embeddings"}


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    return make_dataset(tmp_path_factory.mktemp("recipes") / "d.arrow")


def test_the_recipes_named_in_the_issue_are_shipped():
    names = {p.stem for p in RECIPES}
    assert {"qwen3-0.6b", "qwen3-1.7b", "qwen3-4b", "qwen3-8b", "qwen3-14b", "qwen3-32b", "llama3.1-8b",
            "llama3.3-70b", "qwen2.5-7b", "qwen3.5-27b", "qwen3.5-35b-a3b", "qwen3-next-80b-a3b"} <= names
    assert {p.name for p in FIXTURES.iterdir()} == names  # one target config per recipe, no orphans


@pytest.mark.parametrize("recipe", RECIPES, ids=[p.stem for p in RECIPES])
def test_a_recipe_loads_and_plans_against_its_target_config(recipe, data, tmp_path, capsys):
    given = load_config_file(str(recipe))  # unknown keys are refused by name here
    target_dir = FIXTURES / recipe.stem
    raw = json.loads((target_dir / "config.json").read_text())
    arch = raw.get("text_config", raw)                  # the published file's own nesting, read as it is
    need = ARCH_KEYS - {"rope_theta", "tie_word_embeddings"} - ({"intermediate_size"} if "moe_intermediate_size"
                                                                 in arch else set())  # MoE-only: none published
    assert need <= set(arch), need - set(arch)
    assert "rope_theta" in arch or "rope_theta" in arch.get("rope_parameters", {})
    assert "tie_word_embeddings" in arch or "tie_word_embeddings" in raw
    hub = given["producer.target"]
    assert HUB_ID.match(hub) and hub in recipe.read_text().splitlines()[0], "the first line names the hub id"

    producers, consumers = given["producer.devices"], given["trainer.devices"]
    gpus = [d for group in producers for d in group.split("+")] + consumers
    assert sorted(gpus) == sorted(f"cuda:{i}" for i in range(8)), "8 GPUs, each used once"
    ids = given["producer.target_layer_ids"]
    num_layers = arch["num_hidden_layers"]
    assert ids == default_target_layer_ids(num_layers, 5), "not the reference spread (z-lab build_target_layer_ids)"
    comment = recipe.read_text()
    assert "build_target_layer_ids" in comment and "Topology" in comment and "docs/performance.md" in comment

    code = train_main(["--config", str(recipe), "--target", str(target_dir), "--data", str(data),
                       "--producers", ",".join("+".join(["cpu"] * len(g.split("+"))) for g in producers),
                       "--consumers", ",".join(["cpu"] * len(consumers)), "--dtype", "bfloat16",
                       "--run-dir", str(tmp_path / "run"), "--plan"])
    out = capsys.readouterr()
    assert code == 0, out.err
    assert f"({num_layers} layers, hidden {arch['hidden_size']})" in out.out
    assert f"target layers captured: {ids}" in out.out
    kinds = layer_kinds(arch)
    if kinds and len(set(kinds)) > 1:                   # a hybrid stack: each captured layer's kind is stated
        line = next(x for x in out.out.splitlines() if x.startswith("target layer kinds: hybrid stack"))
        assert all(f"{i} {kinds[i]}" in line for i in ids), line
        assert any(kinds[i] == "full_attention" for i in ids) and "linear_attention" in line
    else:
        assert "target layer kinds" not in out.out
    assert re.search(rf"^producers: {len(producers)} ", out.out, re.M)
    assert re.search(rf"^consumers: {len(consumers)} .*block size {given['trainer.block_size']}, anchors "
                     rf"{given['trainer.num_anchors']}", out.out, re.M)

    dcfg = DFlashConfig.from_target(target_dir, ids, block_size=given["trainer.block_size"], mask_token_id=0,
                                    num_draft_layers=given["trainer.num_draft_layers"])
    assert (dcfg.num_hidden_layers, dcfg.num_target_layers) == (given["trainer.num_draft_layers"], len(ids))
    assert (dcfg.hidden_size, dcfg.vocab_size) == (arch["hidden_size"], arch["vocab_size"])
    assert dcfg.intermediate_size == dense_intermediate_size(arch)   # 3 x hidden where the target is MoE-only
    assert dcfg.head_dim == arch.get("head_dim", arch["hidden_size"] // arch["num_attention_heads"])
