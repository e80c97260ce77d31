"""The reference workload on the CPU (SDPA path): what padded replay relies on."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")


@pytest.fixture(scope="module")
def model():
    from capture_plan.references.decode import ReferenceConfig, ReferenceModel
    from capture_plan.schemas.spec import Model

    shape = Model(layers=2, hidden=256, heads=4, kv_heads=2, head_dim=64, intermediate=512, vocab=1000)
    return ReferenceModel(ReferenceConfig(model=shape, max_bs=8, max_seqlen=32), backend="torch", device="cpu")


@pytest.mark.parametrize("phase,tpr", [("decode", 1), ("target_verify", 4)])
def test_padding_leaves_the_real_requests_unchanged(model, phase, tpr):
    """A batch of n padded to bs gives the same rows for the n real requests:
    the executor replays the graph of the padded size and slices."""
    gen = torch.Generator()
    gen.manual_seed(3)
    model.prepare(phase, 8, 8, gen)
    padded = model.run(phase, 8, None)
    alone = model.run(phase, 3, None)
    assert padded.shape == (8 * tpr, 1000) and padded.dtype == torch.float32
    assert torch.isfinite(padded).all()
    torch.testing.assert_close(padded[: 3 * tpr], alone, rtol=2e-2, atol=2e-2)


def test_prepare_keeps_every_phase_inside_the_kv_cache(model):
    gen = torch.Generator()
    for seed in range(20):
        gen.manual_seed(seed)
        model.prepare("decode", 8, 8, gen)
        assert int(model.cache_seqlens.max()) + 4 <= model.cfg.max_seqlen  # room for target_verify's 4 tokens


def test_weights_in_their_own_segments_are_the_same_weights():
    """``own_segments`` changes where the draws live, not what they are: every weight and
    cache tensor is bit-for-bit the one the cast-into-a-new-tensor path makes (the benches
    that compare against engines' free-memory readings use it; the rest keep the old path)."""
    from capture_plan.references.decode import ReferenceConfig, ReferenceModel
    from capture_plan.schemas.spec import Model

    shape = Model(layers=2, hidden=64, heads=4, kv_heads=2, head_dim=16, intermediate=128, vocab=97)
    cfgs = [ReferenceConfig(model=shape, max_bs=4, max_seqlen=16, own_segments=own) for own in (False, True)]
    old, new = (ReferenceModel(c, backend="torch", device="cpu") for c in cfgs)
    assert torch.equal(old.embed, new.embed) and torch.equal(old.lm_head, new.lm_head)
    for a, b in zip(old.layers, new.layers, strict=True):
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) and a[k].dtype == b[k].dtype for k in a)
