"""llama.cpp as a benchmark peer, from the command line: build `llama-server` and `llama-bench` (see
llama_cpp_build) and run llama-server in the foreground (see llama_cpp_server).

    python -m folio_tools.bench.peers.llama_cpp build                        # once: 6-17 min on 2 cores
    python -m folio_tools.bench.peers.llama_cpp serve smollm2-135m --port 8080 --parallel 4
"""

from __future__ import annotations

import argparse
import signal
import sys
from collections.abc import Sequence

from folio.loaders.catalog import resolve_model
from folio.platform import default_threads
from folio_tools.bench.peers.llama_cpp_build import PACKAGE, LlamaCppBuildError, build_llama_cpp
from folio_tools.bench.peers.llama_cpp_server import start_llama_server, stop_process


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m folio_tools.bench.peers.llama_cpp",
        description="llama.cpp as a benchmark peer: build llama-server and llama-bench, or run llama-server.",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    build = sub.add_parser("build", help="build llama-server and llama-bench (once) and print their paths")
    serve = sub.add_parser(
        "serve",
        help="run llama-server in the foreground",
        description="Run llama-server in the foreground. --ctx-size is the KV cache's total size in tokens; "
        "llama-server splits it evenly across the --parallel slots, so one request gets at most ctx-size/parallel "
        "tokens (prompt plus output) unless -- --kv-unified is given.",
        epilog="Flags after -- go to llama-server as they are, e.g. -- --kv-unified --metrics",
    )
    for p in (build, serve):
        p.add_argument("--version", help=f"{PACKAGE} version (default: the installed build, else PyPI's latest)")
    serve.add_argument("model", help="a .gguf file or a catalog name such as smollm2-135m")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8080)
    serve.add_argument("--parallel", type=int, default=4, help="slots, i.e. requests decoded together (default 4)")
    serve.add_argument("--ctx-size", type=int, default=None, help="total KV tokens over all slots (default 2048 each)")
    serve.add_argument("--threads", type=int, default=default_threads())
    # Everything after `--` goes to llama-server untouched (argparse's REMAINDER would also eat our own flags).
    argv = list(sys.argv[1:] if argv is None else argv)
    split = argv.index("--") if "--" in argv else len(argv)
    args, extra = parser.parse_args(argv[:split]), argv[split + 1 :]

    try:
        binaries = build_llama_cpp(version=args.version)
    except LlamaCppBuildError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    if args.command == "build":
        print(f"version  {binaries.version} (llama.cpp {binaries.commit})")
        print(f"server   {binaries.server}")
        print(f"bench    {binaries.bench}")
        return 0

    model = resolve_model(args.model)
    if model.suffix.lower() != ".gguf":
        print(f"error: llama.cpp needs a .gguf file, not {model}", file=sys.stderr)
        return 1
    process = start_llama_server(
        binaries,
        model,
        args.port,
        ctx_size=args.ctx_size or 2048 * args.parallel,
        parallel=args.parallel,
        threads=args.threads,
        host=args.host,
        extra_args=extra,
    )

    def on_sigterm(signum: int, frame: object) -> None:
        raise KeyboardInterrupt  # so that killing this wrapper stops llama-server too instead of orphaning it

    previous = signal.signal(signal.SIGTERM, on_sigterm)
    try:
        return process.wait()
    except KeyboardInterrupt:
        return 130
    finally:
        stop_process(process)
        signal.signal(signal.SIGTERM, previous)


if __name__ == "__main__":
    raise SystemExit(main())
