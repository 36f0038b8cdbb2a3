"""folio's tools: benchmarks and their peers, quality evaluations, offline quantizers, kv-calc and
the result files they write. They use the runtime (`folio`); the runtime never imports them."""
