"""``launch.py regenerate`` (cli/regenerate.py, shared/data/regenerate.py): the target's own text replaces the data,
resumably."""

from __future__ import annotations

import json
import sys
import types
from pathlib import Path

import numpy as np
import pytest
import torch

from specring.cli import regenerate as regenerate_cli
from specring.shared.data import regenerate as rg
from specring.shared.data.dataset import TokenDataset
from specring.shared.data.encode import _result
from specring.shared.data.writer import ArrowSink
from tests.support import TARGET

EOS = 0


def write_arrow(path: Path, samples: list[tuple[list[int], list[int]]]) -> Path:
    sink = ArrowSink(path)
    ids = [np.asarray(i, np.int32) for i, _ in samples]
    masks = [np.asarray(m, np.uint8) for _, m in samples]
    sink.add(_result(ids, masks, [len(i) for i in ids], [0] * len(ids), list(range(len(ids))), len(ids),
                     __import__("collections").Counter(), []))
    sink.commit({"vocab_size": 8192, "pad_id": 3})
    return path


@pytest.fixture(scope="module")
def target():
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(str(TARGET), dtype=torch.float32).eval()


def greedy(target, prompt, n):
    from specring.shared.models.speculative import greedy_generate
    return greedy_generate(target, prompt, n, [EOS]).tokens


def run(tmp_path, inp, *extra) -> int:
    return regenerate_cli.main(["--target", str(TARGET), "--input", str(inp), "--output", str(tmp_path / "out.arrow"),
                    "--devices", "cpu", "--no-progress", *extra])


def test_plain_text_prompts_are_continued_by_the_targets_greedy_tokens(tmp_path, target):
    g = torch.Generator().manual_seed(0)
    text = [torch.randint(4, 8000, (40,), generator=g).tolist() for _ in range(3)]
    inp = write_arrow(tmp_path / "in.arrow", [(t, [1] * 40) for t in text])
    assert run(tmp_path, inp, "--max-new-tokens", "12", "--prefix-len", "16", "--stride", "20") == 0
    out = TokenDataset(tmp_path / "out.arrow")
    assert len(out) == 6                                   # prompts at 0 and 20 of each 40-token sample
    for k in range(6):
        ids, mask = out[k]
        s, start = divmod(k, 2)
        prompt = text[s][start * 20:start * 20 + 16]
        assert ids[:16].tolist() == prompt
        assert ids[16:].tolist() == greedy(target, prompt, 12)
        assert mask.tolist() == [0] * 16 + [1] * (len(ids) - 16)
        assert out.source(k)[1] == s                      # provenance: the input's source row
    side = json.loads((tmp_path / "out.json").read_text())
    assert side["regenerated"]["max_new_tokens"] == 12 and side["generated_tokens"] == int(sum(
        out[k][1].sum() for k in range(6)))
    assert not (tmp_path / "out.arrow.parts").exists()


def test_chat_turns_are_regenerated_in_order_with_the_new_history(tmp_path, target):
    g = torch.Generator().manual_seed(1)
    u1, a1, u2, a2 = (torch.randint(4, 8000, (n,), generator=g).tolist() for n in (10, 6, 7, 5))
    sample = (u1 + a1 + u2 + a2 + [9], [0] * 10 + [1] * 6 + [0] * 7 + [1] * 5 + [0])
    inp = write_arrow(tmp_path / "in.arrow", [sample])
    assert run(tmp_path, inp, "--max-new-tokens", "8") == 0
    ids, mask = TokenDataset(tmp_path / "out.arrow")[0]
    first = greedy(target, u1, 8)
    second = greedy(target, u1 + first + u2, 8)
    assert ids.tolist() == u1 + first + u2 + second + [9]
    assert mask.tolist() == [0] * 10 + [1] * len(first) + [0] * 7 + [1] * len(second) + [0]


def test_bad_samples_are_named_and_skipped(tmp_path, capsys):
    good = (list(range(10, 40)), [1] * 30)
    inp = write_arrow(tmp_path / "in.arrow", [good, ([5, 99999, 7], [1, 1, 1]), ([1, 2, 3], [0, 0, 0]),
                                              ([4, 5, 6, 7], [1, 0, 1, 1])])
    assert run(tmp_path, inp, "--max-new-tokens", "4", "--prefix-len", "8") == 0
    err = capsys.readouterr().err
    assert "sample 1 (source row 1): token_out_of_range" in err
    assert "sample 2 (source row 2): no_loss" in err
    assert len(TokenDataset(tmp_path / "out.arrow")) == 2  # the good one and the one whose loss starts at 0


def test_finished_shards_are_kept_and_skipped_on_rerun_and_other_arguments_refused(tmp_path, capsys):
    samples = [(list(range(10 + k, 40 + k)), [1] * 30) for k in range(4)]
    inp = write_arrow(tmp_path / "in.arrow", samples)
    args = ["--max-new-tokens", "4", "--prefix-len", "8", "--shard-size", "2"]
    parts = tmp_path / "out.arrow.parts"
    st = rg.Settings(target=str(TARGET.resolve()), input=str(inp.resolve()),
                     input_fingerprint=TokenDataset(inp).fingerprint, max_new_tokens=4, temperature=0.0,
                     prefix_len=8, stride=0, max_samples=0, include_input=False, seed=0, shard_size=2)
    rg.check_manifest(parts, st)
    marker = np.asarray([7] * 5, np.int32)  # a shard "finished before the interruption", recognisable
    rg.write_shard(parts, 0, _result([marker], [np.ones(5, np.uint8)], [5], [0], [0], 1,
                                     __import__("collections").Counter(), []), st)
    assert run(tmp_path, inp, *args, "--max-new-tokens", "5") == 2
    assert "max_new_tokens" in capsys.readouterr().err
    assert run(tmp_path, inp, *args) == 0
    assert "1 already done" in capsys.readouterr().err
    out = TokenDataset(tmp_path / "out.arrow")
    assert out[0][0].tolist() == marker.tolist() and len(out) == 3


def test_include_input_appends_the_input_unchanged(tmp_path):
    samples = [(list(range(10 + k, 40 + k)), [1] * 30) for k in range(2)]
    inp = write_arrow(tmp_path / "in.arrow", samples)
    assert run(tmp_path, inp, "--max-new-tokens", "4", "--prefix-len", "8", "--include-input") == 0
    out = TokenDataset(tmp_path / "out.arrow")
    assert len(out) == 4 and [out[k][0].tolist() for k in (2, 3)] == [s[0] for s in samples]


def test_bad_flags_are_named(tmp_path, capsys):
    inp = write_arrow(tmp_path / "in.arrow", [(list(range(10, 40)), [1] * 30)])
    with pytest.raises(SystemExit) as e:  # not a finite number: refused while parsing
        run(tmp_path, inp, "--temperature", "nan")
    assert e.value.code == 2 and "argument --temperature: expected a finite number" in capsys.readouterr().err
    assert run(tmp_path, inp, "--temperature", "-1") == 2  # out of the declared range
    assert "--temperature: must be >= 0" in capsys.readouterr().err
    import importlib.util
    if importlib.util.find_spec("vllm") is None:
        assert run(tmp_path, inp, "--backend", "vllm") == 2
        assert "pip install vllm" in capsys.readouterr().err
    assert run(tmp_path, tmp_path / "missing.arrow") == 2


def test_vllm_backend_sends_token_prompts_and_cuts_at_stop(monkeypatch):
    """The vLLM path as its offline API is called (module faked: vLLM is not installed here)."""
    calls = {}

    class Out:
        def __init__(self, ids):
            self.outputs = [types.SimpleNamespace(token_ids=ids)]

    class LLM:
        def __init__(self, **kw):
            calls["init"] = kw

        def generate(self, prompts, params, use_tqdm=False):
            calls["prompts"], calls["params"] = prompts, params
            return [Out([5, 6, EOS, 8]), Out([9, 9, 9, 9, 9])]

    class SamplingParams:
        def __init__(self, **kw):
            self.kw = kw

    monkeypatch.setitem(sys.modules, "vllm", types.SimpleNamespace(LLM=LLM, SamplingParams=SamplingParams))
    be = rg.VllmBackend(str(TARGET), "cuda:0", "auto")
    got = be.generate([[1, 2], [3]], 4, 0.0, [EOS], 3, seed=0)
    assert got == [[5, 6, EOS], [9, 9, 9, 9]]
    assert calls["prompts"] == [{"prompt_token_ids": [1, 2]}, {"prompt_token_ids": [3]}]
    assert calls["params"].kw["max_tokens"] == 4 and calls["params"].kw["stop_token_ids"] == [EOS]
    assert calls["init"]["model"] == str(TARGET) and calls["init"]["skip_tokenizer_init"]


def test_the_static_cache_generates_what_the_dynamic_cache_does_in_float32():
    """Greedy continuations of prompts of unequal lengths (left-padded, the static form to a power of two) are the
    same with transformers' StaticCache as with its DynamicCache; a cache name outside CACHES is refused."""
    from tests.support import stdlib_prompts
    prompts = stdlib_prompts(["difflib.py", "difflib.py", "difflib.py"], 40, [17, 70, 33])
    stop_ids, pad_id = rg.stop_and_pad_ids(str(TARGET))
    out = {}
    for cache, batch in (("dynamic", 2), ("static", 4)):  # static: one batch of 3 prompts + a filler row
        be = rg.TransformersBackend(str(TARGET), "cpu", "float32", batch, cache=cache)
        assert be.cache == cache
        out[cache] = be.generate(prompts, 12, 0.0, stop_ids, pad_id, seed=0)
    assert all(len(g) > 0 for g in out["dynamic"]), out
    assert out["static"] == out["dynamic"]
    assert rg.TransformersBackend(str(TARGET), "cpu", "float32", 2).cache == "dynamic"  # auto on CPU
    assert [rg.static_rows(n, 1024) for n in (1, 2, 3, 600, 1024)] == [1, 2, 4, 1024, 1024]
    with pytest.raises(ValueError, match="cache: must be one of"):
        rg.TransformersBackend(str(TARGET), "cpu", "float32", 2, cache="paged")
