"""A tiny model with adapters on disk and a real `unipage-serve` process on loopback, for the server tests.

The model is a random 2-layer Llama (`write_random_checkpoint`) with a
character-level ``tokenizer.json``, so text prompts and text chunks work; the
adapters are random PEFT files (`write_random_adapter`) of different ranks
and targets.  `ServerProcess` starts ``python -m unipage.server.cli`` bound to
``tcp://127.0.0.1:*`` and reads the chosen port from ``--ready-file``; its log
goes to a file (a pipe nobody reads could fill up and block the server).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field

import msgspec
import zmq

from unipage.config import ModelConfig

MODEL = ModelConfig(num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=16,
                    intermediate_size=128, dtype="float32")
VOCAB = 128
EOS = 1
ADAPTERS = {  # name: (rank, alpha, targets)
    "qv-r4": (4, 8, ("q_proj", "v_proj")),
    "all-r8": (8, 16, ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")),
    "mlp-r2": (2, 4, ("gate_proj", "up_proj", "down_proj")),
}
CHARS = ["<pad>", "<eos>"] + [chr(c) for c in range(32, 127)]  # 97 tokens; ids up to VOCAB - 1 decode to ""


@dataclass
class TinyModel:
    root: str
    model_dir: str
    adapters: dict[str, str] = field(default_factory=dict)  # name -> directory (under root/adapters)
    adapter_root: str = ""


def write_char_tokenizer(model_dir: str) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({c: i for i, c in enumerate(CHARS)}, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(["<pad>", "<eos>"])
    tok.save(os.path.join(model_dir, "tokenizer.json"))
    with open(os.path.join(model_dir, "generation_config.json"), "w", encoding="utf-8") as f:
        json.dump({"eos_token_id": EOS}, f)


def tiny_model(root) -> TinyModel:
    from unipage.models.random_checkpoint import write_random_checkpoint
    from unipage.peft_write import write_random_adapter

    root = os.path.realpath(os.fspath(root))
    model_dir = write_random_checkpoint(os.path.join(root, "model"), MODEL, vocab=VOCAB, seed=0)
    write_char_tokenizer(model_dir)
    tiny = TinyModel(root, model_dir, adapter_root=os.path.join(root, "adapters"))
    for i, (name, (rank, alpha, targets)) in enumerate(ADAPTERS.items()):
        tiny.adapters[name] = write_random_adapter(os.path.join(tiny.adapter_root, name), MODEL, rank=rank,
                                                   alpha=alpha, targets=targets, seed=i + 1, std=0.3)
    return tiny


class ServerProcess:
    """``unipage-serve`` in a child process; `stop` sends SIGTERM and returns the exit code."""

    def __init__(self, tiny: TinyModel | None, workdir, *extra: str, adapters: tuple[str, ...] | None = None,
                 adapter_root: bool = True) -> None:
        """Serve ``tiny`` (all its adapters unless ``adapters`` names some), or the built-in demo if None."""
        workdir = os.fspath(workdir)
        self.ready_file = os.path.join(workdir, "endpoint")
        self.log_path = os.path.join(workdir, "server.log")
        argv = [sys.executable, "-m", "unipage.server.cli", "--device", "cpu", "--bind", "tcp://127.0.0.1:*",
                "--ready-file", self.ready_file, "--threads", "1", "--heartbeat-s", "1"]
        if tiny is not None:
            names = tuple(tiny.adapters) if adapters is None else adapters
            argv += ["--model", tiny.model_dir, "--num-pages", "256", "--max-model-len", "64"]
            argv += [a for name in names for a in ("--adapter", f"{name}={tiny.adapters[name]}")]
            if adapter_root:
                argv += ["--adapter-root", tiny.adapter_root]
        argv += list(extra)
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
        self._log = open(self.log_path, "w")  # noqa: SIM115 - the child writes to it until stop()
        self.proc = subprocess.Popen(argv, stdout=self._log, stderr=subprocess.STDOUT, env=env)
        self.endpoint = self._wait_ready()

    def _wait_ready(self, timeout: float = 120.0) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if os.path.exists(self.ready_file):
                with open(self.ready_file, encoding="utf-8") as f:
                    return f.read().strip()
            if self.proc.poll() is not None:
                raise RuntimeError(f"unipage-serve exited with {self.proc.returncode}:\n{self.log()}")
            time.sleep(0.05)
        self.proc.kill()
        raise RuntimeError(f"unipage-serve not ready in {timeout} s:\n{self.log()}")

    def log(self) -> str:
        with open(self.log_path, encoding="utf-8") as f:
            return f.read()

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 60.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            code = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise RuntimeError(f"unipage-serve did not stop in {timeout} s:\n{self.log()}") from None
        self._log.close()
        return code

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


# -- raw protocol access (what a client in another language does) -------------------------------------


def raw_socket(endpoint: str, **options) -> zmq.Socket:
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    for key, value in options.items():
        sock.setsockopt(getattr(zmq, key), value)
    sock.connect(endpoint)
    return sock


def recv(sock: zmq.Socket, timeout: float = 30.0) -> dict:
    if not sock.poll(int(timeout * 1000)):
        raise TimeoutError("no reply")
    return msgspec.msgpack.decode(sock.recv())


def pack(**fields) -> bytes:
    return msgspec.msgpack.encode({"v": 1, **fields})
