"""What a run shows: the run directory's files and trackers (`tracking`), health alerts
(`alerts`), reward-model diagnostics (`diagnostics`) and the HTML report (`report`).
"""

from __future__ import annotations
