"""AlertMonitor: each alert fires when its condition holds, once, and not on healthy runs."""

from rlhf_dist.alerts import AlertMonitor
from rlhf_dist.config import AlertsConfig


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
