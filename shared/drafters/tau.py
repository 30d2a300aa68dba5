"""τ of a drafter or proposer by real speculative decoding with the target (``evaluate_tau``): what ``launch.py
eval`` and τ during training (``consumer.tau``) measure. A drafter decodes through its family's proposer
(``shared.drafters.family_of``), which is why this lives beside the families and not with the decoding loops of
``shared.models.speculative`` and ``shared.models.batched_decode``, which it calls.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch

from specring.shared.drafters import family_of
from specring.shared.models.batched_decode import decode_prompts
from specring.shared.models.speculative import SamplingParams, summarize, target_vocab_size, with_vocab_size


@torch.no_grad()
def evaluate_tau(target_model, drafter, prompts: list[list[int]], max_new_tokens: int,
                 layer_ids: Sequence[int] | None, *, block_size: int | None = None,
                 stop_token_ids: Sequence[int] = (), check_lossless: bool = False,
                 on_prompt: Callable[[int, int], None] | None = None, sampling: SamplingParams | None = None,
                 seed: int = 0, batch_size: int = 1) -> dict[str, Any]:
    """τ of ``drafter`` on ``prompts`` against an already-loaded target (for the trainer's checkpoints).

    ``target_model``: HF ``AutoModelForCausalLM`` in eval mode; ``drafter``: a live drafter of any family (put in
    eval mode for the call, its mode restored after; it decodes through its family's proposer,
    ``DrafterFamily.proposer``: DFlash blocks, DFlash2's selector walk, EAGLE-3 chains of ``block_size - 1``
    tokens, by default ``ttt_steps``) or any proposer (e.g.
    ``PromptLookupProposer()``); ``layer_ids``: the target layers the drafter was trained on (must equal
    ``drafter.config.target_layer_ids``: ``ValueError`` otherwise). ``block_size`` defaults to the
    drafter's (16 for a proposer). With ``check_lossless`` also decodes greedily and adds
    ``lossless_mismatches`` (prompts whose outputs differ; must be 0) and ``greedy_tokens_per_s``.
    ``on_prompt(done, total)`` is called after each prompt (the consumer sends a heartbeat from it).

    ``sampling`` (None: greedy) at temperature > 0 decodes by speculative sampling, every draw from one CPU
    generator seeded with ``seed`` for the whole call; a ``PromptLookupProposer`` without ``vocab_size`` is
    then used as a copy sized to the target's logits. Token equality with greedy decoding does not apply
    there: with ``check_lossless`` the greedy decode still runs (``greedy_tokens_per_s``) and
    ``lossless_mismatches`` is None. Returns ``summarize``'s dict, plus, when sampled, ``sampling`` (the
    parameters, ``SamplingParams.to_dict``) and ``sampling_seed``.

    ``batch_size`` > 1 decodes that many prompts together (``shared.models.batched_decode.decode_prompts``: the
    same tokens and acceptance lengths, ``on_prompt`` called after each group), or one at a time where batching
    does not apply (sampling, a hybrid target); the result then also has ``batched``, ``batch_size``,
    ``batched_reason`` and ``batch_forwards``. Raises ``ValueError`` for ``batch_size < 1``.
    """
    if isinstance(drafter, torch.nn.Module):  # a drafter: its family's proposer (shared.drafters)
        if layer_ids is not None and list(layer_ids) != list(drafter.config.target_layer_ids):
            raise ValueError(f"layer_ids: {list(layer_ids)} differ from the drafter's target_layer_ids "
                             f"{drafter.config.target_layer_ids}")
        layer_ids = drafter.config.target_layer_ids
        family = family_of(drafter)
        bsz = family.verify_block_size(drafter, block_size)
        proposer = family.proposer(drafter, block_size=bsz)
    else:
        proposer, bsz = drafter, int(block_size or 16)
    sampled = sampling is not None and not sampling.greedy
    if sampled:
        proposer = with_vocab_size(proposer, target_vocab_size(target_model))
    generator = torch.Generator().manual_seed(int(seed)) if sampled else None
    was_training = getattr(drafter, "training", False)
    if isinstance(drafter, torch.nn.Module):
        drafter.eval()
    try:
        done = [0]

        def finished(n: int) -> None:
            done[0] += n
            if on_prompt is not None:
                on_prompt(done[0], len(prompts))

        results, info = decode_prompts(target_model, proposer, prompts, max_new_tokens, bsz, layer_ids,
                                       stop_token_ids, batch_size=batch_size,
                                       sampling=sampling if sampled else None, generator=generator, on_done=finished)
        out = summarize(results, bsz)
        if int(batch_size) > 1:
            out.update(info)
        if sampled:
            out["sampling"] = sampling.to_dict()
            out["sampling_seed"] = int(seed)
        if check_lossless:
            ref, _ = decode_prompts(target_model, None, prompts, max_new_tokens, bsz, None, stop_token_ids,
                                    batch_size=1 if sampled else batch_size)
            out["lossless_mismatches"] = (None if sampled else
                                          sum(r.tokens != g.tokens for r, g in zip(results, ref)))
            out["greedy_tokens_per_s"] = summarize(ref, bsz)["tokens_per_s"]
    finally:
        if isinstance(drafter, torch.nn.Module):
            drafter.train(was_training)
    return out
