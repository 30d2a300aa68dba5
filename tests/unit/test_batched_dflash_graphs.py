"""The static batched DFlash propose (shared/models/batched_dflash_graphs.py) drafts what BatchedDFlash drafts.

On CPU the static code runs eagerly (``graphs=False``): fixed rows that never move, a fixed-capacity context
cache attended over its whole width under each row's length mask, the feed padded to ``rows x block`` with writes
to a scratch column. Every draft of every step, the tokens, acceptance lengths and forwards of every prompt must
equal the one-prompt loop's (float32, the fixture target, prompts of different lengths, a stop token that ends
rows early so finished rows stay in the buffers), and the cache must grow (re-allocating its buffers) mid-decode.
"""

import pytest
import torch

from specring.shared.drafters import get_family
from specring.shared.models.batched_decode import batched_proposer, batched_speculative_generate
from specring.shared.models.batched_dflash_graphs import GraphedDFlash
from specring.shared.models.batched_proposers import BatchedDFlash
from specring.shared.models.speculative import speculative_generate
from tests.unit import test_batched_decode as tbd
from tests.unit.test_batched_decode import LAYERS, NEW, assert_same, drafter, recording

target, prompts, stop, fitted = tbd.target, tbd.prompts, tbd.stop, tbd.fitted  # its module-scoped fixtures

pytestmark = pytest.mark.usefixtures("one_thread")


def run_static(target, prompts, stop, model, new=NEW):
    fam = get_family("dflash")
    bsz = fam.verify_block_size(model)
    one, many = {}, {}
    single = [speculative_generate(target, recording(fam.proposer(model, block_size=bsz), one, False), p, new, bsz,
                                   LAYERS, stop) for p in prompts]
    static = GraphedDFlash(fam.proposer(model, block_size=bsz), graphs=False)
    proposer = recording(static, many, True)
    batched = batched_speculative_generate(target, proposer, prompts, new, bsz, LAYERS, stop)
    assert_same(batched, single)
    assert one == many                  # every draft of every step, accepted or not
    return static, single


@pytest.mark.parametrize("perturbed", [False, True], ids=["untrained", "perturbed"])
def test_static_propose_equals_the_one_prompt_loop(target, prompts, stop, perturbed):
    _, model = drafter("dflash", perturbed)
    static, single = run_static(target, prompts, stop, model)
    assert any(r.stopped and len(r.tokens) < NEW for r in single)  # a row finished early and stayed in the buffers
    assert len(static.phys) == 0 and static.rows == len(prompts)


def test_fitted_static_propose_accepts_different_counts_and_grows_its_cache(target, prompts, stop, fitted):
    grown = []
    orig = GraphedDFlash._ensure_capacity

    def spy(self, need):
        before = self.capacity
        orig(self, need)
        if before and self.capacity != before:
            grown.append((before, self.capacity))

    GraphedDFlash._ensure_capacity = spy
    try:
        _, single = run_static(target, prompts, stop, fitted, new=160)
    finally:
        GraphedDFlash._ensure_capacity = orig
    lengths = {a for r in single for a in r.accept_lengths}
    assert len(lengths) >= 3 and max(lengths) >= 3, lengths
    assert grown and all(b >= 2 * a for a, b in grown), grown   # doubled mid-decode, the drafts unchanged


def test_graphs_need_cuda_and_cpu_keeps_the_eager_batched_form():
    fam, model = drafter("dflash", False)
    with pytest.raises(ValueError, match="needs a CUDA drafter"):
        GraphedDFlash(fam.proposer(model, block_size=6), graphs=True)
    assert type(batched_proposer(fam.proposer(model, block_size=6))) is BatchedDFlash


def test_a_context_that_skips_positions_is_refused(target, prompts):
    fam, model = drafter("dflash", False)
    static = GraphedDFlash(fam.proposer(model, block_size=6), graphs=False)
    static.reset(prompts[:2])
    width = model.fc.weight.shape[1]
    static.add_context([torch.zeros(3, width), torch.zeros(2, width)], [0, 1])
    with pytest.raises(ValueError, match="row 1's context at position 1 does not continue its cache of 0"):
        static.propose([list(range(4)), list(range(3))], 5)
