"""Reward-hacking and health alerts on PPO's logged statistics.

A rising mean score can hide a policy that is gaming the reward model: KL running away,
responses drifting in length, the score spread collapsing onto one exploit, entropy
collapsing, or updates so large that the trust region means nothing. Each alert fires at
most once per run (printed and logged under `alerts/<name>`); thresholds are config.
"""

from __future__ import annotations

from collections import deque


class AlertMonitor:
    """Checks each iteration's stats (already reduced over ranks) against thresholds."""

    def __init__(self, cfg):
        self.cfg = cfg
        self.fired: set[str] = set()
        self.first: dict[str, float] = {}
        self.window: deque = deque(maxlen=max(2, cfg.window))

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

    def _candidates(self, s: dict) -> list[tuple[str, str]]:
        c, out = self.cfg, []
        kl, clipfrac, approx_kl = (
            s.get("objective/kl", 0.0),
            s.get("policy/clipfrac", 0.0),
            s.get("policy/approx_kl", 0.0),
        )
        if kl > c.kl_max:
            out.append(
                ("kl_high", f"KL to the reference {kl:.2f} nats > {c.kl_max} (alerts.kl_max)")
            )
        drift = self._relative_change("rollout/length", s)
        if drift is not None and abs(drift) > c.length_drift:
            out.append(
                (
                    "length_drift",
                    f"mean response length changed by {drift:+.0%} since the start (alerts.length_drift)",
                )
            )
        if self._score_and_kl_rising():
            rate = (self.window[-1][1] - self.window[0][1]) / (len(self.window) - 1)
            out.append(
                (
                    "score_up_kl_fast",
                    f"score rising while KL grows {rate:.2f} nats/iteration (alerts.kl_rise_per_iteration): possible reward hacking",
                )
            )
        spread = self._relative_change("objective/score_std", s)
        if spread is not None and spread < -c.score_std_collapse:
            out.append(
                (
                    "score_spread_collapse",
                    f"score std fell {-spread:.0%} since the start (alerts.score_std_collapse): responses converging on one pattern",
                )
            )
        if clipfrac > c.clipfrac_max:
            out.append(
                (
                    "clipfrac_high",
                    f"clipfrac {clipfrac:.2f} > {c.clipfrac_max} (alerts.clipfrac_max): updates too large",
                )
            )
        if approx_kl > c.approx_kl_max:
            out.append(
                (
                    "approx_kl_high",
                    f"approx_kl {approx_kl:.3f} > {c.approx_kl_max} (alerts.approx_kl_max): policy moves too far per iteration",
                )
            )
        entropy = self._relative_change("objective/entropy", s)
        if entropy is not None and entropy < -c.entropy_collapse:
            out.append(
                (
                    "entropy_collapse",
                    f"entropy fell {-entropy:.0%} since the start (alerts.entropy_collapse)",
                )
            )
        return out

    def _relative_change(self, key: str, s: dict) -> float | None:
        start = self.first.get(key)
        if key not in s or not start:
            return None
        return s[key] / start - 1.0

    def _score_and_kl_rising(self) -> bool:
        if len(self.window) < self.window.maxlen:
            return False
        (score0, kl0), (score1, kl1) = self.window[0], self.window[-1]
        rate = (kl1 - kl0) / (len(self.window) - 1)
        return score1 > score0 and rate > self.cfg.kl_rise_per_iteration
