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
