"""The PPO recipe's pieces that need no model (rlhf_dist/trainers/ppo/): the objectives
table, the loop's frozen progress and the frozen run."""

import dataclasses

import pytest

from rlhf_dist.algo import catalog
from rlhf_dist.trainers.ppo import recipe
from rlhf_dist.trainers.ppo.setup import PPORun
from rlhf_dist.trainers.ppo.state import Progress


def test_every_objective_of_its_own_has_an_iteration_and_the_estimators_run_ppos():
    assert set(recipe.OBJECTIVES) == set(catalog.OBJECTIVES)
    assert not set(recipe.OBJECTIVES) & set(catalog.ADVANTAGE_ESTIMATORS)
    assert set(catalog.ESTIMATORS) == set(catalog.ADVANTAGE_ESTIMATORS) | set(recipe.OBJECTIVES)


def test_progress_keeps_the_first_score_and_the_last_stats():
    start = Progress()
    first = start.after({"objective/score": 0.5, "objective/kl": 0.1})
    second = first.after({"objective/score": 0.9, "objective/kl": 0.2})
    assert (first.first_score, second.first_score) == (0.5, 0.5)
    assert second.stats == {"objective/score": 0.9, "objective/kl": 0.2}
    assert start == Progress()  # each step returns a new one
    resumed = Progress(first_score=-1.0).after({"objective/score": 3.0})
    assert resumed.first_score == -1.0


def test_the_run_and_the_progress_are_frozen():
    assert dataclasses.fields(PPORun)  # a dataclass
    with pytest.raises(dataclasses.FrozenInstanceError):
        Progress().first_score = 1.0  # type: ignore[misc]
    assert PPORun.__dataclass_params__.frozen  # type: ignore[attr-defined]
    assert "printed_first_batch" not in {f.name for f in dataclasses.fields(PPORun)}


def test_controllers_are_returned_new_and_checkpoint_as_before():
    from rlhf_dist.config import config_from_dict
    from rlhf_dist.trainers.ppo.controllers import Controllers

    tree = {"model": {"policy": "p"}, "data": {"train": "t.jsonl"}}
    tree["ppo"] = {"kl_controller": "adaptive", "kl_target": 1.0, "entropy_coef": 0.01}
    tree["ppo"] |= {"entropy_target": 2.0, "entropy_coef_lr": 0.01}
    start = Controllers.restored(config_from_dict(tree).ppo, None)
    before = start.state_dict()
    scored = start.with_scores(1.0, 4.0, 8.0)
    after = scored.after(3.0, 1.5, 16)
    assert start.state_dict() == before  # nothing changed in place
    assert scored.score_moments.state_dict() == {"mean": 1.0, "var": 4.0, "count": 8.0}
    assert after.kl.coef == start.kl.updated(3.0, 16).coef
    assert after.entropy.coef == pytest.approx(0.01 + 0.01 * (2.0 - 1.5))
    assert list(after.state_dict()) == ["kl_controller", "entropy_controller", "score_moments"]
    with pytest.raises(dataclasses.FrozenInstanceError):
        after.kl = start.kl  # type: ignore[misc]
