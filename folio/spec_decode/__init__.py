"""Speculative decoding, in one place: the proposers that draft a request's next tokens from what it
has seen (n-gram, suffix tree, lookahead, a draft model; `factory.py`), how many drafts each request
takes (`proposer.py`), which drafts the scheduler lets a step verify and the counts it keeps
(`scheduling.py`), and the target's verification of them in one forward (`verification.py`, with the
rejection sampler), so outputs are exactly the target's."""
