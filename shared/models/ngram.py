"""Prompt-lookup drafting: the n-gram baseline every acceptance length is read against.

Algorithm: prompt lookup decoding (A. Saxena, 2023, github.com/apoorvumang/prompt-lookup-decoding; the
same idea is ``PromptLookupCandidateGenerator`` in transformers ``generation/candidate_generator.py``).
No model: take the last ``n`` tokens of the sequence (the anchor included), find an earlier occurrence
of that n-gram in the sequence (prompt and generated text), and propose the tokens that followed it.
``n`` goes from ``max_ngram`` down to ``min_ngram``; the first ``n`` with a match wins. Where the two
public versions take the *first* occurrence, this one takes the *most recent* (the nearest context is
the better predictor in code, which repeats locally); the choice is a constant of the baseline, not a
tuned knob. Written here from those descriptions, not copied.

The class follows the proposer interface of ``shared/models/speculative.py`` (``reset``, ``add_context``,
``propose``, and ``propose_sample`` for speculative sampling) and needs no target features. Its proposal is
deterministic, so under sampling its ``q`` is the one-hot of each draft (a draft ``d`` is then accepted with
probability ``p(d)``).
"""

from __future__ import annotations

import torch


class PromptLookupProposer:
    """Propose up to ``k`` tokens by n-gram lookup in the sequence so far.

    ``max_ngram >= min_ngram >= 1``; raises ``ValueError`` otherwise. Stateless: the whole sequence is
    passed to ``propose`` every time (a linear scan per n-gram size, fine for evaluation-length texts).
    ``vocab_size``: the width ``V`` of the target's logits, needed only by ``propose_sample`` (``q [n, V]``);
    ``shared.drafters.tau.evaluate_tau`` fills it in from the target when it is None. Raises ``ValueError`` when it
    is not ``>= 1``.
    """

    name = "prompt-lookup"
    needs_features = False

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1, vocab_size: int | None = None):
        if not 1 <= int(min_ngram) <= int(max_ngram):
            raise ValueError(f"ngram sizes: need 1 <= min_ngram <= max_ngram, got min={min_ngram} max={max_ngram}")
        if vocab_size is not None and int(vocab_size) < 1:
            raise ValueError(f"vocab_size: must be >= 1, got {vocab_size}")
        self.max_ngram = int(max_ngram)
        self.min_ngram = int(min_ngram)
        self.vocab_size = None if vocab_size is None else int(vocab_size)

    def reset(self, prompt_ids: list[int]) -> None:
        """Start a new sequence (nothing to keep)."""

    def add_context(self, features: torch.Tensor | None, positions: torch.Tensor) -> None:
        """Verified context arrives here in the proposer interface; lookup needs only the tokens."""

    def propose(self, tokens: list[int], k: int) -> list[int]:
        """Up to ``k`` draft tokens to follow ``tokens`` (whose last entry is the anchor); ``[]`` when no
        n-gram of the tail occurs earlier or ``k <= 0``."""
        if k <= 0 or len(tokens) < 2:
            return []
        seq = torch.as_tensor(tokens, dtype=torch.long)
        n_tok = seq.numel()
        for n in range(min(self.max_ngram, n_tok - 1), self.min_ngram - 1, -1):
            tail = seq[n_tok - n:]
            # windows starting at 0 .. n_tok-n-1: every occurrence except the tail itself
            windows = seq[:n_tok - 1].unfold(0, n, 1)
            hits = torch.nonzero((windows == tail).all(dim=1)).flatten()
            if hits.numel() == 0:
                continue
            start = int(hits[-1]) + n          # the most recent occurrence; its continuation starts here
            follow = seq[start:start + k]
            if follow.numel():
                return follow.tolist()
        return []

    def propose_sample(self, tokens: list[int], k: int, params, generator) -> tuple[list[int], torch.Tensor]:
        """``propose``'s drafts and ``q [len(drafts), vocab_size]`` float32, the one-hot of each draft (the
        proposal is deterministic; ``params`` and ``generator`` are not used). Raises ``ValueError`` when
        ``vocab_size`` is None or a draft lies outside it."""
        if self.vocab_size is None:
            raise ValueError("PromptLookupProposer.propose_sample: vocab_size unknown; construct it with "
                             "vocab_size=V (the width of the target's logits)")
        drafts = self.propose(tokens, k)
        if any(not 0 <= t < self.vocab_size for t in drafts):
            raise ValueError(f"PromptLookupProposer.propose_sample: a draft id lies outside vocab_size "
                             f"{self.vocab_size} ({drafts})")
        q = torch.zeros(len(drafts), self.vocab_size, dtype=torch.float32)
        if drafts:
            q[torch.arange(len(drafts)), torch.tensor(drafts, dtype=torch.long)] = 1.0
        return drafts, q
