"""`folio bench serve-compare`: the same workload on folio serve, then on a peer server."""
