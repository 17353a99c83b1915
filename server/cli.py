"""``unipage-serve``: serve a model and its LoRA adapters over ZeroMQ (docs/protocol.md).

    unipage-serve --model DIR [--adapter NAME=DIR ...] [--adapter-root DIR ...]
                  [--bind tcp://127.0.0.1:5555] [--device cpu|cuda] [pool, LoRA, scheduler, server options]

Clients: `unipage.server.Client` / `AsyncClient`, or any ZeroMQ DEALER
speaking the protocol.  SIGINT or SIGTERM stops it gracefully: new requests
are refused, live ones finish (or are aborted after --drain-timeout-s), and
each gets its reply; then the engine is closed (its shared memory and
reader processes go).  A SIGTERM during start-up closes what was built and
exits.  Exit codes: 0 after a clean stop; 2 bad options or files, or an
endpoint already taken, with a message; 143 after a SIGTERM during start-up.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import logging
import os
import signal
import sys

from unipage.server.config import ServerConfig
from unipage.server.options import add_config_options, pick

log = logging.getLogger("unipage.server")


def _adapter(text: str) -> tuple[str, str]:
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(f"expected NAME=DIR, got {text!r}")
    return name, path


def build_parser() -> argparse.ArgumentParser:
    from unipage.scheduler import SchedulerConfig

    from unipage.config import LoRAConfig, PoolConfig

    parser = argparse.ArgumentParser(prog="unipage-serve", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="Hugging Face model directory (config.json + safetensors, optional "
                        "tokenizer.json); without it, the built-in demo model and adapters are served")
    parser.add_argument("--adapter", action="append", type=_adapter, default=[], metavar="NAME=DIR",
                        help="a PEFT adapter directory to serve under NAME (repeatable)")
    parser.add_argument("--adapter-root", action="append", default=[], metavar="DIR",
                        help="a directory LoadAdapter may read adapters from (repeatable); without one, "
                        "adapters cannot be loaded at run time")
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    parser.add_argument("--dtype", default=None, help="bfloat16, float16 or float32 (default: the checkpoint's)")
    parser.add_argument("--kernels", default=None, choices=("torch", "triton"),
                        help="force the torch reference kernels or Triton (default: torch on CPU, Triton on CUDA)")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    parser.add_argument("--ready-file", default=None, help="once listening, write the bound endpoint here "
                        "(useful with --bind tcp://127.0.0.1:*)")
    parser.add_argument("--log-level", default="INFO", help="DEBUG, INFO, WARNING or ERROR (default: INFO)")
    groups = {
        "pool": add_config_options(parser, PoolConfig, "pool"),
        "lora": add_config_options(parser, LoRAConfig, "adapters", skip=("adapter_roots",)),
        "scheduler": add_config_options(parser, SchedulerConfig, "scheduler"),
        "server": add_config_options(parser, ServerConfig, "server", skip=("adapter_roots",)),
    }
    parser.set_defaults(_groups=groups)
    return parser


def build_backend(args: argparse.Namespace):
    """The engine (and tokenizer) the options describe, as an `EngineBackend`."""
    import torch
    from unipage.scheduler import SchedulerConfig
    from unipage.server.backend import EngineBackend

    from unipage.config import LoRAConfig, ModelConfig, PoolConfig
    from unipage.engine import Engine, default_pool
    from unipage.llm import Tokenizer
    from unipage.models.weights import read_config

    if args.threads:
        torch.set_num_threads(args.threads)
    groups = args._groups
    model_dir = os.path.realpath(args.model)
    hf = read_config(model_dir)
    pool_options = pick(args, groups["pool"])
    pool = None
    if "num_pages" in pool_options or "memory_bytes" in pool_options:
        pool = PoolConfig(**pool_options)
    elif pool_options:  # the default size for this model and device, with the options given
        device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
        base = default_pool(ModelConfig.from_hf(hf, args.dtype), device, pool_options.get("block_tokens", 16))
        pool = dataclasses.replace(base, **pool_options)
    roots = tuple(args.adapter_root)
    if roots:  # the adapters named at start-up are allowed wherever they are
        roots += tuple(path for _, path in args.adapter)
    lora = LoRAConfig(**pick(args, groups["lora"]), adapter_roots=roots)
    sched = pick(args, groups["scheduler"])
    sched.setdefault("max_model_len", min(int(hf.get("max_position_embeddings") or 4096), 8192))
    engine = Engine(model_dir, device=args.device, dtype=args.dtype, pool=pool, lora=lora,
                    scheduler=SchedulerConfig(**sched), kernels=args.kernels)
    try:
        for name, path in args.adapter:
            engine.add_adapter(name, path)
        has_tokenizer = os.path.exists(os.path.join(model_dir, "tokenizer.json"))
        tokenizer = Tokenizer(model_dir, engine.hf_config) if has_tokenizer else None
    except BaseException:  # no backend to close: release the engine here
        engine.close()
        raise
    return EngineBackend(engine, tokenizer, getattr(args, "served_name", None) or os.path.basename(model_dir))


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=getattr(logging, str(args.log_level).upper(), logging.INFO),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    import zmq
    from unipage.server.server import Server

    signal.signal(signal.SIGTERM, _exit_on_sigterm)  # until `_serve`: a stop during start-up still cleans up
    try:
        server_config = ServerConfig(**pick(args, args._groups["server"]), adapter_roots=tuple(args.adapter_root))
        if args.model is None:
            from unipage.server.demo import demo_args

            demo_args(args)
        backend = build_backend(args)
    except (ValueError, OSError) as err:
        return _cannot_start(err)
    with contextlib.closing(backend):  # after the drain has answered every request: shared memory, readers
        try:
            server = Server(backend, server_config)
        except (ValueError, OSError, zmq.ZMQError) as err:  # bad options, or the endpoint is taken
            return _cannot_start(err)
        _serve(server, backend, args.ready_file)
    return 0


def _exit_on_sigterm(signum, frame) -> None:
    """SIGTERM before serving starts: leave through ``SystemExit``, so the engine built so far is closed."""
    raise SystemExit(128 + signum)


def _cannot_start(err: Exception) -> int:
    print(f"unipage-serve: {err}", file=sys.stderr)
    return 2


def _serve(server, backend, ready_file: str | None) -> None:
    """Serve until SIGINT or SIGTERM, then drain (`Server.serve_forever`)."""
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: server.request_stop())
    adapters = ", ".join(a.name for a in backend.adapters()) or "none"
    log.info("serving %s on %s (device %s; adapters: %s)", backend.model_name, server.endpoint, backend.device,
             adapters)
    if ready_file:
        tmp = ready_file + ".tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(server.endpoint + "\n")
        os.replace(tmp, ready_file)
    server.serve_forever()


def entry_point() -> None:
    sys.exit(main())


if __name__ == "__main__":
    entry_point()
