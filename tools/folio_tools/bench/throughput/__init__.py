"""`folio bench throughput`: offline throughput, every request at once, beside transformers."""
