"""rlhf_dist.algo.policy_losses: one signature for every policy loss, registered by the
names catalog.POLICY_LOSSES declares; the registries are built from algo.catalog."""

import pytest
import torch

from rlhf_dist.algo import catalog
from rlhf_dist.algo.estimators import ESTIMATORS
from rlhf_dist.algo.objectives import sequence_log_ratio
from rlhf_dist.algo.policy_losses import (
    POLICY_LOSSES,
    PolicyLossInputs,
    cispo_terms,
    policy_loss_terms,
    ppo_policy_terms,
)


def inputs(seed: int = 0, **knobs) -> PolicyLossInputs:
    g = torch.Generator().manual_seed(seed)
    lp = -torch.rand(3, 4, generator=g)
    return PolicyLossInputs(
        logprobs=lp,
        old_logprobs=lp - 0.5 * torch.randn(3, 4, generator=g),
        advantages=torch.randn(3, 4, generator=g),
        **knobs,
    )


def test_hand_computed_clip_loss():
    # ratio e^0.5 = 1.6487 > 1.2 with A = 1: the clipped branch -1.2 is the larger loss;
    # ratio e^-0.5 = 0.6065 < 0.8 with A = -1: clipped 0.8 > 0.6065 wins; A = 0: 0.
    x = PolicyLossInputs(
        logprobs=torch.tensor([[0.0, 0.0, 0.0]]),
        old_logprobs=torch.tensor([[-0.5, 0.5, 0.0]]),
        advantages=torch.tensor([[1.0, -1.0, 0.0]]),
        clip_eps_low=0.2,
    )
    terms = policy_loss_terms("clip", x)
    torch.testing.assert_close(terms["loss"], torch.tensor([[-1.2, 0.8, 0.0]]))
    assert terms["clipped"].tolist() == [[1.0, 1.0, 0.0]]
    assert terms["approx_kl"].tolist() == [[0.125, 0.125, 0.0]]


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("sequence", [False, True])
def test_each_entry_is_its_algo_function(seed, sequence):
    x = inputs(seed, clip_eps_low=0.2, clip_eps_high=0.28, dual_clip=3.0)
    mask = torch.ones_like(x.logprobs, dtype=torch.bool)
    log_ratio = sequence_log_ratio(x.logprobs, x.old_logprobs, mask) if sequence else None
    x = PolicyLossInputs(**{**x.__dict__, "log_ratio": log_ratio})
    clip = ppo_policy_terms(x.logprobs, x.old_logprobs, x.advantages, 0.2, 0.28, 3.0, log_ratio)
    cispo = cispo_terms(x.logprobs, x.old_logprobs, x.advantages, 0.2, 0.28, log_ratio)
    for name, want in (("clip", clip), ("cispo", cispo)):
        got = policy_loss_terms(name, x)
        assert got.keys() == want.keys()
        for k in got:
            assert torch.equal(got[k], want[k]), (name, k)


def test_no_clip_eps_means_no_clipping():
    x = inputs(1, clip_eps_low=None)
    assert float(policy_loss_terms("clip", x)["clipped"].sum()) == 0.0
    assert float(policy_loss_terms("cispo", x)["clipped"].sum()) == 0.0
    ratio = torch.exp(x.logprobs - x.old_logprobs)
    torch.testing.assert_close(policy_loss_terms("clip", x)["loss"], -x.advantages * ratio)


def test_registries_hold_exactly_the_catalogs_names():
    assert tuple(POLICY_LOSSES) == catalog.POLICY_LOSSES
    assert tuple(ESTIMATORS) == tuple(catalog.ADVANTAGE_ESTIMATORS)
    for name, entry in ESTIMATORS.items():
        assert entry.traits == catalog.ESTIMATORS[name]
    with pytest.raises(ValueError, match="policy loss must be one of"):
        policy_loss_terms("ppo2", inputs())


def test_a_registry_refuses_a_name_without_a_function_and_the_reverse():
    declared = catalog.Registry(("a", "b"))
    declared.register("a")(print)
    with pytest.raises(ValueError, match=r"no function for \['b'\]"):
        declared.complete()
    with pytest.raises(ValueError, match=r"'c' is undeclared or registered twice"):
        declared.register("c")(print)
    with pytest.raises(ValueError, match=r"'a' is undeclared or registered twice"):
        declared.register("a")(len)
    entries = catalog.Registry({"b": 2, "a": 1})
    assert entries.register("a")(print) is print  # the function itself, undecorated
    entries.register("b")(len)
    assert list(entries.complete().items()) == [("b", (len, 2)), ("a", (print, 1))]
