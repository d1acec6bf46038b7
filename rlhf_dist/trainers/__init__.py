"""Short training loops (SFT, reward model, PPO) that call the library in order."""

from __future__ import annotations
