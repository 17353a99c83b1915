"""The built-in demo: one tiny model, three trained adapters, each doing a different task on the same text.

    unipage-serve                         # no --model: serves the demo (trains it first, once)
    python -m unipage.server.demo         # starts a demo server, asks every adapter, checks the answers
    python -m unipage.server.demo --connect tcp://127.0.0.1:5555 --prompt "hello world"

The model and adapters are trained by `unipage.server.demo_train` and cached
outside the repository (``~/.cache/unipage/<recipe>``, or
``$UNIPAGE_DEMO_DIR``); they are ordinary Hugging Face / PEFT files loaded
through the same path as any model.
"""

from __future__ import annotations

import argparse
import os
import random
import subprocess
import sys
import tempfile
import time

from unipage.server.client import Client
from unipage.server.demo_train import ADAPTER_TASKS, RECIPE, TASKS, ensure_demo

PROMPTS = ("hello world", "unipage", "paged lora", "one gpu")
HELD_OUT_SEED = 20_251_122  # not the training seed: strings the adapters never saw (length >= 6: no repeats)
ALPHABET = "abcdefghijklmnopqrstuvwxyz"


def demo_args(args: argparse.Namespace) -> None:
    """Point ``unipage-serve`` options without --model at the demo files (trained first if missing)."""
    root = ensure_demo(log=lambda line: print(f"unipage-serve: {line}", file=sys.stderr, flush=True))
    args.model = os.path.join(root, "model")
    args.served_name = f"unipage-demo ({RECIPE})"
    taken = {name for name, _ in args.adapter}
    args.adapter = [(t, os.path.join(root, "adapters", t)) for t in ADAPTER_TASKS if t not in taken] + args.adapter


def expected(task: str | None, text: str) -> str:
    return TASKS[task or "copy"](text)


def held_out_texts(count: int, seed: int = HELD_OUT_SEED) -> list[str]:
    """Lowercase words of 6 to 12 characters in all, from a seed training never used."""
    rng = random.Random(seed)
    out = []
    while len(out) < count:
        words, text = [], ""
        length = rng.randint(6, 12)
        while len(text) < length:
            words.append("".join(rng.choice(ALPHABET) for _ in range(rng.randint(1, 7))))
            text = " ".join(words)
        text = text[:length].strip()
        if len(text) >= 6:
            out.append(text)
    return out


def ask_all(client: Client, texts: list[str], adapters) -> dict[tuple[str | None, str], str]:
    """Every (adapter, text) answer, greedy, all requests in flight at once."""
    streams = {(adapter, text): client.generate(text + ":", adapter=adapter, max_tokens=16, temperature=0,
                                                stream=False)
               for adapter in adapters for text in texts}
    return {key: stream.completion().text for key, stream in streams.items()}


def check(client: Client, count: int = 50) -> dict[str, float]:
    """Share of held-out strings each adapter (and the base model) answers exactly right."""
    texts = held_out_texts(count)
    adapters = (None, *ADAPTER_TASKS)
    answers = ask_all(client, texts, adapters)
    return {adapter or "base": sum(answers[adapter, t] == expected(adapter, t) for t in texts) / len(texts)
            for adapter in adapters}


def show(client: Client, prompts: list[str]) -> bool:
    adapters = (None, *ADAPTER_TASKS)
    start = time.perf_counter()
    answers = ask_all(client, prompts, adapters)
    wall = time.perf_counter() - start
    right = 0
    for text in prompts:
        print(f'prompt "{text}:"')
        for adapter in adapters:
            got, want = answers[adapter, text], expected(adapter, text)
            mark = "ok" if got == want else f"WRONG (expected {want!r})"
            right += got == want
            label = adapter or "(base: copy)"
            print(f"  {label:<13} -> {got!r:<18} {mark}")
    total = len(prompts) * len(adapters)
    print(f"{right}/{total} right; {total} requests served concurrently in {wall:.2f} s")
    return right == total


class DemoServer:
    """``unipage-serve`` (no --model) in a child process on a free loopback port."""

    def __init__(self) -> None:
        ensure_demo()
        self.dir = tempfile.mkdtemp(prefix="unipage-demo-")
        ready = os.path.join(self.dir, "endpoint")
        self.log = open(os.path.join(self.dir, "server.log"), "w")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen([sys.executable, "-m", "unipage.server.cli", "--device", "cpu", "--threads",
                                      "1", "--bind", "tcp://127.0.0.1:*", "--ready-file", ready],
                                     stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 120
        while not os.path.exists(ready):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"the demo server did not start; see {self.log.name}")
            time.sleep(0.05)
        with open(ready, encoding="utf-8") as f:
            self.endpoint = f.read().strip()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
        self.proc.wait(30)
        self.log.close()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--connect", help="a running unipage-serve demo (default: start one)")
    parser.add_argument("--prompt", action="append", help="text to ask every adapter (lowercase letters and "
                        "spaces, at most 12 characters; repeatable)")
    parser.add_argument("--check", type=int, default=50, help="held-out strings per adapter to score (0: skip)")
    args = parser.parse_args(argv)
    server = None if args.connect else DemoServer()
    try:
        with Client(args.connect or server.endpoint, timeout=60) as client:
            ok = show(client, args.prompt or list(PROMPTS))
            if args.check:
                scores = check(client, args.check)
                print("held-out accuracy: " + ", ".join(f"{k} {v:.0%}" for k, v in scores.items()))
    finally:
        if server is not None:
            server.stop()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
