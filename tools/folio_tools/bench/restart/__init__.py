"""`folio bench restart`: a long prompt's first token after a restart, with folio's disk KV tier."""
