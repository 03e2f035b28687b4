"""The causal BlockMask built from block indices (``flex.causal_block_mask``) against ``create_block_mask`` of the
causal mask_mod, which evaluates every (query, key) pair: every field equal at lengths below, at and between blocks
of 128, built without a (T, T) mask, cached per (T, device), and compiled Flex on CPU giving the same output with
either mask (and the causal softmax's)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.attention.flex_attention as torch_flex

from posbench.attention import flex

pytestmark = pytest.mark.skipif(flex.flex_attention is None, reason="FlexAttention needs torch >= 2.5")

LENGTHS = [1, 5, 16, 127, 128, 129, 200, 256, 1000, 2048]
CPU = torch.device("cpu")


def dense_built(T: int):
    return flex.create_block_mask(flex._causal, None, None, T, T, device=CPU)


def assert_same_rows(num, indices, want_num, want_indices):
    """The same number of blocks per row, and the same blocks in the same order up to it (the entries past it are
    padding that Flex never reads)."""
    assert num.dtype == want_num.dtype == indices.dtype == want_indices.dtype == torch.int32
    assert num.shape == want_num.shape and indices.shape == want_indices.shape
    assert torch.equal(num, want_num)
    for row, count in enumerate(want_num.flatten().tolist()):
        got, want = indices.flatten(0, -2)[row], want_indices.flatten(0, -2)[row]
        assert torch.equal(got[:count], want[:count]), (row, got, want)


@pytest.mark.parametrize("T", LENGTHS)
def test_every_field_equals_create_block_masks(T):
    got, want = flex.causal_block_mask(T, CPU), dense_built(T)
    for prefix in ("", "full_"):
        for side in ("kv", "q"):  # kv: the rows of query blocks; q: the transposed ones (Flex's backward)
            assert_same_rows(getattr(got, f"{prefix}{side}_num_blocks"), getattr(got, f"{prefix}{side}_indices"),
                             getattr(want, f"{prefix}{side}_num_blocks"), getattr(want, f"{prefix}{side}_indices"))
    assert got.seq_lengths == want.seq_lengths == (T, T)
    assert got.BLOCK_SIZE == want.BLOCK_SIZE == (128, 128)
    assert got.mask_mod is flex._causal
    assert got.to_dense().dtype == want.to_dense().dtype and torch.equal(got.to_dense(), want.to_dense())
    n = -(-T // 128)
    assert got.kv_indices.shape == (1, 1, n, n)


@pytest.mark.parametrize("T", [127, 128, 200, 256])
def test_partial_blocks_on_the_diagonal_full_blocks_below(T):
    """By hand: a row of 128 queries below T is partial on its diagonal block and full to its left; a last row cut
    short by T is partial up to the diagonal, with no full block (create_block_mask pads the mask with False)."""
    num, indices, full_num, full_indices = flex.causal_kv_blocks(T, CPU)
    n = -(-T // 128)
    for i in range(n):
        partial, full = indices[0, 0, i, :num[0, 0, i]].tolist(), full_indices[0, 0, i, :full_num[0, 0, i]].tolist()
        if (i + 1) * 128 <= T:
            assert (partial, full) == ([i], list(range(i))), i
        else:
            assert (partial, full) == (list(range(i + 1)), []), i


def test_built_without_a_dense_mask_and_cached(monkeypatch):
    """No (T, T) mask (create_block_mask and create_mask are not called): at T = 65,536 (n = 512 blocks) it takes
    O(n²) integers; the same object comes back for the same (T, device), a new one for another T."""
    def dense(*args, **kwargs):
        raise AssertionError("the causal BlockMask evaluated the dense mask")

    monkeypatch.setattr(flex, "create_block_mask", dense)
    monkeypatch.setattr(torch_flex, "create_block_mask", dense)
    monkeypatch.setattr(torch_flex, "create_mask", dense)
    flex._block_masks.clear()
    big = flex.causal_block_mask(65536, CPU)
    assert big.kv_num_blocks.shape == (1, 1, 512) and big.full_kv_num_blocks[0, 0, -1] == 511
    assert flex.causal_block_mask(65536, CPU) is big and flex.causal_block_mask(256, CPU) is not big
    assert set(flex._block_masks) == {(65536, "cpu"), (256, "cpu")}
    flex._block_masks.clear()


@pytest.mark.parametrize("T", [5, 129, 200])
def test_compiled_flex_gives_the_same_output_with_either_mask(T):
    """Compiled Flex on CPU, at T + ``flex.cpu_padding(T)`` tokens as posbench runs it (5 → 16): the same output with
    the direct mask as with create_block_mask's, and the causal softmax's (float64 reference). A full block where a
    partial one belongs would let queries see later keys; a missing block would drop earlier ones."""
    T = T + flex.cpu_padding(T)
    g = torch.Generator().manual_seed(T)
    q, k, v = (torch.randn(1, 2, T, 8, generator=g) for _ in range(3))  # (B, H, T, Dh)
    flex.reset_compiled()
    try:
        with torch.no_grad():
            want = flex.run(q, k, v, None, dense_built(T), None)
    except Exception as err:  # noqa: BLE001 - any compiler failure means: not here
        pytest.skip(f"compiled FlexAttention does not run on this CPU: {type(err).__name__}: {str(err)[:200]}")
    try:
        with torch.no_grad():
            got = flex.run(q, k, v, None, flex.causal_block_mask(T, CPU), None)
    finally:
        flex.reset_compiled()
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    scores = (q.double() @ k.double().transpose(-2, -1)) / 8**0.5  # (1, 2, T, T)
    scores = scores.masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), float("-inf"))
    torch.testing.assert_close(got.double(), scores.softmax(-1) @ v.double(), rtol=1e-5, atol=1e-5)
