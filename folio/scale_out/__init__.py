"""Scale-out on Ray Serve: engine replicas behind one OpenAI-compatible endpoint (docs/scale-out.md).

`routing` is the cache-aware policy, pure Python; `request_router` plugs it into Ray Serve; `replica`
is one engine; `ingress` is the HTTP app that routes to them; `deploy` builds and runs the whole.
"""
