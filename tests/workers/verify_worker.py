"""A program calling flash-attn's ``flash_attn_func`` directly, for tests/test_verify_e2e.py.

    python verify_worker.py make DIR          # write a CPU flash-attn 2.8.3 stand-in into DIR
    python verify_worker.py run CALLS         # CALLS calls of flash_attn_func; one JSON line
    python verify_worker.py hub FORWARDS      # tiny Llamas on a hub kernel; one JSON line

``make`` writes a package ``flash_attn`` (with its ``flash_attn-2.8.3.dist-info``) whose
functions have flash-attn 2.8.3's signatures and compute its semantics on the CPU in float32
(never importing attnguard), except for the bug the environment names: ``FLASH_STANDIN_BUG=window``
(a sliding window one key wider on the left than asked), ``scale`` (``1/sqrt(head_dim - 1)``
where none is given) or ``none``; ``FLASH_STANDIN_BUG_RANK`` limits the bug to that rank.
``run`` is the user's program, guarded only by attnguard's start-up hook (``ATTNGUARD=1``): it
makes a process group when launched by torchrun (gloo), calls
``flash_attn_func`` with float16 tensors and a sliding window, and prints what it computed.
``hub`` loads two tiny bfloat16 Llamas (head_dim 16 and 32) with
``attn_implementation="kernels-community/flash-attn2"``, the hub kernel served through
``LOCAL_KERNELS`` (set by the test, with ``WORK_DIR`` for the checkpoints), runs ``FORWARDS``
forwards of each and prints the numbers check's counts and the implementation each model ended
with.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

_INIT = '''"""CPU STAND-IN for flash-attn 2.8.3 with a deliberate bug (attnguard's tests)."""
from .flash_attn_interface import flash_attn_func, flash_attn_varlen_func  # noqa: F401

__version__ = "2.8.3"
'''

_INTERFACE = '''"""CPU STAND-IN for flash-attn 2.8.3's interface, computing its semantics in float32."""
import os

import torch


def _bug():
    rank = os.environ.get("FLASH_STANDIN_BUG_RANK")
    if rank is not None and rank != os.environ.get("RANK", "0"):
        return "none"
    return os.environ.get("FLASH_STANDIN_BUG", "none")


def _attend(q, k, v, scale, causal, window):
    # q (B, Sq, H, D), k/v (B, Sk, Hk, D); bottom-right aligned causal mask and window
    b, sq, h, d = q.shape
    sk, hk = k.shape[1], k.shape[2]
    k = k.float().repeat_interleave(h // hk, dim=2)
    v = v.float().repeat_interleave(h // hk, dim=2)
    s = torch.einsum("bqhd,bkhd->bhqk", q.float(), k) * scale
    i = torch.arange(sq)[:, None] + (sk - sq)
    j = torch.arange(sk)[None, :]
    left, right = window
    if _bug() == "window" and left >= 0:
        left += 1
    keep = torch.ones(sq, sk, dtype=torch.bool)
    if causal:
        keep &= j <= i
    if left >= 0:
        keep &= j >= i - left
    if right >= 0 and not causal:
        keep &= j <= i + right
    s = s.masked_fill(~keep, float("-inf"))
    p = torch.nan_to_num(torch.softmax(s, dim=-1), nan=0.0)
    return torch.einsum("bhqk,bkhd->bqhd", p, v).to(q.dtype)


def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False,
                    window_size=(-1, -1), softcap=0.0, alibi_slopes=None, deterministic=False,
                    return_attn_probs=False):
    d = q.shape[-1]
    if softmax_scale is None:
        softmax_scale = (d - 1) ** -0.5 if _bug() == "scale" else d**-0.5
    return _attend(q, k, v, softmax_scale, causal, tuple(window_size))


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                           dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                           softcap=0.0, alibi_slopes=None, deterministic=False,
                           return_attn_probs=False, block_table=None):
    raise NotImplementedError("stand-in: varlen is not implemented")
'''

_METADATA = "Metadata-Version: 2.1\nName: flash_attn\nVersion: 2.8.3\n"


def make(root: Path) -> None:
    package = root / "flash_attn"
    package.mkdir(parents=True, exist_ok=True)
    (package / "__init__.py").write_text(_INIT)
    (package / "flash_attn_interface.py").write_text(_INTERFACE)
    info = root / "flash_attn-2.8.3.dist-info"
    info.mkdir(exist_ok=True)
    (info / "METADATA").write_text(_METADATA)
    (info / "top_level.txt").write_text("flash_attn\n")
    (info / "RECORD").write_text("")


def run(calls: int) -> dict[str, object]:
    import torch  # with ATTNGUARD=1, attnguard's start-up hook guards the flash_attn import

    distributed = int(os.environ.get("WORLD_SIZE", "1")) > 1
    if distributed:
        import torch.distributed as dist

        dist.init_process_group("gloo")
    from flash_attn import flash_attn_func

    g = torch.Generator().manual_seed(int(os.environ.get("RANK", "0")))
    sums = []
    for n in range(calls):
        q = torch.randn(2, 24, 4, 16, generator=g).to(torch.float16)
        k = torch.randn(2, 24, 2, 16, generator=g).to(torch.float16)
        v = torch.randn(2, 24, 2, 16, generator=g).to(torch.float16)
        out = flash_attn_func(q, k, v, causal=True, window_size=(4 + n % 2, -1))
        sums.append(float(out.float().sum()))
    guarded = hasattr(flash_attn_func, "__attnguard_original__")
    if distributed:
        dist.barrier()
        dist.destroy_process_group()
    return {"sums": sums, "guarded": guarded}


def hub(forwards: int) -> dict[str, object]:
    import torch
    import transformers  # with ATTNGUARD=1, guarded by attnguard's start-up hook

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, for helpers
    from helpers.models import save_tiny

    from attnguard.observability import numerics

    loaded = []
    for head_dim in (16, 32):
        path = Path(os.environ["WORK_DIR"]) / f"llama-{head_dim}"
        save_tiny(path, dtype=torch.bfloat16, hidden_size=4 * head_dim, max_position_embeddings=256)
        model = transformers.LlamaForCausalLM.from_pretrained(
            path, attn_implementation="kernels-community/flash-attn2", dtype=torch.bfloat16
        )
        loaded.append(model.config._attn_implementation)
        ids = torch.randint(3, 128, (2, 12), generator=torch.Generator().manual_seed(1))
        with torch.no_grad():
            for _ in range(forwards):
                model(input_ids=ids)
    return {"loaded": loaded, "numerics": numerics.snapshot()}


def main() -> None:
    if sys.argv[1] == "make":
        make(Path(sys.argv[2]))
        return
    if sys.argv[1] == "hub":
        print(json.dumps(hub(int(sys.argv[2]))))
        return
    print(json.dumps(run(int(sys.argv[2]))))


if __name__ == "__main__":
    main()
