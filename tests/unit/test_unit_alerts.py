"""AlertMonitor: each alert fires when its condition holds, once, and not on healthy runs."""

import pytest

from rlhf_dist.config import AlertsConfig, ConfigError
from rlhf_dist.observability.alerts import AlertMonitor


def healthy(i: int) -> dict:
    return {
        "objective/score": 1.0 + 0.01 * i, "objective/kl": 0.1 * i, "objective/score_std": 1.0,
        "objective/entropy": 2.0, "rollout/length": 20.0, "policy/clipfrac": 0.05, "policy/approx_kl": 0.01,
    }  # fmt: skip


def names(alerts) -> set[str]:
    return {name for name, _ in alerts}


def test_healthy_run_raises_nothing():
    monitor = AlertMonitor(AlertsConfig())
    assert all(monitor.check(healthy(i)) == [] for i in range(50))


def test_each_condition_fires_once():
    monitor = AlertMonitor(AlertsConfig(window=3))
    monitor.check(healthy(0))
    bad = healthy(1) | {
        "objective/kl": 25.0, "rollout/length": 35.0, "objective/score_std": 0.1,
        "policy/clipfrac": 0.5, "policy/approx_kl": 0.5, "objective/entropy": 0.4,
    }  # fmt: skip
    fired = names(monitor.check(bad))
    expected = {
        "kl_high",
        "length_drift",
        "score_spread_collapse",
        "clipfrac_high",
        "approx_kl_high",
        "entropy_collapse",
    }
    assert fired == expected
    assert not names(monitor.check(bad)) & expected  # printed once, not every iteration


def test_score_rising_while_kl_grows_fast_is_flagged():
    # Hand case: window 3, KL 0 -> 1.5 -> 3.0: 1.5 nats/iteration > 1.0 while the score rises.
    monitor = AlertMonitor(AlertsConfig(window=3))
    for i, kl in enumerate((0.0, 1.5, 3.0)):
        fired = names(monitor.check(healthy(i) | {"objective/kl": kl, "objective/score": float(i)}))
    assert fired == {"score_up_kl_fast"}


def test_disabled_monitor_is_silent():
    monitor = AlertMonitor(AlertsConfig(enabled=False))
    assert monitor.check(healthy(0) | {"objective/kl": 1e9}) == []


def drifting(i: int) -> dict:
    """Length grows 10% per iteration, KL 1.5 nats/iteration while the score rises."""
    return healthy(i) | {"rollout/length": 20.0 * (1 + 0.1 * i), "objective/kl": 1.5 * i}


def fired_by_step(monitor, steps) -> dict[int, set[str]]:
    return {i: names(monitor.check(drifting(i))) for i in steps}


def test_state_round_trip_resumes_to_the_same_alerts(tmp_path):
    import torch

    cfg = AlertsConfig(window=3, length_drift=0.45, kl_max=4.0)
    uninterrupted = fired_by_step(AlertMonitor(cfg), range(10))
    assert uninterrupted[2] == {"score_up_kl_fast"} and uninterrupted[3] == {"kl_high"}
    assert uninterrupted[5] == {"length_drift"}  # +50% since iteration 0, not since resume

    first = AlertMonitor(cfg)
    before = fired_by_step(first, range(4))
    # Through a checkpoint file as train_ppo writes it (loaded with weights_only=True).
    torch.save({"alerts": first.state_dict()}, tmp_path / "trainer.pt")
    state = torch.load(tmp_path / "trainer.pt", weights_only=True)["alerts"]
    resumed = AlertMonitor(cfg)
    resumed.load_state_dict(state)
    assert resumed.state_dict() == first.state_dict()
    assert before | fired_by_step(resumed, range(4, 10)) == uninterrupted


def test_checkpoint_without_alert_state_is_a_config_error():
    with pytest.raises(ConfigError, match=r"^run\.resume: .*alerts\.enabled=false"):
        AlertMonitor(AlertsConfig()).load_state_dict(None)
    AlertMonitor(AlertsConfig(enabled=False)).load_state_dict(None)  # nothing to continue
