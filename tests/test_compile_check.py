"""`benchmarks/compile_check.py` compiles the MoE kernels with the H100's tuned configs on the CPU:
its patch must reach the lookups the launchers make; and the MoE LoRA kernels' small tiles compile for
sm_90 (the Triton the venv has), beside the base experts (``--base``) and the stacked expert LoRA
(``--stack``), each with its instruction count."""

from __future__ import annotations

import importlib
import os
import sys
from types import SimpleNamespace

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
import compile_check  # noqa: E402
from unipage.kernels.fused_moe import base_config  # noqa: E402
from unipage.kernels.moe_align import expected_load, launch_config, shape_key  # noqa: E402
from unipage.kernels.moe_lora_plan import lora_config  # noqa: E402


def test_patch_selects_the_tuned_configs(monkeypatch):
    for name in compile_check.PATCHED:
        module = importlib.import_module(f"unipage.kernels.{name}")
        for attr in ("launch", "device_key", "config_devices", "hopper_or_later"):
            if hasattr(module, attr):  # restored after the test
                monkeypatch.setattr(module, attr, getattr(module, attr))
    key, ids = shape_key(2048, 768, 128, 8), torch.zeros(4096, 8, dtype=torch.int32)
    tuned = launch_config("base", key, ids.numel() / 128, compile_check.TUNED_DEVICE)
    assert tuned != launch_config("base", key, ids.numel() / 128, "cpu")  # else the test shows nothing
    assert base_config(128, 2048, 768, ids, None) != tuned  # a CPU tensor: the defaults
    meta = SimpleNamespace(hidden=2048, inter=768, num_experts=128, num_lora_slots=16)
    lora = SimpleNamespace(meta=meta, active_slots=16)  # what lora_config reads of a MoeLora
    tuned_lora = launch_config("lora", key, expected_load(ids.numel(), 16 * 128), compile_check.TUNED_DEVICE)
    assert lora_config(lora, ids) != tuned_lora
    compile_check.patch([])
    assert base_config(128, 2048, 768, ids, None) == tuned
    assert lora_config(lora, ids) == tuned_lora  # the LoRA plan's lookup (moe_lora_plan) is patched too


def test_small_tiles_compile_for_hopper():
    """Small tiles (LoRA ``block_m`` 4) at setup (b)'s decode mix under the affinity policy compile for sm_90
    with no spills: their products are broadcast-reduces (a ``tl.dot`` under 16 rows would not compile, and
    the interpreter the CPU tests run takes any)."""
    import json
    import subprocess

    lora = {"block_m": 4, "split_k": 2, "shrink": {"group_m": 8, "num_warps": 2, "num_stages": 2},
            "gate_up": {"block_n": 128, "num_warps": 1, "num_stages": 1, "group_m": 8},
            "down": {"block_n": 256, "num_warps": 4, "num_stages": 2, "group_m": 8}}
    script = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks",
                          "compile_check.py")
    out = subprocess.run([sys.executable, script, "--shapes", "qwen3-30b-a3b", "--tokens", "256", "--device-key",
                          "nvidia_h200", "--adapters", "4", "--rank", "8", "--lora", json.dumps(lora), "--base",
                          "--lines", "3", "--stack"],
                         capture_output=True, text=True, timeout=900,
                         env={k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"})  # compile, not interpret
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    row = json.loads(out.stdout.strip().splitlines()[-1])
    lora_kernels = [c for c in row["compiled"]
                    if c["kernel"] in ("_moe_shrink_kernel", "_expand_gate_up_kernel", "_expand_down_kernel")]
    assert len(lora_kernels) == 3 and all(c["ok"] and c["local_bytes"] <= 0 for c in lora_kernels), lora_kernels
    base = [c for c in row["compiled"] if c.get("base")]  # --base: the experts without LoRA, first
    assert [c["kernel"] for c in base].count("_moe_gemm_kernel") == 2 and row["compiled"][:len(base)] == base
    at = [i for i, c in enumerate(row["compiled"]) if c.get("stack")]  # --stack: the stacked path's, together
    stacked = [row["compiled"][i] for i in at]  # (its alignment, two shrinks, two GEMMs with the extra block)
    assert [c["kernel"] for c in stacked].count("_moe_gemm_kernel") == 4 and at == list(range(at[0], at[-1] + 1))
    assert all(c["ok"] and c["local_bytes"] <= 0 for c in stacked), stacked
    assert all(c["instructions"] > 0 or c["instructions"] == -1 for c in row["compiled"])  # (-1: no cuobjdump)
    gemm = next(c for c in row["compiled"] if c["kernel"] == "_moe_gemm_kernel")  # --lines: where its code is
    assert gemm["instructions"] == -1 or (len(gemm["lines"]) == 3 and all(n > 0 for _, n in gemm["lines"]))


def test_instruction_counts_past_address_ffff():
    """`count_instructions` and `line_counts` read SASS lines at any address (five hex digits past 4,096
    instructions), not data lines, and put each under the source line listed before it."""
    sass = "\n".join(["        /*0000*/                   LDC R1, c[0x0][0x28] ;",
                      "        /*fff0*/                   IMAD R2, R2, R3, RZ ;",
                      "        /*10000*/                  @P0 LDG.E R4, desc[UR4][R2.64] ;",
                      "        /*10010*/ \t.byte\t0xff, 0xff, 0xff, 0xff",
                      "        .text._moe_gemm_kernel:"])
    assert compile_check.count_instructions(sass) == 3 and compile_check.count_instructions("") == -1
    listing = "\n".join(["        /*0000*/                   LDC R1, c[0x0][0x28] ;",  # before any line: left out
                         '\t//## File "/w/kernels/fused_moe.py", line 217',
                         "        /*0010*/                   IMAD R2, R2, R3, RZ ;",
                         '\t//## File "/w/kernels/moe_act.py", line 56 inlined at "/w/kernels/fused_moe.py", line 274',
                         "        /*10000*/                  MUFU.EX2 R4, R4 ;",
                         "        /*10010*/                  FMUL R4, R4, R5 ;"])
    assert compile_check.line_counts(listing, 5) == [("moe_act.py:56", 2), ("fused_moe.py:217", 1)]
    assert compile_check.line_counts(listing, 1) == [("moe_act.py:56", 2)]


def test_bad_arguments_are_refused(capsys):
    for argv, message in ((["--lines", "-2"], "--lines must be >= 0, got -2"),
                          (["--adapters", "4", "--active-slots", "2"], "--active-slots must be >= --adapters (4), got 2"),
                          (["--slot-order", "Mixed"], "invalid choice: 'Mixed'")):
        with pytest.raises(SystemExit) as exc:
            compile_check.main(argv)
        assert exc.value.code == 2 and message in capsys.readouterr().err
