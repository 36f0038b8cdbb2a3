"""How a server of several models starts its engines fast: an engine process started ahead (its torch and
folio imports, seconds of a load, done while nothing waits), and each model's tokenizer kept from its
first load, so that a model loaded again is not sent its tokenizer over the socket (for a 262k-token
vocabulary, over two seconds of pickling on both sides).

A spare process costs an idle interpreter's memory (a few hundred MiB) while it waits; `spare=False`
starts every engine from nothing.
"""

from __future__ import annotations

import contextlib
import threading
from concurrent.futures import Executor
from pathlib import Path

from folio.engine_args import EngineArgs
from folio.loaders.catalog import CATALOG, list_pulled
from folio.loaders.tokenizer import Tokenizer
from folio.server.engine_client.process import EngineProcess, ProcessEngine

# What a model folder's tokenizer is read from; a .gguf file holds its own.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "config.json",
                   "generation_config.json")  # fmt: skip

TokenizerKey = tuple[str, tuple[tuple[str, int, int], ...]]


def tokenizer_key(spec: str) -> TokenizerKey | None:
    """The files a model's tokenizer comes from, with their versions; None where they are not on this
    machine (a catalog model not pulled, a hub name)."""
    if spec in CATALOG:
        path = next((m.path for m in list_pulled() if m.name == spec), None)
    else:
        path = None if spec.startswith("hf:") else Path(spec).expanduser()
    if path is None or not path.exists():
        return None
    files = [path / name for name in TOKENIZER_FILES] if path.is_dir() else [path]
    versions = tuple((f.name, (st := f.stat()).st_mtime_ns, st.st_size) for f in files if f.is_file())
    return str(path.resolve()), versions


class EngineStarter:
    def __init__(self, threads: Executor, cancel: threading.Event, spare: bool = True) -> None:
        self._threads = threads
        self._cancel = cancel
        self._spare_wanted = spare
        self._spare: EngineProcess | None = None
        self._lock = threading.Lock()
        self._tokenizers: dict[TokenizerKey, Tokenizer] = {}

    def start(self, args: EngineArgs, name: str) -> ProcessEngine:
        """The engine of `args`' model, loaded (blocking: call it on a thread); the next spare is started."""
        key = tokenizer_key(args.model)
        tokenizer = self._tokenizers.get(key) if key is not None else None
        try:
            engine = ProcessEngine(args, name, cancel=self._cancel, started=self._take_spare(), tokenizer=tokenizer)
        finally:
            self.start_spare()  # after the load, not beside it: its imports would slow the load down
        if key is not None and tokenizer is None and engine.info.tokenizer is not None:
            self._tokenizers[key] = engine.info.tokenizer
        return engine

    def start_spare(self) -> None:
        """Start the spare process on a thread, if none is there (or coming)."""
        if self._spare_wanted and not self._cancel.is_set():
            with contextlib.suppress(RuntimeError):  # the threads have shut down: the server is stopping
                self._threads.submit(self._make_spare)

    def stop(self) -> None:
        """Stop the spare (the server is stopping: `cancel` is set, so none is made after this)."""
        spare = self._take_spare()
        if spare is not None:
            spare.stop()

    def _take_spare(self) -> EngineProcess | None:
        with self._lock:
            spare, self._spare = self._spare, None
        if spare is not None and not spare.process.is_alive():  # it died waiting (killed): start afresh
            spare.stop()
            return None
        return spare

    def _make_spare(self) -> None:
        with self._lock:
            if self._spare is not None or self._cancel.is_set():
                return
        spare = EngineProcess()
        with self._lock:
            if self._spare is None and not self._cancel.is_set():
                self._spare = spare
                return
        spare.stop()  # another thread's spare got there first, or the server is stopping
