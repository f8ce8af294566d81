"""One rank of a real distributed training stack, on CPU with gloo, as the tests in
tests/test_ranks.py launch it under torchrun (with and without ATTNGUARD=1).

    python ranks_worker.py MODE CHECKPOINT ATTN_IMPLEMENTATION OUT_DIR [hand_fix] [packed]

On a machine with CUDA each rank uses cuda:LOCAL_RANK and nccl (tests/gpu/test_ranks_gpu.py),
else the CPU and gloo; with RANKS_SHARE_GPU=1 every rank uses cuda:0 and gloo (two ranks on one
GPU: nccl refuses a GPU shared by ranks; tests/gpu/test_ranks_one_gpu.py). MODE is how the stack
builds and wraps the model:

* ``verl_fsdp2``: verl's actor (volcengine/verl fsdp_workers + fsdp_utils): the process group
  first; rank 0 builds under ``with torch.device("cpu")``, the other ranks under accelerate's
  ``init_empty_weights()``; ``from_pretrained(..., torch_dtype=torch.float32)`` on purpose (fp32
  master weights); FSDP2 ``fully_shard`` with ``MixedPrecisionPolicy(bf16, fp32)``; rank 0's full
  state broadcast to the others; AdamW.
* ``fsdp2``: every rank loads with nothing chosen (4.x: default fp32; 5.x: the checkpoint's), then
  FSDP2 ``fully_shard`` with bf16 mixed precision.
* ``verl_fsdp1``: the same load, then FSDP1 as verl wraps it (GPU only: ``MixedPrecision(bf16,
  fp32, fp32)``, ``sync_module_states=True``, ``param_init_fn`` = ``to_empty`` on the GPU for the
  meta ranks, ``device_id=LOCAL_RANK``).
* ``ddp``: every rank loads in bf16 with no device_map, then DDP (on a GPU with
  ``device_ids=[LOCAL_RANK]``; ``hand_fix`` moves the model there first, as users did by hand).
* ``zero3``: DeepSpeed ZeRO-3 through ``HfDeepSpeedConfig`` and ``deepspeed.initialize`` (the
  real package, DS_ACCELERATOR=cpu).
* ``trainer``: a fine-tuning script: ``from_pretrained`` with nothing chosen but the attention,
  then the HF ``Trainer`` (its own DDP through accelerate; gloo on CPU; ``bf16=True`` on a GPU),
  three logged steps.
  ``trainer_zero3``: the same with ``TrainingArguments(deepspeed=<ZeRO-3 config>)`` made before
  the load, so transformers partitions the model as it loads. With ``packed`` the Trainer gets
  transformers' ``DataCollatorWithFlattening`` (padding-free: what TRL's ``padding_free`` builds)
  and ``model.config.use_cache = False``, as such scripts set it.

``packed`` trains on one packed row instead of a padded batch: sequences of several lengths
concatenated, ``position_ids`` restarting at each (verl's ``use_remove_padding``, TRL's
``padding_free``, ``DataCollatorWithFlattening``); transformers' flash path then computes each
sequence apart (varlen).

Writes OUT_DIR/rank<r>.json: losses, step times (s), parameter and optimizer-state dtypes,
attention setting.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import json
import os
import sys

import torch
import torch.distributed as dist

mode, path, attn, out_dir = sys.argv[1:5]
hand_fix = "hand_fix" in sys.argv[5:]
PACKED = "packed" in sys.argv[5:]
STEPS = 3
CUDA = torch.cuda.is_available()
LOCAL_RANK = int(os.environ.get("LOCAL_RANK", "0"))
SHARE_GPU = CUDA and os.environ.get("RANKS_SHARE_GPU") == "1"
DEVICE = torch.device("cuda", 0 if SHARE_GPU else LOCAL_RANK) if CUDA else torch.device("cpu")
if CUDA:
    torch.cuda.set_device(DEVICE)


def batch() -> tuple[torch.Tensor, torch.Tensor | None]:
    """(input_ids, position_ids): the same on every rank."""
    g = torch.Generator().manual_seed(0)
    if PACKED:
        lens = [5, 11, 3, 9, 7]
        ids = torch.randint(3, 120, (1, sum(lens)), generator=g)
        pos = torch.cat([torch.arange(n) for n in lens]).unsqueeze(0)
        return ids.to(DEVICE), pos.to(DEVICE)
    return torch.randint(3, 120, (2, 12), generator=g).to(DEVICE), None


def train(opt, forward) -> tuple[list[float], list[float]]:
    """(losses, step times in seconds)."""
    import time

    ids, pos = batch()
    losses, times = [], []
    for _ in range(STEPS):
        t0 = time.perf_counter()
        loss = forward(ids, pos)
        losses.append(float(loss.detach().float()))
        loss.backward()
        opt.step()
        opt.zero_grad()
        if CUDA:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return losses, times


def dtypes(tensors) -> list[str]:
    return sorted({str(t.dtype).replace("torch.", "") for t in tensors if t.is_floating_point()})


def main() -> None:
    from transformers import AutoModelForCausalLM

    result: dict = {"mode": mode, "attn": attn}
    if mode in ("trainer", "trainer_zero3"):
        rank = train_with_the_trainer(result)
    elif mode == "zero3":
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
        import deepspeed
        from transformers.integrations import HfDeepSpeedConfig

        deepspeed.init_distributed(dist_backend="gloo")
        rank = dist.get_rank()
        ds_config = {
            "train_micro_batch_size_per_gpu": 1,
            "gradient_accumulation_steps": 1,
            "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
            "zero_allow_untested_optimizer": True,
            "zero_force_ds_cpu_optimizer": False,
        }
        keep = HfDeepSpeedConfig(ds_config)  # noqa: F841 - ZeRO-3 is on while it is alive
        model = AutoModelForCausalLM.from_pretrained(path, attn_implementation=attn)
        result["partitioned"] = all(hasattr(p, "ds_id") for p in model.parameters())
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        engine, opt, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=ds_config)

        ids, pos = batch()
        losses = []
        for _ in range(STEPS):
            loss = engine(input_ids=ids, position_ids=pos, labels=ids).loss
            losses.append(float(loss.detach().float()))
            engine.backward(loss)
            engine.step()
        result["losses"] = losses
        result["param_dtypes"] = dtypes(p.ds_tensor for p in model.parameters())
    else:
        dist.init_process_group("nccl" if CUDA and not SHARE_GPU else "gloo")
        rank = dist.get_rank()
        if mode in ("verl_fsdp2", "verl_fsdp1"):
            from accelerate import init_empty_weights

            ctx = torch.device("cpu") if rank == 0 else init_empty_weights()
            with ctx:
                model = AutoModelForCausalLM.from_pretrained(
                    path, torch_dtype=torch.float32, attn_implementation=attn
                )
        elif mode == "ddp":  # a bf16 load, as the stacks that replicate do
            model = AutoModelForCausalLM.from_pretrained(
                path, torch_dtype=torch.bfloat16, attn_implementation=attn
            )
        else:
            model = AutoModelForCausalLM.from_pretrained(path, attn_implementation=attn)
        result["loaded_dtypes"] = dtypes(model.parameters())
        result["loaded_devices"] = sorted({str(p.device) for p in model.parameters()})
        result["attn_implementation"] = model.config._attn_implementation
        if mode == "verl_fsdp1":
            from torch.distributed.fsdp import FullyShardedDataParallel, MixedPrecision
            from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy

            layer_cls = type(model.model.layers[0])
            wrapped = FullyShardedDataParallel(
                model,
                auto_wrap_policy=functools.partial(
                    transformer_auto_wrap_policy, transformer_layer_cls={layer_cls}
                ),
                mixed_precision=MixedPrecision(
                    param_dtype=torch.bfloat16,
                    reduce_dtype=torch.float32,
                    buffer_dtype=torch.float32,
                ),
                sync_module_states=True,
                param_init_fn=(
                    None if rank == 0 else lambda m: m.to_empty(device=DEVICE, recurse=False)
                ),
                device_id=DEVICE,
            )
        elif mode in ("verl_fsdp2", "fsdp2"):
            from torch.distributed.checkpoint.state_dict import (
                StateDictOptions,
                set_model_state_dict,
            )
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

            mesh = init_device_mesh(DEVICE.type, (dist.get_world_size(),))
            mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
            full_state = model.state_dict() if mode == "verl_fsdp2" else None
            for layer in model.model.layers:
                fully_shard(layer, mesh=mesh, mp_policy=mp)
            fully_shard(model, mesh=mesh, mp_policy=mp)
            if mode == "verl_fsdp2":
                model = model.to(DEVICE) if rank == 0 else model.to_empty(device=DEVICE)
                opts = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
                set_model_state_dict(model, full_state, options=opts)
                for _, buf in model.named_buffers():
                    dist.broadcast(buf, src=0)
            wrapped = model
        else:  # ddp
            from torch.nn.parallel import DistributedDataParallel

            if hand_fix:
                model = model.to(DEVICE)
            result["devices_at_wrap"] = sorted({str(p.device) for p in model.parameters()})
            wrapped = DistributedDataParallel(model, device_ids=[DEVICE.index] if CUDA else None)
        opt = torch.optim.AdamW(wrapped.parameters(), lr=1e-3)
        # a training forward keeps no cache (transformers' sdpa holds packed rows apart only then)
        result["losses"], result["step_s"] = train(
            opt,
            lambda ids, pos: (
                wrapped(input_ids=ids, position_ids=pos, labels=ids, use_cache=False).loss
            ),
        )
        params = [getattr(p, "_local_tensor", p) for p in wrapped.parameters()]
        result["param_devices"] = sorted({str(p.device) for p in params})
        result["param_dtypes"] = dtypes(params)
        state = [t for s in opt.state.values() for t in s.values() if torch.is_tensor(t)]
        result["optimizer_state_dtypes"] = dtypes(getattr(t, "_local_tensor", t) for t in state)
    result["rank"] = rank
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as fh:
        json.dump(result, fh)
    with contextlib.suppress(Exception):
        dist.destroy_process_group()
    leave()  # with DDP's reducer still alive: see leave()


def train_with_the_trainer(result: dict) -> int:
    """The HF Trainer as a fine-tuning script runs it; fills ``result``, returns the rank."""
    from transformers import AutoModelForCausalLM, Trainer, TrainingArguments

    extra: dict = {}
    if mode == "trainer_zero3":
        os.environ.setdefault("DS_ACCELERATOR", "cuda" if CUDA else "cpu")
        extra["deepspeed"] = {
            "train_micro_batch_size_per_gpu": "auto",
            "gradient_accumulation_steps": "auto",
            "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
            "zero_allow_untested_optimizer": True,
            "zero_force_ds_cpu_optimizer": False,
        }
    args = TrainingArguments(
        output_dir=os.path.join(out_dir, "trainer"),
        per_device_train_batch_size=2,
        max_steps=STEPS,
        learning_rate=1e-3,
        lr_scheduler_type="constant",
        optim="adamw_torch",
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        use_cpu=not CUDA,
        bf16=CUDA,  # mixed precision on a GPU, as fine-tuning scripts run
        ddp_backend=None if CUDA else "gloo",
        dataloader_num_workers=0,
        seed=0,
        **extra,
    )
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation=attn)
    result["loaded_dtypes"] = dtypes(model.parameters())
    result["attn_implementation"] = model.config._attn_implementation
    result["partitioned"] = all(hasattr(p, "ds_id") for p in model.parameters())
    g = torch.Generator().manual_seed(0)
    n_rows = 2 * STEPS * dist_world_size()
    collator = None
    if PACKED:
        from transformers import DataCollatorWithFlattening

        model.config.use_cache = False
        lens = torch.randint(3, 13, (n_rows,), generator=g).tolist()
        data: list = [
            {"input_ids": torch.randint(3, 120, (n,), generator=g).tolist()} for n in lens
        ]
        collator = DataCollatorWithFlattening()
    else:
        rows = torch.randint(3, 120, (n_rows, 12), generator=g)
        data = [{"input_ids": r, "labels": r} for r in rows]
    trainer = Trainer(model=model, args=args, train_dataset=data, data_collator=collator)
    trainer.train()
    # the logged loss is the mean over the ranks' batches: the same on every rank
    result["losses"] = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    result["param_dtypes"] = dtypes(getattr(p, "ds_tensor", p) for p in model.parameters())
    result["param_devices"] = sorted({str(p.device) for p in model.parameters()})
    return dist.get_rank() if dist.is_initialized() else 0


def dist_world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def leave() -> None:
    """Run the exit handlers (attnguard's summary among them) and exit without freeing DDP's
    reducer: on CPU, freeing it can deadlock in torch itself (~ProcessGroupGloo joins its worker
    thread while holding the GIL the worker waits for; seen unguarded with torch 2.13). A hang
    during load or training still fails the test by its timeout."""
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


main()
