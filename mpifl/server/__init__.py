"""Rank 0, the server: the round loop (sampling, broadcast, gather, aggregation), the run log
(``metrics.jsonl``), the summaries and the progress line."""
