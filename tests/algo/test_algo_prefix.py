"""algo/prefix.py: the distinct prompts of a batch and where each row went."""

import torch

from rlhf_dist.algo.prefix import unique_prompts


def test_hand_case_groups_rows_by_ids_and_mask():
    # Rows 0, 1 and 3 are one prompt; row 2 has the same ids as them but one more real
    # token (PAD == EOS: id 0 is both), so it is a prompt of its own.
    ids = torch.tensor([[0, 5, 6], [0, 5, 6], [0, 5, 6], [0, 5, 6], [7, 8, 9]])
    mask = torch.tensor([[0, 1, 1], [0, 1, 1], [1, 1, 1], [0, 1, 1], [1, 1, 1]])
    u_ids, u_mask, inverse = unique_prompts(ids, mask)
    assert u_ids.shape == (3, 3) and u_mask.dtype == mask.dtype
    assert inverse[0] == inverse[1] == inverse[3] != inverse[2]
    assert len({int(i) for i in inverse}) == 3
    assert torch.equal(u_ids[inverse], ids) and torch.equal(u_mask[inverse], mask)


def test_property_inverse_rebuilds_the_batch_and_counts_distinct_rows():
    g = torch.Generator().manual_seed(0)
    for _ in range(50):
        U, n, P = (int(x) for x in torch.randint(1, 6, (3,), generator=g))
        base = torch.randint(0, 3, (U, P), generator=g)
        lengths = torch.randint(1, P + 1, (U,), generator=g)
        base_mask = (torch.arange(P) >= P - lengths[:, None]).to(torch.bool)
        order = torch.randperm(U * n, generator=g) % U  # each prompt n times, shuffled
        ids, mask = base[order], base_mask[order]
        u_ids, u_mask, inverse = unique_prompts(ids, mask)
        assert torch.equal(u_ids[inverse], ids) and torch.equal(u_mask[inverse], mask)
        pairs = {(tuple(r.tolist()), tuple(m.tolist())) for r, m in zip(ids, mask)}
        assert u_ids.shape[0] == len(pairs) <= U
        assert u_ids.dtype == ids.dtype and u_mask.dtype == torch.bool
