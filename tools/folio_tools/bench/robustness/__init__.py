"""`folio bench fuzz`, `overload` and `stall`: hostile and heavy traffic; only 2xx/4xx, only 200/429, and
the loop's latency while bodies are refused."""
