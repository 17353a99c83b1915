"""Train the built-in demo: a tiny character-level Llama and three LoRA adapters that each do a text task.

    python -m unipage.server.demo_train [--out DIR]      (default: the demo cache, see `demo_dir`)

The base model reads ``<text>:`` and writes the text back (copy); given a
task token first (``<reverse>``, ``<upper>``, ``<shift>``) it does that task
instead.  Each adapter is a rank-8 LoRA on every attention and MLP projection,
trained with the base frozen to do its task *without* the task token — so the
same prompt gives a visibly different, checkable answer under each adapter:

    hello world:   base -> hello world   reverse -> dlrow olleh
                   upper -> HELLO WORLD  shift -> ifmmp xpsme

Everything is written as real files — ``config.json`` + ``model.safetensors``
(Llama keys, as transformers writes them), ``tokenizer.json``, and one PEFT
directory per adapter — and served through the same loaders as any model.
Training runs on one CPU thread with fixed seeds (deterministic for a given
torch build), a few minutes on a laptop core.  The model below is a plain
torch re-statement of the Llama forward (RMSNorm, rotate-half rope, GQA,
SwiGLU) used only for training.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import shutil
import tempfile
import time

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from torch import nn

RECIPE = "demo-v1"  # part of the cache path: change it whenever anything below changes the files
SPECIAL = ("<pad>", "<eos>", "<copy>", "<reverse>", "<upper>", "<shift>", ":", " ")
CHARS = tuple(chr(c) for c in range(ord("a"), ord("z") + 1)) + tuple(chr(c) for c in range(ord("A"), ord("Z") + 1))
VOCAB = SPECIAL + CHARS  # 60 tokens; the embedding has VOCAB_SIZE rows
VOCAB_SIZE = 64
EOS, SEP = VOCAB.index("<eos>"), VOCAB.index(":")
TOKEN = {c: i for i, c in enumerate(VOCAB)}
MAX_TEXT = 12  # characters of input text at most (lowercase letters and single spaces)


def _shift(text: str) -> str:
    return "".join(c if c == " " else chr((ord(c) - ord("a") + 1) % 26 + ord("a")) for c in text)


TASKS = {"copy": lambda s: s, "reverse": lambda s: s[::-1], "upper": str.upper, "shift": _shift}
ADAPTER_TASKS = ("reverse", "upper", "shift")  # the adapters; the base model copies

SHAPE = {"hidden": 64, "layers": 2, "heads": 4, "kv_heads": 2, "head_dim": 16, "intermediate": 128,
         "max_positions": 64}
BASE_STEPS, BASE_LR, BASE_BATCH = 1800, 5e-3, 128
ADAPTER_STEPS, ADAPTER_LR, ADAPTER_BATCH = {"reverse": 800, "upper": 300, "shift": 300}, 5e-3, 64  # reverse: hardest
RANK, ALPHA = 8, 16
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


# -- data ----------------------------------------------------------------------------------------------


def random_text(rng: random.Random) -> str:
    """Lowercase words separated by single spaces, 1 to MAX_TEXT characters."""
    length = rng.randint(1, MAX_TEXT)
    text = ""
    while len(text) < length:
        word = "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(1, 7)))
        text = f"{text} {word}" if text else word
    return text[:length].strip()


def encode(text: str) -> list[int]:
    return [TOKEN[c] for c in text]


def prompt_ids(text: str, task: str | None = None) -> list[int]:
    return ([TOKEN[f"<{task}>"]] if task else []) + encode(text) + [SEP]


def batch(rng: random.Random, size: int, task: str | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids ``[B, T]`` and a loss mask ``[B, T]`` (1 on the answer and its EOS).

    ``task=None``: the base mix — every task with its token, and copy without one.
    """
    seqs, masks = [], []
    for _ in range(size):
        if task is None:
            name = rng.choice(tuple(TASKS))
            with_token = name != "copy" or rng.random() < 0.5
        else:
            name, with_token = task, False
        text = random_text(rng)
        prompt = prompt_ids(text, name if with_token else None)
        answer = encode(TASKS[name](text)) + [EOS]
        seqs.append(prompt + answer)
        masks.append([0] * len(prompt) + [1] * len(answer))
    width = max(map(len, seqs))
    ids = torch.zeros(size, width, dtype=torch.long)
    mask = torch.zeros(size, width)
    for i, (seq, m) in enumerate(zip(seqs, masks)):
        ids[i, :len(seq)] = torch.tensor(seq)
        mask[i, :len(m)] = torch.tensor(m, dtype=torch.float)
    return ids, mask


# -- the model (training only) ---------------------------------------------------------------------------


class LoRALinear(nn.Module):
    """``y = W x + (alpha / r) · B (A x)``; A ``[r, d_in]``, B ``[d_out, r]`` (PEFT's shapes), B starts at 0."""

    def __init__(self, base: nn.Linear, rank: int, alpha: float, gen: torch.Generator) -> None:
        super().__init__()
        self.base = base
        self.lora_A = nn.Parameter(torch.randn(rank, base.in_features, generator=gen) / math.sqrt(base.in_features))
        self.lora_B = nn.Parameter(torch.zeros(base.out_features, rank))
        self.scale = alpha / rank

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + (x @ self.lora_A.t() @ self.lora_B.t()) * self.scale


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, -1)
    return torch.cat((-x2, x1), -1)


class Block(nn.Module):
    def __init__(self, s: dict) -> None:
        super().__init__()
        h, d = s["hidden"], s["head_dim"]
        self.input_layernorm = nn.Parameter(torch.ones(h))
        self.post_attention_layernorm = nn.Parameter(torch.ones(h))
        self.q_proj = nn.Linear(h, s["heads"] * d, bias=False)
        self.k_proj = nn.Linear(h, s["kv_heads"] * d, bias=False)
        self.v_proj = nn.Linear(h, s["kv_heads"] * d, bias=False)
        self.o_proj = nn.Linear(s["heads"] * d, h, bias=False)
        self.gate_proj = nn.Linear(h, s["intermediate"], bias=False)
        self.up_proj = nn.Linear(h, s["intermediate"], bias=False)
        self.down_proj = nn.Linear(s["intermediate"], h, bias=False)
        self.heads, self.kv_heads, self.head_dim = s["heads"], s["kv_heads"], d

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape  # [B, T, H]
        a = _rms(x, self.input_layernorm)
        q = self.q_proj(a).view(b, t, self.heads, self.head_dim).transpose(1, 2)  # [B, nh, T, d]
        k = self.k_proj(a).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)  # [B, nkv, T, d]
        v = self.v_proj(a).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        q, k = q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
        group = self.heads // self.kv_heads
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, -1)
        x = x + self.o_proj(out)
        a = _rms(x, self.post_attention_layernorm)
        return x + self.down_proj(F.silu(self.gate_proj(a)) * self.up_proj(a))


class TinyLlama(nn.Module):
    def __init__(self, s: dict) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(VOCAB_SIZE, s["hidden"])
        self.layers = nn.ModuleList(Block(s) for _ in range(s["layers"]))
        self.norm = nn.Parameter(torch.ones(s["hidden"]))
        self.lm_head = nn.Linear(s["hidden"], VOCAB_SIZE, bias=False)
        d = s["head_dim"]
        inv_freq = 1.0 / (10000.0 ** (torch.arange(0, d, 2).float() / d))
        angles = torch.outer(torch.arange(s["max_positions"]).float(), inv_freq)
        self.register_buffer("cos", torch.cat((angles, angles), -1).cos(), persistent=False)  # [P, d]
        self.register_buffer("sin", torch.cat((angles, angles), -1).sin(), persistent=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        t = ids.shape[1]
        x = self.embed_tokens(ids)
        for layer in self.layers:
            x = layer(x, self.cos[:t], self.sin[:t])
        return self.lm_head(_rms(x, self.norm))  # [B, T, V]

    def state_dict_hf(self) -> dict[str, torch.Tensor]:
        """The weights under the keys transformers' LlamaForCausalLM uses."""
        out = {"model.embed_tokens.weight": self.embed_tokens.weight, "model.norm.weight": self.norm,
               "lm_head.weight": self.lm_head.weight}
        for i, layer in enumerate(self.layers):
            p = f"model.layers.{i}"
            out[f"{p}.input_layernorm.weight"] = layer.input_layernorm
            out[f"{p}.post_attention_layernorm.weight"] = layer.post_attention_layernorm
            for name in TARGETS:
                group = "self_attn" if name in TARGETS[:4] else "mlp"
                linear = getattr(layer, name)
                out[f"{p}.{group}.{name}.weight"] = (linear.base if isinstance(linear, LoRALinear) else linear).weight
        return {k: v.detach().float().contiguous().clone() for k, v in out.items()}


# -- training ------------------------------------------------------------------------------------------------


def _train(model: nn.Module, params: list, task: str | None, steps: int, lr: float, size: int,
           rng: random.Random, log) -> float:
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.01 if task is None else 0.0)
    loss_value = float("nan")
    start = time.monotonic()
    for step in range(steps):
        warm = min(1.0, (step + 1) / 50)
        for group in opt.param_groups:
            group["lr"] = lr * warm * 0.5 * (1 + math.cos(math.pi * step / steps))
        ids, mask = batch(rng, size, task)
        logits = model(ids[:, :-1])
        losses = F.cross_entropy(logits.reshape(-1, VOCAB_SIZE), ids[:, 1:].reshape(-1), reduction="none")
        loss = (losses * mask[:, 1:].reshape(-1)).sum() / mask[:, 1:].sum()
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        loss_value = loss.item()
        if step % 250 == 0 or step == steps - 1:
            log(f"  {task or 'base'}: step {step + 1}/{steps} loss {loss_value:.4f} "
                f"({time.monotonic() - start:.0f} s)")
    return loss_value


@torch.no_grad()
def greedy(model: nn.Module, ids: list[int], limit: int = MAX_TEXT + 1) -> list[int]:
    x = torch.tensor([ids])
    out = []
    for _ in range(limit):
        token = int(model(x)[0, -1].argmax())
        out.append(token)
        if token == EOS:
            break
        x = torch.cat([x, torch.tensor([[token]])], 1)
    return out


def _add_lora(model: TinyLlama, gen: torch.Generator) -> list[LoRALinear]:
    added = []
    for layer in model.layers:
        for name in TARGETS:
            lora = LoRALinear(getattr(layer, name), RANK, ALPHA, gen)
            setattr(layer, name, lora)
            added.append(lora)
    return added


def _remove_lora(model: TinyLlama) -> None:
    for layer in model.layers:
        for name in TARGETS:
            setattr(layer, name, getattr(layer, name).base)


def _lora_tensors(model: TinyLlama) -> dict[str, torch.Tensor]:
    out = {}
    for i, layer in enumerate(model.layers):
        for name in TARGETS:
            group = "self_attn" if name in TARGETS[:4] else "mlp"
            lora = getattr(layer, name)
            key = f"base_model.model.model.layers.{i}.{group}.{name}"
            out[f"{key}.lora_A.weight"] = lora.lora_A.detach().float().contiguous().clone()
            out[f"{key}.lora_B.weight"] = lora.lora_B.detach().float().contiguous().clone()
    return out


# -- files ---------------------------------------------------------------------------------------------------


def _write_json(path: str, data: dict) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=1)


def write_model(model: TinyLlama, out: str) -> None:
    s = SHAPE
    os.makedirs(out, exist_ok=True)
    save_file(model.state_dict_hf(), os.path.join(out, "model.safetensors"))
    _write_json(os.path.join(out, "config.json"), {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": VOCAB_SIZE,
        "hidden_size": s["hidden"], "num_hidden_layers": s["layers"], "num_attention_heads": s["heads"],
        "num_key_value_heads": s["kv_heads"], "head_dim": s["head_dim"], "intermediate_size": s["intermediate"],
        "hidden_act": "silu", "rms_norm_eps": 1e-6, "max_position_embeddings": s["max_positions"],
        "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"}, "tie_word_embeddings": False,
        "attention_bias": False, "mlp_bias": False, "dtype": "float32", "eos_token_id": EOS, "pad_token_id": 0,
        "bos_token_id": None})
    _write_json(os.path.join(out, "generation_config.json"), {"eos_token_id": EOS, "pad_token_id": 0})
    write_tokenizer(out)


def write_tokenizer(out: str) -> None:
    """A character-level ``tokenizer.json``: one token per character, the special tokens whole."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({t: i for i, t in enumerate(VOCAB)}, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens([t for t in SPECIAL if t.startswith("<")])
    tok.save(os.path.join(out, "tokenizer.json"))


def write_adapter(model: TinyLlama, out: str) -> None:
    os.makedirs(out, exist_ok=True)
    save_file(_lora_tensors(model), os.path.join(out, "adapter_model.safetensors"))
    _write_json(os.path.join(out, "adapter_config.json"), {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": RANK, "lora_alpha": ALPHA, "use_rslora": False,
        "target_modules": sorted(TARGETS), "lora_dropout": 0.0, "bias": "none", "fan_in_fan_out": False,
        "inference_mode": True, "rank_pattern": {}, "alpha_pattern": {}, "base_model_name_or_path": None})


def train_demo(out: str, log=print) -> dict:
    """Train the base model and the adapters into ``out`` (``model/``, ``adapters/<task>/``); a report."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # deterministic, and faster than contended threads at this size
    try:
        torch.manual_seed(0)
        rng = random.Random(0)
        model = TinyLlama(SHAPE)
        start = time.monotonic()
        log(f"training the demo base model ({sum(p.numel() for p in model.parameters())} parameters)")
        report = {"base_loss": _train(model, list(model.parameters()), None, BASE_STEPS, BASE_LR,
                                          BASE_BATCH, rng, log)}
        write_model(model, os.path.join(out, "model"))
        for p in model.parameters():
            p.requires_grad_(False)
        gen = torch.Generator().manual_seed(1)
        for task in ADAPTER_TASKS:
            loras = _add_lora(model, gen)
            params = [p for lora in loras for p in (lora.lora_A, lora.lora_B)]
            report[f"{task}_loss"] = _train(model, params, task, ADAPTER_STEPS[task], ADAPTER_LR, ADAPTER_BATCH,
                                            rng, log)
            write_adapter(model, os.path.join(out, "adapters", task))
            _remove_lora(model)
        report["seconds"] = round(time.monotonic() - start, 1)
        return report
    finally:
        torch.set_num_threads(threads)


def demo_dir() -> str:
    """``$UNIPAGE_DEMO_DIR``, else ``$XDG_CACHE_HOME/unipage/<RECIPE>`` (``~/.cache/unipage/<RECIPE>``)."""
    if os.environ.get("UNIPAGE_DEMO_DIR"):
        return os.path.realpath(os.environ["UNIPAGE_DEMO_DIR"])
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.realpath(os.path.join(cache, "unipage", RECIPE))


def ensure_demo(root: str | None = None, log=print) -> str:
    """The demo files under ``root`` (default `demo_dir`), trained first if they are not there yet."""
    root = root or demo_dir()
    if os.path.exists(os.path.join(root, "DONE")):
        return root
    os.makedirs(os.path.dirname(root), exist_ok=True)
    log(f"the demo model and adapters are not in {root} yet: training them on the CPU (a few minutes, once)")
    staging = tempfile.mkdtemp(prefix=".staging-", dir=os.path.dirname(root))
    try:
        report = train_demo(staging, log)
        _write_json(os.path.join(staging, "DONE"), {"recipe": RECIPE, "torch": torch.__version__, **report})
        if os.path.exists(root):  # an incomplete earlier attempt
            shutil.rmtree(root)
        os.replace(staging, root)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    log(f"demo files written to {root} in {report['seconds']} s")
    return root


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=None, help="directory to write (default: the demo cache, "
                        "$UNIPAGE_DEMO_DIR or ~/.cache/unipage/" + RECIPE + ")")
    args = parser.parse_args(argv)
    print(ensure_demo(os.path.realpath(args.out) if args.out else None))


if __name__ == "__main__":
    main()
