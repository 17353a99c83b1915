"""The built-in demo: its adapters each do their task on strings they never saw, served by `unipage-serve`.

The demo files are trained once into the demo cache (``~/.cache/unipage/<recipe>``
or ``$UNIPAGE_DEMO_DIR``) by `unipage.server.demo_train` — a few minutes on a
CPU the first time, nothing afterwards — and shared with ``unipage-serve``.
"""

from __future__ import annotations

import os

import pytest
import test_server_support as ss
from unipage.server import Client, demo
from unipage.server.demo_train import ADAPTER_TASKS, ensure_demo


@pytest.fixture(scope="module")
def demo_root():
    return ensure_demo()


@pytest.fixture(scope="module")
def demo_server(demo_root, tmp_path_factory):
    """``unipage-serve`` with no --model: the demo."""
    proc = ss.ServerProcess(None, tmp_path_factory.mktemp("demo"))
    yield proc
    assert proc.stop() == 0, proc.log()


def test_each_adapter_passes_its_task_on_held_out_strings(demo_server):
    with Client(demo_server.endpoint, timeout=60) as client:
        names = [a.name for a in client.list_adapters()]
        assert names == sorted(ADAPTER_TASKS) and client.health().model.startswith("unipage-demo")
        scores = demo.check(client, 40)
    assert all(scores[task] >= 0.95 for task in ADAPTER_TASKS), scores
    assert scores["base"] >= 0.9, scores  # the base model copies


def test_the_same_prompt_gets_a_different_right_answer_from_each_adapter(demo_server, capsys):
    with Client(demo_server.endpoint, timeout=60) as client:
        assert demo.show(client, list(demo.PROMPTS))
        got = client.complete("hello world:", adapter="reverse", temperature=0, max_tokens=16)
    assert (got.text, got.finish_reason) == ("dlrow olleh", "stop")
    out = capsys.readouterr().out
    assert "'HELLO WORLD'" in out and "'ifmmp xpsme'" in out


def test_the_files_are_real_hf_and_peft(demo_root):
    """transformers + PEFT load the demo's files and give the same answer as the server."""
    import torch
    from peft import PeftModel
    from tokenizers import Tokenizer
    from transformers import AutoModelForCausalLM

    tok = Tokenizer.from_file(os.path.join(demo_root, "model", "tokenizer.json"))
    base = AutoModelForCausalLM.from_pretrained(os.path.join(demo_root, "model"), dtype=torch.float32)
    model = PeftModel.from_pretrained(base, os.path.join(demo_root, "adapters", "upper")).eval()
    ids = torch.tensor([tok.encode("paged lora:").ids])
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=12, do_sample=False, eos_token_id=1, pad_token_id=0)
    assert tok.decode(out[0, ids.shape[1]:].tolist()) == "PAGED LORA"
