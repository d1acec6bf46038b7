"""Rows and batches: loading and tokenising data files (`rows`), chat templates and stop
tokens (`chat`), batch sizes and seed-determined batch order (`batching`), and Python
objects standing for config keys (`inputs`).
"""

from __future__ import annotations
