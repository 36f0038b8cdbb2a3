"""Speculative decoding proposers: each drafts the next tokens of a request from what it has seen; the
target model verifies the drafts in one forward (folio/sample/rejection_sampler.py), so outputs are
exactly the target's."""
