"""Structured output: outputs constrained to a JSON schema, a regex, a list of choices or a grammar,
enforced during sampling by llguidance token masks."""
