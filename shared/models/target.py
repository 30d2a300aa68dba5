"""The target model: loading a Hugging Face causal LM, choosing the captured layers, and capturing them.

Layer ids follow the DFlash convention (z-lab/dflash, ``build_target_layer_ids`` and its use of
``output_hidden_states``): id ``i`` is the output of decoder layer ``i`` (0-based), which is Hugging Face's
``hidden_states[i + 1]`` (``hidden_states[0]`` is the embedding output). One exception is inherited from
Hugging Face: ``hidden_states[L]`` (id ``L - 1``) is the *final-normed* output of the last layer, so
``LayerCapture`` captures the output of the model's final norm for id ``L - 1`` and the raw residual stream
for every other id. Captured tensors therefore equal ``hidden_states[i + 1]`` for every id in ``[0, L)``.

Capture uses forward hooks on the chosen decoder layers only (not ``output_hidden_states=True``, which
keeps every layer alive), and the caller runs the *base* model (``model.model`` for Qwen/Llama: no LM head,
no logits over the sequence). With ``stop_after_last=True`` the hook of the deepest captured layer raises
``StopForward`` so the layers above it are not computed at all (the early-exit trick of baukit's
``Trace(stop=True)``, davidbau/baukit ``baukit/nethook.py``).

A target may be split over a device group (``--producers cuda:0+cuda:1``,
``shared.machine.devices.resolve_device_group``): ``layer_device_map`` spreads the decoder layers evenly over the group
(the embedding and everything before the layers on the first device, the final norm and an untied LM head on the last)
and ``load_target`` hands that explicit map to transformers' own placement (``from_pretrained(device_map=...)``, which
dispatches with accelerate's hooks when the map names more than one device). Captured outputs live on their layer's
device; ``LayerCapture`` selects the real tokens there and the producer gathers them on the group's first device.

Errors: every start-up problem (bad layer ids, a missing or non-causal-LM checkpoint, a device that does
not exist) raises ``shared.errors.ConfigError`` with a message that names the id, path or device.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Callable, Sequence

import torch
from torch import nn

from specring.shared.errors import ConfigError
from specring.shared.machine.devices import resolve_device_group, resolve_dtype
from specring.shared.models.hub import load_pretrained
from specring.shared.models.layer_ids import resolve_layer_ids
from specring.shared.models.target_config import read_target_config

log = logging.getLogger(__name__)


def check_checkpoint(path: str | Path, trust_remote_code: bool = False):
    """The checkpoint's ``PretrainedConfig``, after checking that ``path`` is a local causal-LM checkpoint.

    Cheap (reads ``config.json`` only), so callers can validate layer ids before loading weights. A
    vision-language checkpoint (``*ForConditionalGeneration`` with a ``text_config``, e.g. Qwen3.5) is accepted when
    its ``model_type`` has an ``AutoModelForCausalLM`` class: transformers then loads the language model alone. With
    ``trust_remote_code`` a model type outside transformers is accepted when the directory's ``auto_map`` names
    its ``AutoModelForCausalLM`` class (``--trust-remote-code``). Raises ``ConfigError`` naming the path and
    the problem (see ``load_target``).
    """
    path = Path(path).expanduser()
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    if not path.exists():
        raise ConfigError(f"target checkpoint directory {str(path)!r} does not exist")
    if not path.is_dir():
        raise ConfigError(f"target {str(path)!r} is not a directory (expected a Hugging Face checkpoint directory)")
    raw = read_target_config(path, flag=f"target {str(path)!r}")
    model_type = raw.get("model_type")
    ships_code = "AutoModelForCausalLM" in (raw.get("auto_map") or {})
    remote = trust_remote_code and ships_code
    if model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES and not remote and ships_code:
        raise ConfigError(f"target {str(path)!r}: model_type {model_type!r} is defined by the checkpoint's own code "
                          f"(auto_map); pass --trust-remote-code to let transformers run it")
    if model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES and not remote:
        raise ConfigError(f"target {str(path)!r} is not a causal language model: model_type {model_type!r} "
                          f"has no AutoModelForCausalLM class")
    archs = raw.get("architectures") or []
    causal_names = set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values())
    # a vision-language checkpoint (Qwen3.5 / Qwen3.5-MoE publish Qwen3_5*ForConditionalGeneration) whose
    # model_type transformers maps to a causal LM: AutoModelForCausalLM loads its language model alone
    multimodal = "text_config" in raw and all(a.endswith("ForConditionalGeneration") for a in archs)
    if archs and not remote and not multimodal and \
            not any(a in causal_names or a.endswith("ForCausalLM") for a in archs):
        raise ConfigError(f"target {str(path)!r} is not a causal language model: its architectures are "
                          f"{archs} (expected a *ForCausalLM class such as "
                          f"{MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type]})")
    if not any(path.glob("*.safetensors")):
        raise ConfigError(f"target {str(path)!r} has no *.safetensors weights")
    try:
        return load_pretrained("config", path, trust_remote_code=trust_remote_code)
    except ConfigError:
        raise
    except Exception as e:  # transformers raises many types for a broken config
        raise ConfigError(f"target {str(path)!r}: config.json is not a valid {model_type} config: "
                          f"{type(e).__name__}: {e}") from None


def meta_model(hf_config, trust_remote_code: bool = False) -> nn.Module:
    """The causal LM of ``hf_config`` built on the ``meta`` device (no memory, no weights): its module tree, for
    ``layer_device_map``."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(hf_config, trust_remote_code=trust_remote_code)


def layer_device_map(model: nn.Module, devices: Sequence[str | torch.device]) -> dict[str, str]:
    """An explicit ``device_map`` (module name → device string) that splits ``model`` over ``devices``.

    Decoder layer ``i`` of ``L`` goes to ``devices[i * n // L]`` (contiguous runs of about ``L / n`` layers,
    so activations cross a device boundary ``n - 1`` times per forward); every other child of the modules on the
    path to the layer list (embedding, rotary embedding, ...) goes to the first device, except the final norm and
    the LM head, which go to the last (the LM head stays with the embedding when the two are tied, so the shared
    weight is one tensor on one device). For Qwen3 over ``[d0, d1]``: ``{"model.embed_tokens": d0,
    "model.rotary_emb": d0, "model.layers.0": d0, ..., "model.layers.7": d1, "model.norm": d1, "lm_head": d0}``
    (tied). ``model`` may live on the ``meta`` device (``meta_model``). Same idea as accelerate's
    ``infer_auto_device_map`` (huggingface/accelerate ``src/accelerate/utils/modeling.py``), but by layer count
    rather than by memory, and with no dependency on accelerate.

    Raises ``ConfigError`` when the decoder layers cannot be found, ``ValueError`` for an empty ``devices``.
    """
    if not devices:
        raise ValueError("layer_device_map: no devices")
    devs = [str(d) for d in devices]
    first, last = devs[0], devs[-1]
    layers = decoder_layers(model)
    names = {id(mod): name for name, mod in model.named_modules()}
    layers_name = names[id(layers)]
    norm = final_norm(model)
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    tied = bool(getattr(getattr(model, "config", None), "tie_word_embeddings", False))
    dmap: dict[str, str] = {}
    owner, prefix = model, ""
    for part in layers_name.split("."):
        for cname, child in owner.named_children():
            if cname == part:
                continue
            if child is norm or (child is head and not tied):
                dmap[prefix + cname] = last
            else:
                dmap[prefix + cname] = first
        owner, prefix = getattr(owner, part), prefix + part + "."
    n, num = len(devs), len(layers)
    for i in range(num):
        dmap[f"{layers_name}.{i}"] = devs[i * n // num]
    return dmap


def load_target(path: str | Path, device: str | torch.device, dtype: str | torch.dtype = "auto",
                random_weights: bool = False, trust_remote_code: bool = False):
    """Load a local Hugging Face causal LM for inference; returns ``(model, hf_config)``.

    ``model`` is an ``AutoModelForCausalLM`` in eval mode with gradients off, on ``device`` in ``dtype``
    (``"auto"``: bfloat16 on CUDA, float32 on CPU), loaded from safetensors only, never from the network.

    ``device`` may be a device group (``"cuda:0+cuda:1"``, ``"cpu+cpu"``;
    ``shared.machine.devices.resolve_device_group``): the model is then split over it by ``layer_device_map``, given to
    ``from_pretrained`` as its ``device_map`` (``model.hf_device_map`` records it, and every module is checked to sit
    where the map says). Over more than one distinct device transformers dispatches the model with accelerate's hooks,
    which move activations from one layer's device to the next.

    ``trust_remote_code``: transformers may run the modelling code the directory ships (``--trust-remote-code``;
    every load goes through ``shared.models.hub.load_pretrained``).

    ``random_weights=True`` (benchmarks of large shapes without their weights): the model is built from
    ``config.json`` with random weights directly on ``device``, then every tensor the checkpoint does hold
    (typically the embedding and LM head, which the drafter shares) is copied in.

    Raises ``ConfigError`` naming the problem: a missing directory, no ``config.json``, a checkpoint that is
    not a causal LM, no safetensors weights, weights that fail to load, a device that does not exist, or a
    model whose decoder layers cannot be found.
    """
    from transformers.utils import is_accelerate_available

    group = resolve_device_group(device)
    dev = group[0]
    torch_dtype = resolve_dtype(dtype, dev)
    p = Path(path).expanduser()
    hf_config = check_checkpoint(p, trust_remote_code)
    dmap = layer_device_map(meta_model(hf_config, trust_remote_code), group) if len(group) > 1 else None
    if random_weights:
        model = _random_target(p, hf_config, dev, torch_dtype, trust_remote_code)
        if dmap is not None:
            place_target(model, dmap)
        return model, hf_config
    kwargs = dict(dtype=torch_dtype, use_safetensors=True)
    direct = dmap is not None or (dev.type == "cuda" and is_accelerate_available())
    if dmap is not None:
        kwargs["device_map"] = dmap  # transformers places each module (and dispatches when devices differ)
    elif direct:
        kwargs["device_map"] = str(dev)  # weights go straight to the GPU (no full copy in host memory)
    try:
        model = load_pretrained("causal_lm", p, trust_remote_code=trust_remote_code, **kwargs)
    except ConfigError:
        raise
    except Exception as e:
        raise ConfigError(f"target {str(p)!r} failed to load as a causal LM: {type(e).__name__}: {e}") from None
    if not direct:
        model = model.to(dev)
    model.eval()
    model.requires_grad_(False)
    decoder_layers(model)  # fail now, not at the first batch, if the layers cannot be found
    log.info("target loaded path=%s device=%s dtype=%s layers=%d hidden=%d", p, "+".join(map(str, group)),
             torch_dtype, num_decoder_layers(model), hidden_size(model))
    if dmap is not None:
        check_placement(model, dmap)
        log.info("target split device_map=%s", ",".join(f"{k}:{v}" for k, v in dmap.items()))
    return model, hf_config


def check_placement(model: nn.Module, dmap: dict[str, str]) -> None:
    """Check that every parameter and buffer of each module named in ``dmap`` is on its device, and record the
    map as ``model.hf_device_map`` (transformers sets it only when it dispatched over several devices). Raises
    ``ConfigError`` naming the first module and tensor that sit elsewhere."""
    for name, want in dmap.items():
        mod = model.get_submodule(name)
        for tname, t in list(mod.named_parameters()) + list(mod.named_buffers()):
            if t.device != torch.device(want):
                raise ConfigError(f"target placement: {name}.{tname} is on {t.device}, its device map says {want}")
    model.hf_device_map = dict(dmap)


def place_target(model: nn.Module, dmap: dict[str, str]) -> None:
    """Move the modules of a model built in memory (random weights, benchmarks) to the devices of ``dmap``
    (``layer_device_map``): accelerate's ``dispatch_model`` when they differ (it also hooks the modules to move
    their inputs, as transformers does for ``from_pretrained(device_map=...)``), else a plain move; then
    ``check_placement``. Raises ``ConfigError`` naming a module that did not land where the map says."""
    if len(set(dmap.values())) > 1:
        from accelerate import dispatch_model
        dispatch_model(model, device_map=dmap)
    else:
        model.to(next(iter(dmap.values())))
    check_placement(model, dmap)


def _random_target(path: Path, hf_config, dev: torch.device, dtype: torch.dtype, trust_remote_code: bool = False):
    """A causal LM of ``hf_config``'s shape with random weights on ``dev``, plus the checkpoint's own tensors."""
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(dev):
            model = AutoModelForCausalLM.from_config(hf_config, trust_remote_code=trust_remote_code)
    finally:
        torch.set_default_dtype(previous)
    state = {}
    for f in sorted(path.glob("*.safetensors")):
        with safe_open(str(f), framework="pt", device=str(dev)) as sf:
            for k in sf.keys():
                state[k] = sf.get_tensor(k).to(dtype)
    missing, unexpected = model.load_state_dict(state, strict=False)
    model.to(dtype).eval()
    model.requires_grad_(False)
    decoder_layers(model)
    log.info("target random_weights=True path=%s device=%s dtype=%s loaded_tensors=%d random_tensors=%d unexpected=%s",
             path, dev, dtype, len(state) - len(unexpected), len(missing), list(unexpected)[:5])
    return model


# ------------------------------------------------------------------------------------------------ structure
def base_model(model: nn.Module) -> nn.Module:
    """The decoder stack without the LM head (``model.model`` for Qwen/Llama; ``model`` if it has no head)."""
    prefix = getattr(model, "base_model_prefix", "")
    return getattr(model, prefix, model) if prefix else model


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The model's list of decoder layers (``layers``, ``h``, ``blocks`` or ``decoder.layers`` of the base).

    Raises ``ConfigError`` naming the model class when none is found.
    """
    base = base_model(model)
    for owner in (base, getattr(base, "decoder", None), model):
        if owner is None:
            continue
        for name in ("layers", "h", "blocks"):
            layers = getattr(owner, name, None)
            if isinstance(layers, nn.ModuleList) and len(layers):
                return layers
    raise ConfigError(f"cannot find the decoder layers of {type(model).__name__} "
                      f"(looked for layers/h/blocks on its base model)")


def final_norm(model: nn.Module) -> nn.Module | None:
    """The norm applied after the last decoder layer (``norm``, ``final_layernorm`` or ``ln_f``), if any."""
    base = base_model(model)
    for owner in (base, getattr(base, "decoder", None)):
        for name in ("norm", "final_layernorm", "ln_f"):
            mod = getattr(owner, name, None) if owner is not None else None
            if isinstance(mod, nn.Module):
                return mod
    return None


def num_decoder_layers(model: nn.Module) -> int:
    return len(decoder_layers(model))


def hidden_size(model: nn.Module) -> int:
    """Width ``H`` of the residual stream (``config.hidden_size``)."""
    cfg = getattr(model, "config", None)
    h = getattr(cfg, "hidden_size", None) or getattr(cfg, "n_embd", None)
    if not h:
        raise ConfigError(f"cannot tell the hidden size of {type(model).__name__} from its config")
    return int(h)


# ------------------------------------------------------------------------------------------------ capture
class StopForward(Exception):
    """Raised by ``LayerCapture`` after the deepest captured layer when ``stop_after_last`` is set."""


class LayerCapture:
    """Forward hooks that keep the outputs of the chosen decoder layers during one forward.

    Use as a context manager around a forward of ``base_model(model)``::

        with LayerCapture(model, [1, 3, 5], stop_after_last=True) as cap:
            cap.token_index = idx          # optional: flat indices of the real tokens, [T] int64 on the device
            try:
                base_model(model)(input_ids=ids, attention_mask=am, use_cache=False)
            except StopForward:
                pass
            parts = cap.outputs()          # one tensor per id, in the order of layer_ids

    Each captured output is on the device of its layer (a split target has several) and is ``[B, S, H]``
    (``token_index`` is None) or ``[T, H]`` gathered from the flat
    ``[B*S, H]`` view with ``token_index`` inside the hook, so later layers cannot change it and the full
    ``[B, S, H]`` tensor is not kept alive. Id ``L - 1`` captures the final norm's output (see the module
    docstring). Hooks are removed on exit, even when the forward raised.

    Raises ``ConfigError`` for ids that ``resolve_layer_ids`` rejects, or for id ``L - 1`` on a model
    without a recognisable final norm.
    """

    def __init__(self, model: nn.Module, layer_ids: Sequence[int], stop_after_last: bool = False,
                 final_output: bool = False):
        self.layers = decoder_layers(model)
        self.layer_ids = resolve_layer_ids(len(self.layers), list(layer_ids), len(layer_ids))
        if stop_after_last and final_output:
            raise ValueError("LayerCapture: final_output needs the whole forward (stop_after_last=False)")
        self.stop_after_last = stop_after_last
        self.token_index: torch.Tensor | None = None
        self._index_on: dict[torch.device, torch.Tensor] = {}  # token_index on other devices (split target)
        self._out: dict[int, torch.Tensor] = {}
        self._handles: list = []
        last = len(self.layers) - 1
        self._modules: dict[int, nn.Module] = {}
        self._final_norm = final_norm(model) if final_output else None
        if final_output and self._final_norm is None:
            raise ConfigError(f"the target's own next tokens need its final norm, and {type(model).__name__} "
                              "has none that specring recognises")
        for i in self.layer_ids:
            if i == last:
                norm = final_norm(model)
                if norm is None:
                    raise ConfigError(f"layer id {last} (the last layer) needs the model's final norm, and "
                                      f"{type(model).__name__} has none that specring recognises")
                self._modules[i] = norm
            else:
                self._modules[i] = self.layers[i]

    def _hook(self, layer_id: int, stop: bool) -> Callable:
        def hook(_module, _inputs, output):
            h = output[0] if isinstance(output, (tuple, list)) else output
            if self.token_index is not None:
                idx = self.token_index
                if idx.device != h.device:  # a layer on another device of a split target
                    idx = self._index_on.get(h.device)
                    if idx is None:
                        idx = self._index_on[h.device] = self.token_index.to(h.device)
                h = h.reshape(-1, h.shape[-1]).index_select(0, idx)
            self._out[layer_id] = h
            if stop:
                raise StopForward(layer_id)
        return hook

    def __enter__(self) -> "LayerCapture":
        self._out.clear()
        deepest = max(self.layer_ids)
        for i, mod in self._modules.items():
            stop = self.stop_after_last and i == deepest
            self._handles.append(mod.register_forward_hook(self._hook(i, stop)))
        if self._final_norm is not None:
            self._handles.append(self._final_norm.register_forward_hook(self._hook(FINAL, False)))
        return self

    def __exit__(self, *exc) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def outputs(self) -> list[torch.Tensor]:
        """The captured tensors in ``layer_ids`` order; raises ``RuntimeError`` naming any id not reached."""
        missing = [i for i in self.layer_ids if i not in self._out]
        if missing:
            raise RuntimeError(f"layer ids {missing} were not captured (did the forward run?)")
        return [self._out[i] for i in self.layer_ids]

    def final_output(self) -> torch.Tensor:
        """The final norm's output (``[B, S, H]`` or ``[T, H]``, the input of the LM head), captured when
        the capture was built with ``final_output=True``; raises ``RuntimeError`` otherwise."""
        if FINAL not in self._out:
            raise RuntimeError("the final norm's output was not captured (final_output=False, or no forward)")
        return self._out[FINAL]

    def clear(self) -> None:
        """Drop references to the captured tensors (and the copies of ``token_index`` on other devices)."""
        self._out.clear()
        self._index_on.clear()


FINAL = -1  # LayerCapture's key for the final norm's output


@torch.no_grad()
def greedy_next_tokens(normed: torch.Tensor, lm_head: nn.Module, topk: int = 0,
                       max_logit_elems: int = 2 ** 28) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """The target's own next-token choices for every position: the labels of ``label_source=target``.

    ``normed [T, H]``: the final norm's output (``LayerCapture.final_output``); ``lm_head``: the target's
    output embedding (``model.get_output_embeddings()``). Returns ``(next_ids [T] int32, topk_ids [T, K]
    int32 | None, topk_logprobs [T, K] float32 | None)``: the argmax of the logits (greedy decoding's choice)
    and, with ``topk > 0``, the ``K`` most likely tokens with their log-probabilities (log-softmax over the
    whole vocabulary, in float32). The logits are computed about ``max_logit_elems`` at a time (a 152k
    vocabulary would otherwise need gigabytes for a large batch). Models that post-process logits (soft
    capping) keep the argmax; their top-K log-probabilities are those of the raw head. On a split target the
    logits are computed on the head's device and the results returned on ``normed``'s.
    """
    out_device = normed.device
    normed = normed.to(lm_head.weight.device)  # a split target: the final norm and the head may differ
    t = normed.shape[0]
    vocab = int(lm_head.weight.shape[0])
    step = max(1, max_logit_elems // max(1, vocab))
    ids = torch.empty(t, dtype=torch.int32, device=normed.device)
    tk_ids = torch.empty(t, topk, dtype=torch.int32, device=normed.device) if topk else None
    tk_lp = torch.empty(t, topk, dtype=torch.float32, device=normed.device) if topk else None
    for i in range(0, t, step):
        logits = lm_head(normed[i:i + step])
        ids[i:i + step] = logits.argmax(-1).to(torch.int32)
        if topk:
            lp = torch.log_softmax(logits.float(), dim=-1)
            v, k = lp.topk(topk, dim=-1)
            tk_ids[i:i + step] = k.to(torch.int32)
            tk_lp[i:i + step] = v
    if out_device != normed.device:
        ids, tk_ids, tk_lp = (None if x is None else x.to(out_device) for x in (ids, tk_ids, tk_lp))
    return ids, tk_ids, tk_lp
