"""`folio bench spec`: speculative decoding's methods against none, offline and served."""
