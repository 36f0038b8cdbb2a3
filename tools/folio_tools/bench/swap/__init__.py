"""`folio bench swap`: a model loaded on demand, against llama-server's router mode."""
