"""Opt-in kernel selection (``ATTNGUARD_KERNEL=fastest``): which kernel computes a flash-attention
call that the requested kernel could compute, and why.

With the switch on, a call to flash-attn's ``flash_attn_func``, ``flash_attn_varlen_func`` or
``flash_attn_with_kvcache`` is served by the fastest kernel that computes the same numbers,
measured on this GPU. "Why did this call run on cuDNN?" — in reading order:

* :mod:`.served` — :func:`~.served.served`, the call guard's first question for every such
  call: the kernel a decided bucket serves calls like this one with, found by the call's
  signature (a decode loop's every call ends there);
* :mod:`.buckets` — what a call is (:func:`~.buckets.describe_call`: its bucket, the decision's
  key, and which candidates may compute it);
* :mod:`.decisions` — :func:`~.decisions.serve`, called by the call guard for a call not served
  yet: the bucket's decision (made once per bucket, the same on every rank of a job), where it
  came from, and the ``kernel_selected`` event that says so;
* :mod:`.race` — measuring the candidates on the call's own inputs, and the winner;
* :mod:`.cache` — where decisions live: the disk cache and the job's store.

The package sits below the call guard (:mod:`attnguard.callguard`), which is its only caller
besides ``attnguard doctor``; it never imports ``attnguard`` itself or ``attnguard.runtime``: the
settings it needs come in as arguments (:class:`~.decisions.Options`).
"""
