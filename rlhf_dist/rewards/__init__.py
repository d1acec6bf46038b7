"""Where a sequence's score comes from: a user's reward function (or several, weighted),
a reward model, a judge (a local LM or an OpenAI-compatible endpoint) or a remote HTTP
reward (`scoring`, `judge`, `remote`), with retries and timeouts (`retry`).
"""

from __future__ import annotations
