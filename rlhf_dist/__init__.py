"""rlhf_dist: RLHF (SFT -> Bradley-Terry reward model -> PPO) on Accelerate + DeepSpeed."""

__version__ = "0.1.0"
