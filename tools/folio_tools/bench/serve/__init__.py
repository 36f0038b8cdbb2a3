"""`folio bench serve`: a streaming client for any OpenAI-compatible server; latency percentiles, goodput, cost."""
