"""Pure tensor math of RLHF. Imports torch only: no transformers, accelerate or deepspeed.

Conventions (docs/architecture.md section 3): B batch, T response length, `response_mask` (B, T) bool
with True on real response tokens. Every function returns new tensors and never modifies
its inputs. Import the submodules (`rlhf_dist.algo.losses`, ...); this package imports
nothing, so `rlhf_dist.algo.catalog` (the registries' names) stays torch-free.
"""
