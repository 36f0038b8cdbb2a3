"""How the server reaches an engine, wherever it runs: `EngineClient` (protocol.py), the one interface
route handlers see; `AsyncEngine` (thread.py), the engine loop on a thread of this process;
`ProcessEngine` (process.py), the same loop in a process of its own (process_main.py), over the
messages of wire.py; and the asyncio plumbing both share: one API call's requests (generation.py)
and the updates they stream back (updates.py)."""
