"""Quality measurements: perplexity on held-out text (and, later, agreement with a reference)."""
