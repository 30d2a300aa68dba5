"""Which target layers each drafter family captures: the layer-id rules of every family, in one place.

Convention (DFlash's, used by every family here): id ``i`` is the output of target decoder layer ``i`` (the
residual stream after it), ``0 <= i < L``. The features of a slot are the captured layers concatenated in the
order of the ids.

* DFlash and DFlash2: ``n`` ids spread evenly over ``1 .. L-3`` (z-lab/dflash ``build_target_layer_ids``),
  ``default_target_layer_ids``; ``resolve_layer_ids`` validates what the user asked for.
* EAGLE-3: three layers, low, middle and high (``default_eagle3_layer_ids``; SpecForge/EAGLE's
  ``hidden_states[2], [L//2], [L-3]`` in this convention); ``resolve_eagle3_layer_ids`` validates.
* Hybrid stacks (Qwen3.5 / Qwen3.6 / Qwen3-Next: Gated DeltaNet linear-attention layers with a full-attention
  layer every 4th): the same rules over all layers, whatever each layer's kind, as z-lab's drafters for them
  choose (z-lab/Qwen3.5-27B-DFlash ``[1, 16, 31, 46, 61]`` of 64 layers, z-lab/Qwen3.6-35B-A3B-DFlash
  ``[1, 10, 19, 28, 37]`` of 40: mostly linear-attention layers); what is captured is always the residual stream
  after the layer. ``layer_kinds`` reads each layer's kind from a config, ``describe_capture`` states the choice
  for ``train --plan``.

Every rule raises ``shared.errors.ConfigError`` with ``key`` set to the config field at fault
(``target_layer_ids`` or ``num_target_layers``, fields of ``producer``).
"""

from __future__ import annotations

from typing import Sequence

from specring.shared.errors import ConfigError

DEFAULT_NUM_TARGET_LAYERS = 5   # the DFlash default; fewer on a target too shallow for 5 distinct ids


def default_layer_range(num_layers: int) -> tuple[int, int]:
    """``(lo, hi)``, inclusive: the ids the DFlash default spreads over, 1 to ``num_layers - 3``; on a
    target of at most 4 layers the one id ``min(1, num_layers - 1)``."""
    lo = min(1, num_layers - 1)
    return lo, max(lo, num_layers - 3)


def max_default_layers(num_layers: int) -> int:
    """How many distinct ids ``default_target_layer_ids`` can give for a ``num_layers``-layer target."""
    lo, hi = default_layer_range(num_layers)
    return hi - lo + 1


def default_target_layer_ids(num_layers: int, n: int = DEFAULT_NUM_TARGET_LAYERS) -> list[int]:
    """The DFlash default: ``n`` distinct layer ids spread evenly from 1 to ``num_layers - 3``.

    ``n == 1`` gives ``[num_layers // 2]``; otherwise ``round(1 + k * (L - 4) / (n - 1))`` for
    ``k = 0 .. n-1`` with Python's ``round`` (as in z-lab/dflash ``build_target_layer_ids``). Qwen3-8B
    (``L = 36``) with ``n = 5`` gives ``[1, 9, 17, 25, 33]``. A target too shallow for ``n`` distinct ids
    in that range (``L - 3 < n``) gets every id of it instead, fewer than ``n`` (``L = 6``: ``[1, 2, 3]``;
    ``L <= 4``: ``[min(1, L - 1)]``; see ``default_layer_range``). The result is always distinct ids in
    ``[0, L)``, in increasing order.

    Raises ``ConfigError`` if ``num_layers < 1`` or ``n < 1``.
    """
    if num_layers < 1:
        raise ConfigError(f"num_layers must be >= 1, got {num_layers}")
    if n < 1:
        raise ConfigError(f"num_target_layers must be >= 1, got {n}")
    if n == 1:
        return [num_layers // 2]
    lo, hi = default_layer_range(num_layers)
    count = min(n, hi - lo + 1)
    if count == 1:
        return [lo]
    ids = [int(round(lo + k * (hi - lo) / (count - 1))) for k in range(count)]
    assert len(set(ids)) == count and all(0 <= i < num_layers for i in ids), (num_layers, n, ids)
    return ids


def resolve_layer_ids(num_layers: int, ids: Sequence[int] | None, n: int | None = None, *,
                      exact: bool = True) -> list[int]:
    """The layer ids to capture: ``ids`` when given, else the DFlash default spread of ``n`` ids.

    ``n=None`` (no count asked for): ``default_target_layer_ids(num_layers)``, 5 ids or fewer on a
    shallow target. An explicit ``n`` must fit when ``exact``: a target that cannot give ``n`` distinct
    default ids raises ``ConfigError`` naming ``num_target_layers`` and the most it can give; with
    ``exact=False`` it gets as many as it can (``default_target_layer_ids``). Order of ``ids`` is kept
    (it is the order of the ``n·H`` feature blocks in a slot). Raises ``ConfigError`` naming the offending
    ids when any is outside ``[0, num_layers)`` or repeated, or naming ``num_target_layers`` when ``n < 1``.
    """
    if ids is None:
        if n is not None and n < 1:
            raise _layer_error("num_target_layers", f"must be >= 1, got {n}")
        if exact and n is not None and n > 1 and n > max_default_layers(num_layers):
            lo, hi = default_layer_range(num_layers)
            raise _layer_error("num_target_layers", f"a target with {num_layers} decoder layers gives at most "
                               f"{max_default_layers(num_layers)} distinct default layer ids (ids {lo}..{hi}), "
                               f"not {n}; ask for fewer, leave it unset (the default adapts to the depth), or "
                               f"name the layers with target_layer_ids")
        return default_target_layer_ids(num_layers, DEFAULT_NUM_TARGET_LAYERS if n is None else n)
    chosen = [int(i) for i in ids]
    if not chosen:
        raise _layer_error("target_layer_ids", "no layer ids")
    bad = [i for i in chosen if not 0 <= i < num_layers]
    if bad:
        raise _layer_error("target_layer_ids", f"layer ids {bad} are outside [0, {num_layers}) for a target with "
                           f"{num_layers} decoder layers (got {chosen})")
    dup = sorted({i for i in chosen if chosen.count(i) > 1})
    if dup:
        raise _layer_error("target_layer_ids", f"duplicate layer ids {dup} (got {chosen})")
    return chosen


def _layer_error(key: str, detail: str) -> ConfigError:
    return ConfigError(f"{key}: {detail}", key=key, detail=detail)


# ------------------------------------------------------------------------------------------------ loading


def default_eagle3_layer_ids(num_layers: int) -> list[int]:
    """The references' low/mid/high layers in specring's convention: ``[1, L//2 - 1, L - 4]`` (Qwen3-8B, 36
    layers: ``[1, 17, 32]``), made distinct and valid on shallow targets (each id at least one above the
    previous, at most ``L - 1``; fewer than three on a target of under three layers). Raises ``ConfigError``
    for ``num_layers < 1``."""
    if num_layers < 1:
        raise ConfigError(f"num_layers must be >= 1, got {num_layers}")
    if num_layers < 3:
        return list(range(num_layers))
    ids, prev = [], -1
    for i in (1, num_layers // 2 - 1, num_layers - 4):
        i = max(i, prev + 1)
        ids.append(i)
        prev = i
    over = ids[-1] - (num_layers - 1)
    if over > 0:  # shift down from the top, keeping them distinct
        ids = [max(0, i - over) for i in ids]
        for j in range(1, len(ids)):
            ids[j] = max(ids[j], ids[j - 1] + 1)
    return ids


def resolve_eagle3_layer_ids(num_layers: int, ids: Sequence[int] | None, n: int | None = None) -> list[int]:
    """The three target layers an EAGLE-3 drafter fuses (low, middle, high): ``ids`` when given, else
    ``default_eagle3_layer_ids(num_layers)``. Raises ``ConfigError`` (key ``num_target_layers``) when
    ``n`` asks for other than three, and (key ``target_layer_ids``) unless the ids are three distinct
    ids inside the target."""
    if ids is None and n is not None and n != 3:
        raise _layer_error("num_target_layers",
                           f"EAGLE-3 fuses exactly three target layers (low, middle, high), got {n}")
    chosen = default_eagle3_layer_ids(num_layers) if ids is None else [int(i) for i in ids]
    if len(chosen) != 3 or len(set(chosen)) != 3 or any(not 0 <= i < num_layers for i in chosen):
        raise _layer_error("target_layer_ids",
                           f"EAGLE-3 needs three distinct target layer ids (low, middle, high) in 0..{num_layers - 1} "
                           f"(the target has {num_layers} layers), got {chosen}")
    return chosen


# ------------------------------------------------------------------------------------------------ hybrid stacks
def layer_kinds(cfg: dict, num_layers: int | None = None) -> list[str] | None:
    """The token mixer of each decoder layer of a target text config ``cfg`` (``target_config.text_config``), as
    transformers names them: its ``layer_types`` (``full_attention``, ``linear_attention``, ``sliding_attention``,
    ...), else, for a config that states only ``full_attention_interval`` (Qwen3-Next's published config.json),
    every ``interval``-th layer ``full_attention`` and the others ``linear_attention`` (the rule of transformers'
    ``Qwen3NextConfig``). None when the config says nothing (a homogeneous stack) or lists another number of
    layers than ``num_layers`` (default ``cfg["num_hidden_layers"]``)."""
    n = int(num_layers if num_layers is not None else cfg.get("num_hidden_layers") or 0)
    kinds = cfg.get("layer_types")
    if kinds is None and cfg.get("full_attention_interval"):
        every = int(cfg["full_attention_interval"])
        kinds = ["full_attention" if (i + 1) % every == 0 else "linear_attention" for i in range(n)]
    if not isinstance(kinds, (list, tuple)) or len(kinds) != n or not all(isinstance(k, str) for k in kinds):
        return None
    return list(kinds)


def describe_capture(kinds: Sequence[str] | None, ids: Sequence[int]) -> str | None:
    """One line for ``train --plan`` on a target whose layers are of several kinds (a hybrid stack such as
    Qwen3.5 / Qwen3-Next: Gated DeltaNet linear attention with a full-attention layer every 4; sliding and full
    attention), None on a homogeneous one. The captured features are the residual stream after each chosen decoder layer
    whatever its kind, and the default ids are the even spread of the DFlash rule over all layers, the same as z-lab's
    drafters for these targets choose: z-lab/Qwen3.5-27B-DFlash (64 layers) captures ``[1, 16, 31, 46, 61]`` and
    z-lab/Qwen3.6-35B-A3B-DFlash (40 layers) ``[1, 10, 19, 28, 37]``, ``build_target_layer_ids(L, 5)``, mostly
    linear-attention layers."""
    if not kinds or len(set(kinds)) < 2:
        return None
    counts: dict[str, int] = {}
    for k in kinds:
        counts[k] = counts.get(k, 0) + 1
    stack = " + ".join(f"{n} {k}" for k, n in counts.items())
    picked = ", ".join(f"{i} {kinds[i]}" for i in ids if 0 <= i < len(kinds))
    return (f"hybrid stack ({stack}); captured: {picked}: the residual stream after each decoder layer, whatever "
            "its kind (z-lab's DFlash drafters for the Qwen3.5 / Qwen3.6 hybrids spread their ids over all layers "
            "the same way)")
