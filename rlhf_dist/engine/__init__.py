"""How fast: the speed paths behind the computations the recipes name.

The rollout and the trainers say *what* is computed (sample responses, score log-probs,
take a clipped step); this package holds *how* it runs fast: the KV-cache decode loop and
its sampler (`decode`, `sampling`), the chunked output head and the sequence log-prob
forward with shared prompts (`forward`), padding-free packed rows (`packing`), and
CPU-specific kernels and process settings (`cpu`). Each speed path has a `perf.*`
switch (docs/architecture.md section 10); switched off, the plain reference computation
runs and gives the same results within the tolerance its test states.
"""

from __future__ import annotations
