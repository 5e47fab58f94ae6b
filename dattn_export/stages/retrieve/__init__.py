"""`dattn-export retrieve`: the released models' own job, temporal retrieval, over a benchmark of videos, on any
backend (job.py); what it answers (videos.py); vLLM's offline engine (engine.py) and its replicas on a Ray cluster
(replicas.py)."""

from .job import Summary, retrieve

__all__ = ["Summary", "retrieve"]
