"""Reward-hacking and health alerts on PPO's logged statistics.

A rising mean score can hide a policy that is gaming the reward model: KL running away,
responses drifting in length, the score spread collapsing onto one exploit, entropy
collapsing, or updates so large that the trust region means nothing. Each alert fires at
most once per run (printed and logged under `alerts/<name>`); thresholds are config.
"""

from __future__ import annotations

from collections import deque

from rlhf_dist.config import AlertsConfig
from rlhf_dist.errors import ConfigError


class AlertMonitor:
    """Checks each iteration's stats (already reduced over ranks) against thresholds."""

    def __init__(self, cfg: AlertsConfig):
        self.cfg = cfg
        self.fired: set[str] = set()
        self.first: dict[str, float] = {}
        self.window_size = max(2, cfg.window)
        self.window: deque[tuple[float, float]] = deque(maxlen=self.window_size)

    def check(self, stats: dict) -> list[tuple[str, str]]:
        """New alerts for this iteration as (name, message); each name fires once."""
        if not self.cfg.enabled:
            return []
        for key in ("rollout/length", "objective/entropy", "objective/score_std"):
            if key in stats:
                self.first.setdefault(key, stats[key])
        self.window.append((stats.get("objective/score", 0.0), stats.get("objective/kl", 0.0)))
        found = [alert for alert in self._candidates(stats) if alert[0] not in self.fired]
        self.fired.update(name for name, _ in found)
        return found

    def state_dict(self) -> dict:
        """What later checks judge against, as plain data for the checkpoint: the first
        iteration's values ("since the start"), the trend window and the alerts already
        fired. A resumed run must raise exactly the alerts the uninterrupted run would."""
        return {
            "fired": sorted(self.fired),
            "first": dict(self.first),
            "window": [list(pair) for pair in self.window],
        }

    def load_state_dict(self, state: dict | None) -> None:
        """Continue from `state_dict()`'s output; None is a checkpoint written before alert
        state was saved, which cannot continue the same baseline."""
        if state is None:
            if self.cfg.enabled:
                raise ConfigError(
                    "run.resume: the checkpoint has no alert state (written by an older "
                    "rlhf_dist); resume it with alerts.enabled=false"
                )
            return
        self.fired = set(state["fired"])
        self.first = dict(state["first"])
        self.window.clear()
        self.window.extend(tuple(pair) for pair in state["window"])

    def _candidates(self, s: dict) -> list[tuple[str, str]]:
        """Every alert whose condition holds now, as (name, message)."""
        c = self.cfg
        kl, clipfrac, approx_kl = (
            s.get(k, 0.0) for k in ("objective/kl", "policy/clipfrac", "policy/approx_kl")
        )
        length = self._relative_change("rollout/length", s)
        spread = self._relative_change("objective/score_std", s)
        entropy = self._relative_change("objective/entropy", s)
        checks = [
            (
                "kl_high",
                kl > c.kl_max,
                f"KL to the reference {kl:.2f} nats > {c.kl_max} (alerts.kl_max)",
            ),
            (
                "length_drift",
                length is not None and abs(length) > c.length_drift,
                f"mean response length changed by {length or 0:+.0%} since the start (alerts.length_drift)",
            ),
            (
                "score_up_kl_fast",
                self._score_and_kl_rising(),
                f"score rising while KL grows {self._kl_rate():.2f} nats/iteration (alerts.kl_rise_per_iteration): possible reward hacking",
            ),
            (
                "score_spread_collapse",
                spread is not None and spread < -c.score_std_collapse,
                f"score std fell {-(spread or 0):.0%} since the start (alerts.score_std_collapse): responses converging on one pattern",
            ),
            (
                "clipfrac_high",
                clipfrac > c.clipfrac_max,
                f"clipfrac {clipfrac:.2f} > {c.clipfrac_max} (alerts.clipfrac_max): updates too large",
            ),
            (
                "approx_kl_high",
                approx_kl > c.approx_kl_max,
                f"approx_kl {approx_kl:.3f} > {c.approx_kl_max} (alerts.approx_kl_max): policy moves too far per iteration",
            ),
            (
                "entropy_collapse",
                entropy is not None and entropy < -c.entropy_collapse,
                f"entropy fell {-(entropy or 0):.0%} since the start (alerts.entropy_collapse)",
            ),
        ]
        return [(name, message) for name, fired, message in checks if fired]

    def _kl_rate(self) -> float:
        """Mean KL growth per iteration over the window."""
        return (self.window[-1][1] - self.window[0][1]) / max(len(self.window) - 1, 1)

    def _relative_change(self, key: str, s: dict) -> float | None:
        """s[key] relative to its first logged value (0.1: 10% up); None when either is
        missing or the first is 0."""
        start = self.first.get(key)
        if key not in s or not start:
            return None
        return s[key] / start - 1.0

    def _score_and_kl_rising(self) -> bool:
        """Over a full window: the score went up while KL grew faster than
        alerts.kl_rise_per_iteration (the pattern of reward hacking)."""
        if len(self.window) < self.window_size:
            return False
        return (
            self.window[-1][0] > self.window[0][0]
            and self._kl_rate() > self.cfg.kl_rise_per_iteration
        )
