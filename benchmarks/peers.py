"""The peers on the same GPU, side by side (issue 23, item 5): NVIDIA Model-Optimizer's and vllm-project/speculators'
DFlash trainers, installed from PyPI, trained on the fixture target from the same data for the same wall-clock
minutes as specring's recipe, their drafters measured by specring's own ``launch.py eval`` in the standard setting.

What one ``run`` does, per peer (``--peers``, default both), in a child process of its own (a peer that fails to
install, import or train cannot take the others down, and its GPU memory is freed):

* ``modelopt`` (nvidia-modelopt 0.47.0, online DFlash: the target and the drafter in one process under
  transformers): the target is loaded with ``AutoModelForCausalLM.from_pretrained``; the built-in recipe
  ``general/speculative_decoding/dflash`` (``modelopt.recipe.load_recipe``, file
  ``modelopt_recipes/general/speculative_decoding/dflash.yaml`` of the wheel) with the overrides below gives the
  DFlash config, ``modelopt.torch.speculative.convert(model, [("dflash", cfg)])`` makes the model
  ``HFDFlashModel`` (``modelopt/torch/speculative/plugins/hf_dflash.py``: its ``forward`` in training mode runs the
  frozen target with ``output_hidden_states``, samples anchors and returns the DFlash loss), ``transformers.Trainer``
  trains it with the recipe's ``training`` section (lr 6e-4, 100 warm-up steps, linear decay, weight decay 0, bf16),
  as the repository's ``examples/speculative_decoding/main.py`` does, and
  ``modelopt.torch.export.export_speculative_decoding`` (``modelopt/torch/export/unified_export_hf.py``,
  ``DFlashExporter`` in ``plugins/hf_spec_export.py``) writes the z-lab format. Batches: specring's own batch plan
  (``shared.data.dataset.BatchPlan``, ``--max-tokens`` padded tokens per batch, padded to a multiple of
  ``--block-size``: the forward requires it), labels = the tokens where ``loss_mask`` is 1, else -100. The draft's
  ``intermediate_size``/heads/``head_dim`` are passed as the target's: ``HFDFlashModel.modify`` means to inherit them
  when unset, but the ``Qwen3Config`` it builds first fills transformers' defaults (seen here: 22,016 and 32 heads of
  128, a 106 M-parameter draft for the 8.4 M fixture). Its loss is the recipe's (self-logit distillation, D-PACE
  weights: the config's default objective, so the recipe's ``dflash_loss_decay_factor`` is ignored, as it says).
* ``speculators`` (speculators 0.9.0 + hs-connectors 0.9.0, its DFlash trainer from hidden states captured without
  vLLM): specring captures the target's hidden states with transformers (``shared.models.target.LayerCapture``, the
  target in bf16 on the GPU) and writes them in speculators' offline format: a ``datasets`` directory with
  ``input_ids``/``loss_mask``/``seq_len`` (torch format) and ``hidden_states/hs_{i}.safetensors`` with
  ``hidden_states [seq, n + 1, H]`` (the ``n`` captured layers, then the last layer's raw output, which speculators
  normalises itself) and ``token_ids`` (``speculators/train/data.py`` ``ArrowDataset``,
  ``hs_connectors/transfer.py`` ``FileTransfer``). Then ``speculators.train.cli.main(TrainConfig.resolve(argv))``,
  what ``speculators train`` runs (``speculators/cli/train.py``), with ``--speculator-type dflash``, speculators'
  own defaults otherwise (Muon, lr 1e-3, linear schedule, 90/10 train/validation split, a checkpoint per epoch).
  Layer ids: speculators counts a layer's *input* (``speculators/convert/dflash/converter.py``: z-lab id ``i`` is
  speculators id ``i + 1``), so ``--target-layers 1,3,5,6,7`` is ``--target-layer-ids 2 4 6 7 8``. The wall-clock
  stop: ``speculators.train.cli.Trainer`` is replaced by a subclass whose ``train_epoch`` passes a
  ``step_callback`` (a parameter of ``speculators.train.trainer.Trainer.train_epoch``) that raises speculators' own
  ``TrainingInterruptedError`` at the deadline or at ``--max-steps``; speculators then saves its ``interrupted``
  checkpoint (``speculators/train/graceful_shutdown.py``), which is converted.

Both drafters are written as a specring DFlash export (``shared/drafters/dflash_export.py``: ``config.json`` from
``exported_config``, the weights under the reference names, checked by ``DFlashDrafter.load_trainable``), so
``launch.py eval --drafter DIR`` loads them (``family_of_export``: ``DFlashDraftModel``; a speculators checkpoint,
``DFlashSpeculator``, would not load as it is, and a z-lab export needs specring's ``specring_export.json``). The
raw peer outputs stay beside it (``WORK/PEER/raw``).

The same for every row (the recipe's, docs/evaluation.md): fixture target, ``--data`` (default
``data/demo/regen.arrow``, else ``data/demo/train.arrow``), 5 draft layers, B = 16, target layers 1,3,5,6,7, 512
anchors, 8,192 tokens per batch, at most 3,200 steps (the recipe's schedule: the peers' learning-rate schedules
decay over it), the same mask token (``shared.models.dflash.resolve_mask_token_id``), and ``--minutes`` of wall clock
from the peer's launch to its last step (imports, loads and speculators' capture included, as specring's recipe
counts from launch). Export and evaluation are outside the budget. ``target_tokens_per_s`` is the tokens of target
features trained on per second of that wall clock (speculators: its capture included), like ``summary.json``'s
``tokens_per_s`` of a specring run.

Output, one line per row, then a table::

    peer=specring tau=X tau_pooled=Y target_tokens_per_s=Z minutes=M steps=N
    peer=modelopt tau=X tau_pooled=Y target_tokens_per_s=Z minutes=M steps=N ...
    peer=speculators status=unavailable reason="..."

A peer that cannot install, import, train or be measured prints ``status=unavailable`` with the exception text and
the stage it failed in; the script goes on with the next. Each row is also appended to ``--results`` (JSON lines)
and the table is of every row there (the latest per peer), so peers run in separate device calls print one table.

Commands::

    python benchmarks/peers.py download-wheels          # on a machine with PyPI: the wheels below into .whl/
    # on the GPU machine (no index): the wheels into /tmp/site, as benchmarks/gpu_session.sh installs them
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
    PYTHONPATH=/tmp/site python3 benchmarks/peers.py run --minutes 5.6 --specring-run runs/final
    # the GPU script's step (the device call carries .whl, 25 MiB), one peer per 10-minute call on the warm machine,
    # after regen, final and final_eval (for the specring row):
    OUT=/tmp/out PEERS=modelopt bash benchmarks/gpu_drafter.sh peers
    OUT=/tmp/out PEERS=speculators bash benchmarks/gpu_drafter.sh peers      # prints the table of both
    # CPU, to exercise the code path (a small slice of the demo corpus, a short budget, small batches):
    python benchmarks/peers.py run --device cpu --minutes 1.5 --max-samples 32 --max-steps 10 --num-anchors 32 \\
        --max-tokens 2048 --num-prompts 2 --prompt-len 64 --max-new-tokens 16 --data data/demo/train.arrow

``--parallel`` trains the peers side by side on the one device (each with the same deadline; rows say so).

On CPU (2 cores, torch 2.13 CPU, transformers 5.17, the wheels' versions in a venv; the command above with
``--specring-run`` a 20-step CPU run): every stage ran for both peers (modelopt 10 steps; speculators 2 to 10 steps,
then its ``interrupted`` checkpoint converted), τ 1.000 for every row after so few steps. speculators' Trainer needs
an accelerator, so on CPU only three shims are applied (recorded as ``cpu_shims`` in its ``result.json``): the model
goes to ``"cpu"`` instead of accelerator index 0 (``Trainer.setup_model``), ``torch.accelerator.synchronize`` is a
no-op (its step timer: "RuntimeError: Cannot access accelerator device when none is available"), and
``--loss-implementation eager`` ("Fused losses require Triton"). None of them is applied on CUDA. With the GPU
defaults (512 anchors, 8,192 tokens per batch) modelopt's online forward took 24 GiB on CPU and was killed: on CPU
pass small ``--num-anchors``/``--max-tokens``.

Wheels (``download-wheels``; python 3.12 manylinux x86_64, 25 MiB; the GPU image has torch 2.11, transformers 5.17,
accelerate, numpy, pandas, pyarrow, fsspec, requests, aiohttp, httpx, anyio, rich, typer, click, scipy, ninja,
nvidia-ml-py, regex, pyyaml, safetensors, tqdm): nvidia-modelopt 0.47.0 (its ``[hf]`` extra pins
transformers < 5.15; it imports under 5.17 with a warning, "transformers 5.17.0 is not tested"), speculators 0.9.0
(transformers >= 5.0, <= 5.19; torch <= 2.14.1; torchvision and torchaudio are in its requirements, the GPU image has
both, nothing of the training path imports them), hs-connectors 0.9.0, datasets 5.1.0, dill 0.4.1, multiprocess
0.70.19, openai 2.54.0 (speculators imports it in ``train/data.py``; 2.x uses httpx, 3.x needs httpx2), distro 1.9.0,
jiter 0.19.0, sniffio 1.3.1, pydantic 2.14.4, pydantic-core 2.50.5, pydantic-settings 2.16.3, python-dotenv 1.2.4,
annotated-types 0.8.0, typing-inspection 0.4.5, typing-extensions 4.16.0, loguru 0.7.3, omegaconf 2.4.0, pulp 3.3.2
(``modelopt.torch.opt.searcher`` imports it), pyzmq 27.3.0 (specring's own transport).

Sources read for the APIs called (PyPI wheels, the versions above): nvidia-modelopt
``modelopt/torch/speculative/{config.py,plugins/hf_dflash.py,plugins/modeling_dflash.py,dflash/conversion.py}``,
``modelopt/recipe/{loader.py,config.py}``, ``modelopt/torch/export/{unified_export_hf.py,plugins/hf_spec_export.py}``
and NVIDIA/Model-Optimizer ``examples/speculative_decoding/{main.py,scripts/export_hf_checkpoint.py}``; speculators
``speculators/train/{cli.py,trainer.py,data.py,dataloader.py,graceful_shutdown.py,config/schema.py}``,
``speculators/models/dflash/{core.py,config.py}``, ``speculators/convert/dflash/converter.py``,
``speculators/data_generation/offline.py`` and hs-connectors ``hs_connectors/transfer.py``. No code of theirs is
copied here.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

PEERS = ("modelopt", "speculators")
TARGET = ROOT / "assets" / "tiny-code-lm"
# the wheels for the GPU machine (cp312, manylinux x86_64 or pure python; multiprocess has one per python version)
WHEELS = ["nvidia-modelopt==0.47.0", "speculators==0.9.0", "hs-connectors==0.9.0", "datasets==5.1.0", "dill==0.4.1",
          "multiprocess==0.70.19", "openai==2.54.0", "distro==1.9.0", "jiter==0.19.0", "sniffio==1.3.1",
          "pydantic==2.14.4", "pydantic-core==2.50.5", "pydantic-settings==2.16.3", "python-dotenv==1.2.4",
          "annotated-types==0.8.0", "typing-inspection==0.4.5", "typing-extensions==4.16.0", "loguru==0.7.3",
          "omegaconf==2.4.0", "pulp==3.3.2", "pyzmq==27.3.0"]
PLATFORMS = ["manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_26_x86_64", "manylinux_2_17_x86_64",
             "manylinux2014_x86_64", "any"]


# ------------------------------------------------------------------------------------------------ common
def one_line(e: BaseException) -> str:
    """``Type: message`` on one line (what a ``status=unavailable`` row says)."""
    msg = " ".join(str(e).split()) or repr(e)
    return f"{type(e).__name__}: {msg}"[:600]


def default_data() -> Path:
    regen = ROOT / "data" / "demo" / "regen.arrow"
    return regen if regen.is_file() else ROOT / "data" / "demo" / "train.arrow"


def resolve_device(device: str) -> str:
    import torch
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return device


def layer_ids(text: str) -> list[int]:
    return [int(x) for x in str(text).split(",") if x.strip()]


def load_samples(path: Path, max_samples: int | None):
    """``(dataset, rows)``: specring's ``TokenDataset`` of ``path`` and the row indices used (the first
    ``max_samples``, or all)."""
    from specring.shared.data.dataset import TokenDataset
    ds = TokenDataset(path)
    n = len(ds) if not max_samples else min(len(ds), int(max_samples))
    return ds, list(range(n))


# ------------------------------------------------------------------------------------------------ export
def write_specring_export(zcfg: dict, tensors: dict, target: Path, out: Path, dtype: str, source: dict) -> Path:
    """A specring DFlash export at ``out`` from a z-lab-style config dict and weights under the reference names
    (the serving format of ``shared/drafters/dflash_export.py``). Raises ``ValueError`` naming missing or
    unexpected tensors (``DFlashDrafter.load_trainable``)."""
    from specring.shared.drafters.dflash_export import (
        MODELING_FILE,
        config_from_exported,
        exported_config,
        reference_weight_names,
    )
    from specring.shared.drafters.dflash_hf_model import modeling_source
    from specring.shared.drafters.serving_format import CONFIG_FILE, PROVENANCE_FILE, write_export_dir
    from specring.shared.machine.devices import MODEL_DTYPES
    from specring.shared.models.dflash import DFlashDrafter
    from specring.shared.models.target_config import read_target_config, text_config

    target_raw = read_target_config(target)
    dcfg = config_from_exported(zcfg)
    dcfg.tie_word_embeddings = bool(text_config(target_raw).get("tie_word_embeddings", False))
    names = reference_weight_names(dcfg.num_hidden_layers)
    dropped = sorted(set(tensors) - names)
    weights = {k: v for k, v in tensors.items() if k in names}
    drafter = DFlashDrafter(dcfg)
    drafter.load_trainable(weights, source.get("checkpoint", "peer checkpoint"))  # names and shapes checked
    drafter.load_target_head(target)
    out_w = {k: v.detach().to(MODEL_DTYPES[dtype]).contiguous().cpu() for k, v in weights.items()}
    cfg = exported_config(dcfg, target_raw, dtype, None)
    prov = {"exported_by": "benchmarks/peers.py", "target": str(Path(target).resolve()), "dtype": dtype,
            "dropped_tensors": dropped, **source}
    texts = {CONFIG_FILE: json.dumps(cfg, indent=2) + "\n", MODELING_FILE: modeling_source(),
             PROVENANCE_FILE: json.dumps(prov, indent=2) + "\n"}
    return write_export_dir(out, out_w, texts)


# ------------------------------------------------------------------------------------------------ modelopt
def train_modelopt(a: argparse.Namespace, out: Path, res: dict) -> None:
    """Model-Optimizer's online DFlash training (see the module docstring); fills ``res``."""
    res["stage"] = "import"
    import modelopt.torch.speculative as mtsp
    import torch
    import transformers
    from modelopt.recipe import load_recipe
    from modelopt.torch.export import export_speculative_decoding
    from transformers import AutoModelForCausalLM, Trainer, TrainerCallback, TrainingArguments

    from specring.shared.data.dataset import BatchPlan, collate
    from specring.shared.models.dflash import resolve_mask_token_id
    from specring.shared.models.target_config import read_target_config, text_config
    res["versions"] = {"modelopt": _version("nvidia-modelopt"), "transformers": transformers.__version__,
                       "torch": torch.__version__}
    res["stage"] = "train"
    cuda = a.device.startswith("cuda")
    target = Path(a.target)
    mask = resolve_mask_token_id(target)
    ids = layer_ids(a.target_layers)
    overrides = [f"model.model_name_or_path={target}", f"data.data_path={a.data}", f"training.output_dir={out / 'hf'}",
                 f"dflash.dflash_block_size={a.block_size}", f"dflash.dflash_num_anchors={a.num_anchors}",
                 f"dflash.dflash_mask_token_id={mask}",
                 f"dflash.dflash_architecture_config.num_hidden_layers={a.num_draft_layers}",
                 f"dflash.dflash_architecture_config.target_layer_ids=[{','.join(map(str, ids))}]"]
    # the draft's shape as the target's (HFDFlashModel.modify means to inherit these when unset, but the Qwen3Config
    # it builds first fills transformers' defaults, 22016 / 32 heads of 128, so they are set here, as specring does)
    tcfg = text_config(read_target_config(target))
    for key in ("intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim"):
        if tcfg.get(key) is not None:
            overrides.append(f"dflash.dflash_architecture_config.{key}={int(tcfg[key])}")
    recipe = load_recipe("general/speculative_decoding/dflash", overrides=overrides)
    dflash_cfg = recipe.dflash.model_dump()
    res["recipe"] = {k: dflash_cfg[k] for k in ("dflash_block_size", "dflash_num_anchors", "dflash_loss_objective",
                                                  "dflash_self_logit_distillation", "dflash_use_torch_compile",
                                                  "dflash_mask_token_id", "dflash_architecture_config")}
    dtype = torch.bfloat16 if cuda else torch.float32
    model = AutoModelForCausalLM.from_pretrained(target, dtype=dtype, use_safetensors=True)
    mtsp.convert(model, [("dflash", dflash_cfg)])

    ds, rows = load_samples(Path(a.data), a.max_samples)
    lengths = [int(ds.lengths[r]) for r in rows]
    plan = BatchPlan(lengths, max_tokens=a.max_tokens, max_batch_size=64, seed=0, fingerprint=ds.fingerprint)
    batches, epoch = [], 0
    while len(batches) < a.max_steps:
        batches += plan.epoch(epoch)
        epoch += 1
    batches = batches[:a.max_steps]
    pad_id = int(getattr(model.config, "pad_token_id", None) or 0)
    bsz = a.block_size

    class Batches(torch.utils.data.Dataset):  # one item = one batch of the plan (per_device_train_batch_size 1)
        def __len__(self):
            return len(batches)

        def __getitem__(self, i):
            b = batches[i]
            pad_to = int(math.ceil(b.pad_to / bsz) * bsz)
            x, attn, lm, _ = collate(ds, [rows[s] for s in b.sample_ids], pad_to, pad_id)
            labels = x.masked_fill(lm == 0, -100)
            return {"input_ids": x, "attention_mask": attn, "labels": labels}

    tr = recipe.training.model_dump()
    known = set(TrainingArguments.__dataclass_fields__)
    kw = {k: v for k, v in tr.items() if k in known and v is not None}
    kw.update(output_dir=str(out / "hf"), max_steps=len(batches), per_device_train_batch_size=1,
              save_strategy="no", report_to="none", logging_steps=50, disable_tqdm=True, do_eval=False,
              dataloader_num_workers=0, dataloader_drop_last=False, remove_unused_columns=False, seed=0)
    if a.lr is not None:
        kw["learning_rate"] = a.lr
    if not cuda:
        kw.update(bf16=False, tf32=False, use_cpu=True)
    res["training_args"] = {k: kw.get(k) for k in ("learning_rate", "warmup_steps", "lr_scheduler_type",
                                                   "weight_decay", "bf16", "max_steps")}
    counted = {"tokens": torch.zeros((), dtype=torch.long), "steps": 0}

    def count(module, args, kwargs):
        if module.training and kwargs.get("attention_mask") is not None:
            am = kwargs["attention_mask"]
            counted["tokens"] = counted["tokens"].to(am.device) + am.sum()

    model.register_forward_pre_hook(count, with_kwargs=True)
    deadline = float(a.deadline)

    class Budget(TrainerCallback):
        def on_step_end(self, args, state, control, **kw):
            counted["steps"] = state.global_step
            if counted.get("first_step_at") is None:
                counted["first_step_at"] = time.time()
            if time.time() >= deadline:
                control.should_training_stop = True
            return control

    trainer = Trainer(model=model, args=TrainingArguments(**kw), train_dataset=Batches(),
                      data_collator=lambda items: items[0], callbacks=[Budget()])
    trainer.train()
    res.update(train_end=time.time(), steps=int(counted["steps"]), tokens=int(counted["tokens"].item()),
               first_step_at=counted.get("first_step_at"), planned_steps=len(batches))
    res["stage"] = "export"
    raw = out / "raw"
    shutil.rmtree(raw, ignore_errors=True)
    model.eval()
    with torch.inference_mode():
        export_speculative_decoding(model, export_dir=raw)
    zcfg = json.loads((raw / "config.json").read_text())
    from safetensors.torch import load_file
    tensors = load_file(str(raw / "model.safetensors"))
    write_specring_export(zcfg, tensors, target, out / "export", a.export_dtype,
                          {"peer": "modelopt", "checkpoint": str(raw), "steps": res["steps"]})
    res["export"] = str(out / "export")


# ------------------------------------------------------------------------------------------------ speculators
def capture_for_speculators(a: argparse.Namespace, data_dir: Path, hs_dir: Path, res: dict) -> None:
    """Write speculators' offline training data from hidden states specring captures with transformers."""
    from concurrent.futures import ThreadPoolExecutor

    import torch
    from datasets import Dataset
    from safetensors.torch import save_file

    from specring.shared.models.target import LayerCapture, base_model, decoder_layers, load_target

    ds, rows = load_samples(Path(a.data), a.max_samples)
    cols = {"input_ids": [], "loss_mask": [], "seq_len": []}
    for r in rows:
        x, m = ds[r]
        cols["input_ids"].append([int(t) for t in x])
        cols["loss_mask"].append([int(t) for t in m])
        cols["seq_len"].append(len(x))
    hf = Dataset.from_dict(cols)
    hf.set_format(type="torch")
    shutil.rmtree(data_dir, ignore_errors=True)
    hf.save_to_disk(str(data_dir))
    hs_dir.mkdir(parents=True, exist_ok=True)
    (data_dir / "hidden_states").symlink_to(hs_dir, target_is_directory=True)
    cuda = a.device.startswith("cuda")
    model, _ = load_target(a.target, a.device, "bfloat16" if cuda else "float32")
    ids = layer_ids(a.target_layers)
    last = decoder_layers(model)[-1]
    raw_last: dict = {}

    def keep_last(_m, _i, output):
        raw_last["h"] = output[0] if isinstance(output, (tuple, list)) else output

    handle = last.register_forward_hook(keep_last)
    order = sorted(range(len(rows)), key=lambda i: cols["seq_len"][i])
    tokens, per_batch = 0, max(1, a.max_tokens // max(1, max(cols["seq_len"])))
    pool = ThreadPoolExecutor(max_workers=8)
    futures = []
    t0 = time.time()
    try:
        with torch.inference_mode(), LayerCapture(model, ids) as cap:
            for s in range(0, len(order), per_batch):
                idx = order[s:s + per_batch]
                n = max(cols["seq_len"][i] for i in idx)
                x = torch.full((len(idx), n), 0, dtype=torch.long)
                am = torch.zeros((len(idx), n), dtype=torch.long)
                for j, i in enumerate(idx):
                    L = cols["seq_len"][i]
                    x[j, :L] = torch.tensor(cols["input_ids"][i])
                    am[j, :L] = 1
                base_model(model)(input_ids=x.to(a.device), attention_mask=am.to(a.device), use_cache=False)
                parts = cap.outputs() + [raw_last["h"]]
                stack = torch.stack([p.to(a.device) for p in parts], dim=2).cpu()  # [b, n, k + 1, H]
                for j, i in enumerate(idx):
                    L = cols["seq_len"][i]
                    t = {"hidden_states": stack[j, :L].contiguous(), "token_ids": x[j, :L].clone()}
                    futures.append(pool.submit(save_file, t, str(hs_dir / f"hs_{i}.safetensors")))
                    tokens += L
        for f in futures:
            f.result()
    finally:
        handle.remove()
        pool.shutdown()
    res.update(capture_s=round(time.time() - t0, 2), captured_tokens=tokens, captured_samples=len(rows))
    del model
    if cuda:
        torch.cuda.empty_cache()


def train_speculators(a: argparse.Namespace, out: Path, res: dict) -> None:
    """speculators' DFlash trainer from captured hidden states (see the module docstring); fills ``res``."""
    res["stage"] = "import"
    import speculators.train.cli  # noqa: F401 - the import stage: fails here, not after the capture
    import torch
    import transformers
    res["versions"] = {"speculators": _version("speculators"), "hs-connectors": _version("hs-connectors"),
                       "transformers": transformers.__version__, "torch": torch.__version__}
    res["stage"] = "capture"
    hs_dir = Path(a.hs_dir) if a.hs_dir else _hs_dir(out)
    try:
        _capture_train_export_speculators(a, out, res, hs_dir)
    finally:
        if not a.keep_hs:  # 13 GiB of /dev/shm for the regenerated corpus: never left behind
            shutil.rmtree(hs_dir, ignore_errors=True)


def _capture_train_export_speculators(a: argparse.Namespace, out: Path, res: dict, hs_dir: Path) -> None:
    import speculators.train.cli as spec_cli
    import speculators.train.trainer as spec_trainer
    import torch
    from speculators.train.config import TrainConfig
    from speculators.train.graceful_shutdown import TrainingInterruptedError

    from specring.shared.models.dflash import resolve_mask_token_id
    cuda = a.device.startswith("cuda")
    data_dir = out / "data"
    capture_for_speculators(a, data_dir, hs_dir, res)
    res["stage"] = "train"
    mask = resolve_mask_token_id(Path(a.target))
    ids = layer_ids(a.target_layers)
    save = out / "checkpoints"
    shutil.rmtree(save, ignore_errors=True)
    workers = max(0, min(12, (os.cpu_count() or 2) - 2)) if cuda else 0
    argv = ["--verifier-name-or-path", str(a.target), "--data-path", str(data_dir), "--speculator-type", "dflash",
            "--num-layers", str(a.num_draft_layers), "--draft-arch", "qwen3",
            "--target-layer-ids", *[str(i + 1) for i in ids],
            "--full-attention-indices", *[str(i) for i in range(a.num_draft_layers)],
            "--block-size", str(a.block_size), "--mask-token-id", str(mask), "--total-seq-len", str(a.max_tokens),
            "--max-anchors", str(a.num_anchors), "--max-steps", str(a.max_steps), "--epochs", "1000",
            "--save-path", str(save), "--log-dir", str(out / "logs"), "--num-workers", str(workers),
            "--hidden-states-dtype", "bfloat16" if cuda else "float32", "--no-resume-from-checkpoint",
            "--draft-attn-impl", "simple_flex_attention" if cuda else "sdpa"]
    if a.lr is not None:
        argv += ["--lr", str(a.lr)]
    res["argv"] = argv
    deadline, max_steps = float(a.deadline), int(a.max_steps)
    counted = {"steps": 0}
    base = spec_trainer.Trainer

    class BudgetTrainer(base):  # stops at the deadline or at --max-steps through speculators' own interrupt
        def __init__(self, *args, **kw):
            super().__init__(*args, **kw)
            self._tokens = torch.zeros((), dtype=torch.long)
            self.model.register_forward_pre_hook(self._count, with_kwargs=True)

        def _count(self, module, args, kwargs):
            d = kwargs.get("document_ids")
            if module.training and d is not None:
                self._tokens = self._tokens.to(d.device) + (d != -1).sum()

        def train_epoch(self, epoch, *, step_callback=None):
            def budget():
                counted["steps"] = self.global_step
                counted["tokens"] = self._tokens
                counted.setdefault("first_step_at", time.time())
                if time.time() >= deadline or self.global_step >= max_steps:
                    counted["stopped_by"] = "deadline" if time.time() >= deadline else "max_steps"
                    raise TrainingInterruptedError("budget")
            return super().train_epoch(epoch, step_callback=budget)

    spec_cli.Trainer = BudgetTrainer
    if not cuda:  # CPU shims, only to exercise the code path here: speculators' Trainer needs an accelerator (it moves
        # the model to accelerator index 0 in setup_model, its step timer calls torch.accelerator.synchronize())
        spec_trainer.get_local_rank = lambda: "cpu"
        torch.accelerator.synchronize = lambda *args, **kw: None
        res["cpu_shims"] = ["speculators.train.trainer.get_local_rank -> 'cpu'",
                            "torch.accelerator.synchronize -> no-op",
                            "--loss-implementation eager (fused needs Triton)"]
        argv += ["--loss-implementation", "eager"]
    try:
        spec_cli.main(TrainConfig.resolve(argv))
    except SystemExit as e:  # TrainConfig.resolve renders a config error as SystemExit(2)
        raise RuntimeError(f"speculators config rejected (exit {e.code}); argv {' '.join(argv)}") from None
    res.update(train_end=time.time(), steps=int(counted["steps"]), first_step_at=counted.get("first_step_at"),
               stopped_by=counted.get("stopped_by"))
    tok = counted.get("tokens")
    res["tokens"] = int(tok.item()) if tok is not None else 0
    if not a.keep_hs:
        shutil.rmtree(hs_dir, ignore_errors=True)  # before the export: the memory back as soon as possible
    res["stage"] = "export"
    ck = save / "interrupted"
    if not (ck / "model.safetensors").is_file():
        done = sorted((p for p in save.iterdir() if p.is_dir() and p.name.isdigit()), key=lambda p: int(p.name))
        if not done:
            raise FileNotFoundError(f"no speculators checkpoint under {save}")
        ck = done[-1]
    from safetensors.torch import load_file
    scfg = json.loads((ck / "config.json").read_text())
    tensors = load_file(str(ck / "model.safetensors"))
    zcfg = zlab_config_from_speculators(scfg)
    write_specring_export(zcfg, tensors, Path(a.target), out / "export", a.export_dtype,
                          {"peer": "speculators", "checkpoint": str(ck), "steps": res["steps"]})
    res["export"] = str(out / "export")


def zlab_config_from_speculators(scfg: dict) -> dict:
    """The z-lab-style config of a speculators ``DFlashSpeculator`` checkpoint config: its decoder's fields (defaults
    filled by ``Qwen3Config``), ``target_layer_ids`` = speculators' aux ids - 1, ``block_size``, ``mask_token_id``."""
    from transformers import Qwen3Config

    tl = dict(scfg["transformer_layer_config"])
    full = Qwen3Config(**{k: v for k, v in tl.items() if k != "model_type"}).to_dict()
    rope = full.get("rope_parameters") or {}
    full["rope_theta"] = rope.get("rope_theta", full.get("rope_theta", 10000.0))
    aux = [int(i) for i in scfg["aux_hidden_state_layer_ids"]]
    full.update(architectures=["DFlashDraftModel"], block_size=int(scfg["block_size"]),
                dflash_config={"mask_token_id": int(scfg["mask_token_id"]), "target_layer_ids": [i - 1 for i in aux],
                               "block_size": int(scfg["block_size"])})
    full.pop("num_target_layers", None)
    return full


def _hs_dir(out: Path) -> Path:
    """Where the captured hidden states go: /dev/shm when it has 16 GiB free (the regenerated corpus in bf16 with
    six captured tensors is about 13 GiB), else beside the peer's outputs."""
    shm = Path("/dev/shm")
    try:
        st = os.statvfs(shm)
        if st.f_bavail * st.f_frsize > 16 * 2**30:
            return shm / f"specring-peers-hs-{os.getpid()}-{out.name}"
    except OSError:
        pass
    return out / "hs"


def _version(dist: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version(dist)
    except PackageNotFoundError:
        return None


# ------------------------------------------------------------------------------------------------ child
def child(a: argparse.Namespace) -> int:
    """``_train PEER``: train one peer, write ``OUT/result.json`` (status ok, or unavailable with the stage and the
    exception text)."""
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    res: dict = {"peer": a.peer, "status": "ok", "stage": "start", "device": a.device}
    try:
        (train_modelopt if a.peer == "modelopt" else train_speculators)(a, out, res)
    except BaseException as e:  # noqa: BLE001 - every failure becomes the row's reason
        import traceback
        res.update(status="unavailable", reason=f"{res['stage']}: {one_line(e)}")
        (out / "traceback.txt").write_text(traceback.format_exc())
    (out / "result.json").write_text(json.dumps(res, indent=1, default=str) + "\n")
    return 0


# ------------------------------------------------------------------------------------------------ parent
def eval_flags(a: argparse.Namespace) -> list[str]:
    flags = ["--num-prompts", str(a.num_prompts), "--prompt-len", str(a.prompt_len), "--max-new-tokens",
             str(a.max_new_tokens), "--data", str(a.heldout), "--target", str(a.target), "--device", a.device,
             "--no-baselines"]
    return flags if a.lossless_check else flags + ["--no-lossless-check"]


def evaluate(a: argparse.Namespace, drafter: str, out_json: Path, timeout_s: float) -> dict:
    """``launch.py eval --drafter DRAFTER`` in the standard setting; ``{tau, tau_pooled, eval_s}`` of its drafter row,
    or ``{error}``."""
    cmd = [a.eval_python, str(ROOT / "launch.py"), "eval", "--drafter", drafter, *eval_flags(a),
           "--output-json", str(out_json)]
    t0 = time.time()
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, cwd=ROOT)
    except subprocess.TimeoutExpired:
        return {"error": f"launch.py eval did not finish in {timeout_s:.0f} s"}
    if p.returncode != 0 or not out_json.is_file():
        tail = [ln for ln in (p.stderr or p.stdout).splitlines() if ln.strip()][-1:] or ["(no output)"]
        return {"error": f"launch.py eval exit {p.returncode}: {tail[0][:400]}"}
    rep = json.loads(out_json.read_text())
    rows = [r for r in rep["rows"] if not str(r["drafter"]).startswith("target greedy")]
    if not rows:
        return {"error": "launch.py eval reported no drafter row"}
    r = rows[0]
    return {"tau": r["tau_mean"], "tau_pooled": r["tau_pooled"], "eval_s": round(time.time() - t0, 1),
            "eval_tokens_per_s": r.get("tokens_per_s"), "eval_json": str(out_json),
            "setting": {k: rep.get(k) for k in ("num_prompts", "prompt_len", "max_new_tokens", "dtype", "block_size")}}


def start_peer(a: argparse.Namespace, peer: str, work: Path) -> dict:
    """Launch ``_train PEER`` (its budget counts from now); returns what ``finish_peer`` needs."""
    out = work / peer
    shutil.rmtree(out / "export", ignore_errors=True)
    (out / "result.json").unlink(missing_ok=True)
    out.mkdir(parents=True, exist_ok=True)
    spawn = time.time()
    deadline = spawn + a.minutes * 60
    cmd = [a.peer_python, str(Path(__file__).resolve()), "_train", peer, "--out", str(out), "--deadline",
           f"{deadline:.3f}", "--data", str(a.data), "--target", str(a.target), "--device", a.device,
           "--target-layers", a.target_layers, "--num-draft-layers", str(a.num_draft_layers), "--block-size",
           str(a.block_size), "--num-anchors", str(a.num_anchors), "--max-tokens", str(a.max_tokens),
           "--max-steps", str(a.max_steps), "--export-dtype", a.export_dtype]
    # the parent names the hidden-state directory and removes it once the child has ended, however it ended: a child
    # killed at the budget (SIGKILL below) runs no finally of its own
    hs_dir = (Path(a.hs_dir) if a.hs_dir else _hs_dir(out)) if peer == "speculators" else None
    for flag, v in (("--max-samples", a.max_samples), ("--lr", a.lr), ("--hs-dir", hs_dir)):
        if v is not None:
            cmd += [flag, str(v)]
    if a.keep_hs:
        cmd.append("--keep-hs")
    log = out / "train.log"
    f = open(log, "w")
    proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=ROOT)
    return {"peer": peer, "out": out, "spawn": spawn, "log": log, "file": f, "proc": proc, "hs_dir": hs_dir}


def finish_peer(a: argparse.Namespace, job: dict) -> dict:
    """Wait for a ``start_peer`` job, read its ``result.json``, evaluate its export; the row."""
    peer, out, spawn, log = job["peer"], job["out"], job["spawn"], job["log"]
    try:
        rc = job["proc"].wait(timeout=max(1.0, spawn + a.minutes * 60 + a.grace_s - time.time()))
    except subprocess.TimeoutExpired:
        job["proc"].kill()
        job["proc"].wait()
        rc = f"killed after {a.minutes * 60 + a.grace_s:.0f} s"
    job["file"].close()
    if job["hs_dir"] is not None and not a.keep_hs:
        shutil.rmtree(job["hs_dir"], ignore_errors=True)
    res_path = out / "result.json"
    if not res_path.is_file():
        lines = [ln for ln in log.read_text(errors="replace").splitlines() if ln.strip()]
        return {"peer": peer, "status": "unavailable",
                "reason": f"the training process ended (rc {rc}) without a result; last line: "
                          f"{(lines[-1] if lines else '(none)')[:400]}", "log": str(log)}
    res = json.loads(res_path.read_text())
    res["log"] = str(log)
    if res.get("status") != "ok":
        return res
    end = res.get("train_end") or time.time()
    res["minutes"] = round((end - spawn) / 60, 2)
    res["target_tokens_per_s"] = round(res.get("tokens", 0) / max(1e-9, end - spawn), 1)
    if res.get("first_step_at"):
        res["train_tokens_per_s"] = round(res.get("tokens", 0) / max(1e-9, end - res["first_step_at"]), 1)
    ev = evaluate(a, res["export"], out / "eval.json", a.eval_timeout_s)
    if "error" in ev:
        res.update(status="unavailable", reason=f"eval: {ev['error']}")
    res.update(ev)
    if a.parallel:
        res["note"] = "trained side by side with the other peers on the same device"
    return res


def specring_row(a: argparse.Namespace, work: Path) -> dict | None:
    """The specring row: τ from ``--specring-eval`` (a ``launch.py eval --output-json`` file) or, without one, from
    an evaluation of ``--specring-run`` run here; tokens/s, minutes and steps from the run's ``summary.json``."""
    if not a.specring_run and not a.specring_eval:
        return None
    row: dict = {"peer": "specring", "status": "ok"}
    if a.specring_run:
        summ = Path(a.specring_run) / "summary.json"
        if summ.is_file():
            s = json.loads(summ.read_text())
            row.update(target_tokens_per_s=s.get("tokens_per_s"), steps=s.get("trained_batches"),
                       minutes=round(float(s.get("elapsed_s") or 0) / 60, 2), run=str(a.specring_run))
        else:
            row["note"] = f"{summ} missing: no tokens/s or minutes"
    if a.specring_eval:
        rep = json.loads(Path(a.specring_eval).read_text())
        rows = [r for r in rep["rows"] if str(r["drafter"]).split()[0] in ("dflash", "dflash2", "eagle3")]
        if not rows:
            return {**row, "status": "unavailable", "reason": f"{a.specring_eval}: no drafter row"}
        row.update(tau=rows[0]["tau_mean"], tau_pooled=rows[0]["tau_pooled"], eval_json=str(a.specring_eval))
    else:
        ev = evaluate(a, str(a.specring_run), work / "specring_eval.json", a.eval_timeout_s)
        if "error" in ev:
            return {**row, "status": "unavailable", "reason": f"eval: {ev['error']}"}
        row.update(ev)
    return row


def fmt(v, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def row_line(r: dict) -> str:
    if r.get("status") != "ok":
        reason = str(r.get("reason", "")).replace('"', "'")
        return f'peer={r["peer"]} status=unavailable reason="{reason}"'
    line = (f"peer={r['peer']} tau={fmt(r.get('tau'), '.3f')} tau_pooled={fmt(r.get('tau_pooled'), '.3f')} "
            f"target_tokens_per_s={fmt(r.get('target_tokens_per_s'), '.1f')} minutes={fmt(r.get('minutes'), '.2f')} "
            f"steps={r.get('steps', '-')}")
    for k in ("train_tokens_per_s", "capture_s", "stopped_by"):
        if r.get(k) is not None:
            line += f" {k}={r[k]}"
    return line


def table(rows: list[dict]) -> str:
    head = "| peer | τ | τ pooled | target tokens/s | minutes | steps | note |"
    lines = [head, "| --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        if r.get("status") != "ok":
            lines.append(f"| {r['peer']} | – | – | – | – | – | unavailable: {r.get('reason', '')} |")
            continue
        lines.append(f"| {r['peer']} | {fmt(r.get('tau'), '.3f')} | {fmt(r.get('tau_pooled'), '.3f')} | "
                     f"{fmt(r.get('target_tokens_per_s'), ',.0f')} | {fmt(r.get('minutes'), '.2f')} | "
                     f"{r.get('steps', '–')} | {r.get('note', '')} |")
    return "\n".join(lines)


def run(a: argparse.Namespace) -> int:
    a.device = resolve_device(a.device)
    a.export_dtype = a.export_dtype or ("bfloat16" if a.device.startswith("cuda") else "float32")
    work = Path(a.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    results = Path(a.results) if a.results else work / "results.jsonl"
    peers = [p.strip() for p in a.peers.split(",") if p.strip()]
    bad = sorted(set(peers) - set(PEERS))
    if bad:
        print(f"error: --peers: unknown {bad} (known: {', '.join(PEERS)})", file=sys.stderr)
        return 2
    print(f"peers: data={a.data} target={a.target} device={a.device} minutes={a.minutes} max_steps={a.max_steps} "
          f"layers={a.target_layers} B={a.block_size} draft_layers={a.num_draft_layers} "
          f"eval: {' '.join(eval_flags(a))}", flush=True)
    new = []
    sp = specring_row(a, work)
    if sp is not None:
        new.append(sp)
        print(row_line(sp), flush=True)
    if a.parallel:  # side by side on the one device, each with the same deadline; evaluated one after the other
        jobs = [start_peer(a, peer, work) for peer in peers]
        rows = [finish_peer(a, job) for job in jobs]
    else:
        rows = []
        for peer in peers:
            rows.append(finish_peer(a, start_peer(a, peer, work)))
            print(row_line(rows[-1]), flush=True)
    if a.parallel:
        for r in rows:
            print(row_line(r), flush=True)
    new += rows
    with open(results, "a") as f:
        for r in new:
            f.write(json.dumps({**r, "time": time.time()}, default=str) + "\n")
    latest: dict[str, dict] = {}
    for ln in results.read_text().splitlines():
        if ln.strip():
            r = json.loads(ln)
            latest[r["peer"]] = r
    order = ["specring", *PEERS]
    print(f"tau: launch.py eval {' '.join(eval_flags(a))}")
    print(table([latest[p] for p in order if p in latest]))
    return 0


def download_wheels(a: argparse.Namespace) -> int:
    """The wheels of ``WHEELS`` into ``--dest`` (for the GPU machine: python 3.12, manylinux x86_64)."""
    dest = Path(a.dest)
    dest.mkdir(parents=True, exist_ok=True)
    rc = 0
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:", "-d", str(dest),
           "--python-version", "3.12", "--implementation", "cp"]
    for plat in PLATFORMS:
        cmd += ["--platform", plat]
    for req in WHEELS:
        p = subprocess.run([*cmd, req], capture_output=True, text=True)
        print(f"{req}: {'ok' if p.returncode == 0 else 'FAILED ' + p.stderr.strip().splitlines()[-1]}")
        rc = rc or p.returncode
    return rc


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("download-wheels", help="fetch the peers' wheels for the GPU machine into .whl/")
    d.add_argument("--dest", default=str(ROOT / ".whl"))

    def common(p):
        p.add_argument("--data", default=str(default_data()), help="training data (specring Arrow)")
        p.add_argument("--target", default=str(TARGET))
        p.add_argument("--device", default="auto")
        p.add_argument("--target-layers", default="1,3,5,6,7", help="z-lab/specring layer ids")
        p.add_argument("--num-draft-layers", type=int, default=5)
        p.add_argument("--block-size", type=int, default=16)
        p.add_argument("--num-anchors", type=int, default=512)
        p.add_argument("--max-tokens", type=int, default=8192, help="tokens per batch")
        p.add_argument("--max-steps", type=int, default=3200)
        p.add_argument("--max-samples", type=int, help="use only the first N samples of --data")
        p.add_argument("--lr", type=float, help="override every peer's learning rate (default: each peer's own)")
        p.add_argument("--hs-dir", help="speculators: where the captured hidden states go")
        p.add_argument("--keep-hs", action="store_true", help="speculators: keep the captured hidden states")
        p.add_argument("--export-dtype", help="dtype of the specring export (default: bfloat16 on CUDA, else float32)")

    r = sub.add_parser("run", help="train, convert and evaluate each peer; print the rows and the table")
    common(r)
    r.add_argument("--peers", default=",".join(PEERS))
    r.add_argument("--parallel", action="store_true", help="train the peers side by side on the one device")
    r.add_argument("--minutes", type=float, default=5.6, help="wall clock per peer, launch to last step")
    r.add_argument("--heldout", default=str(ROOT / "data" / "demo" / "heldout.arrow"))
    r.add_argument("--num-prompts", type=int, default=24)
    r.add_argument("--prompt-len", type=int, default=256)
    r.add_argument("--max-new-tokens", type=int, default=256)
    r.add_argument("--lossless-check", action="store_true", help="also decode the greedy reference (slower)")
    r.add_argument("--specring-run", help="a specring run directory (its summary.json; evaluated unless "
                                          "--specring-eval is given)")
    r.add_argument("--specring-eval", help="a `launch.py eval --output-json` file of that run")
    r.add_argument("--work-dir", default="/tmp/specring-peers")
    r.add_argument("--results", help="JSON lines of every row (default WORK_DIR/results.jsonl)")
    r.add_argument("--peer-python", default=sys.executable)
    r.add_argument("--eval-python", default=sys.executable)
    r.add_argument("--grace-s", type=float, default=300, help="seconds past the budget for load/export")
    r.add_argument("--eval-timeout-s", type=float, default=420)
    c = sub.add_parser("_train", help=argparse.SUPPRESS)
    c.add_argument("peer", choices=PEERS)
    c.add_argument("--out", required=True)
    c.add_argument("--deadline", type=float, required=True, help="time.time() at which training stops")
    common(c)
    return ap


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    if a.cmd == "download-wheels":
        return download_wheels(a)
    if a.cmd == "_train":
        a.device = resolve_device(a.device)
        a.export_dtype = a.export_dtype or ("bfloat16" if a.device.startswith("cuda") else "float32")
        return child(a)
    return run(a)


if __name__ == "__main__":
    sys.exit(main())
