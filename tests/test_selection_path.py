"""The path of a call under ATTNGUARD_KERNEL=fastest, on CPU: what a decided call runs through,
what a call's signature holds, and that the path keeps every behaviour of the switch.

The guarded entries are the flash-attn functions as attnguard patches them, around recording
kernels with flash-attn's signatures. Meta tensors that say they are CUDA tensors stand in for
a GPU's (the guard and the selection read their metadata only); the race is stood in for (it
needs a GPU), everything else is the real selection: buckets, the decision's sources (disk,
rules), the ``kernel_selected`` event, the served signatures.
"""

from __future__ import annotations

import functools
import sys
from types import SimpleNamespace
from typing import Any

import pytest
import torch

import attnguard
from attnguard import callguard, fallback, kernels, runtime
from attnguard.fallback import torch_flash
from attnguard.integrations.flash_attn import entries as flash_entries
from attnguard.observability import events
from attnguard.selection import buckets, cache, decisions, race

FP = ("e" * 16, {"gpu": "Test GPU", "torch": "2.x", "flash_attn": "2.8.3", "attnguard": "0"})
BF16 = torch.bfloat16


class CudaLike(torch.Tensor):
    """A meta tensor that says it is a CUDA one (on GPU ``gpu``): no memory, no kernel, its
    metadata only."""

    __torch_function__ = torch._C._disabled_torch_function_impl
    gpu = 0

    @property
    def is_cuda(self) -> bool:  # type: ignore[override]
        return True

    def get_device(self) -> int:  # type: ignore[override]
        return self.gpu


def cuda_like(*shape: int, dtype: torch.dtype = BF16, grad: bool = False, gpu: int = 0) -> Any:
    t = torch.empty(*shape, dtype=dtype, device="meta").as_subclass(CudaLike)
    t.gpu = gpu
    return t.requires_grad_(grad)


CALLS = {
    "flash_attn_func": lambda: (
        (cuda_like(1, 1, 8, 64), cuda_like(1, 512, 2, 64), cuda_like(1, 512, 2, 64)),
        {"softmax_scale": 0.125, "causal": True},
    ),
    "flash_attn_with_kvcache": lambda: (
        (cuda_like(1, 1, 8, 64), cuda_like(1, 512, 2, 64), cuda_like(1, 512, 2, 64)),
        {"cache_seqlens": torch.empty(1, dtype=torch.int32, device="meta"), "causal": True},
    ),
    # transformers' packed rows: everything after the tensors by name
    "flash_attn_varlen_func": lambda: (
        (cuda_like(300, 8, 64), cuda_like(300, 2, 64), cuda_like(300, 2, 64)),
        {
            "cu_seqlens_q": torch.empty(3, dtype=torch.int32, device="meta"),
            "cu_seqlens_k": torch.empty(3, dtype=torch.int32, device="meta"),
            "max_seqlen_q": 200,
            "max_seqlen_k": 200,
            "causal": True,
        },
    ),
}


def _kernel(name: str, label: str, ran: list[str]) -> Any:
    """A recording kernel with flash-attn's signature for ``name``."""
    twin = fallback.FLASH_FUNCTIONS[name]

    @functools.wraps(twin)
    def kernel(*args: Any, **kwargs: Any) -> Any:
        ran.append(label)
        return args[0]

    return kernel


@pytest.fixture
def fastest(tmp_path, monkeypatch):
    """Guarded flash-attn entries under fastest; each race "measures" ``winner`` faster (torch's
    flash kernel, a candidate of every entry, unless a test says otherwise), whose
    implementation records its name."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(cache, "fingerprint", lambda version: FP)
    monkeypatch.setattr(torch_flash, "can_run", lambda *a, **k: True)  # no GPU to judge
    ran: list[str] = []
    state = SimpleNamespace(winner="torch_flash", raced=0, ran=ran)

    def fake_race(entry, args, kwargs, call, s):
        state.raced += 1
        assert state.winner in s.candidates
        w = state.winner
        return decisions.Decision(w, {w: "1.50x"}, {w: {"ms": 1.0}})

    def winner_impl(a: tuple[Any, ...], k: dict[str, Any]) -> Any:
        ran.append(state.winner)
        return a[0]

    monkeypatch.setattr(decisions, "_race", fake_race)
    monkeypatch.setattr(race, "implementations", lambda *a: {state.winner: winner_impl})
    decisions.reset()
    attnguard.activate(log="none", kernel="fastest")

    def guarded(name: str) -> Any:
        original = _kernel(name, "requested", ran)
        entry = callguard.Entry(
            name,
            kernels.EntryKind.FLASH_KERNEL,
            original,
            tensors=flash_entries.FLASH_TENSOR_PARAMS[name],
            twin=original,
            site=f"flash_attn.{name}",
            aux=("alibi_slopes",),
            head_axis=flash_entries.FLASH_HEAD_AXIS[name],
            in_force=runtime.IN_FORCE,
        )
        return callguard.wrap_direct(entry)

    state.guarded = guarded
    yield state
    decisions.reset()


def _selection_module(filename: str) -> str | None:
    """The attnguard module a code object belongs to (None: not attnguard's)."""
    path = filename.replace("\\", "/")
    if "/attnguard/" not in path or "/tests/" in path:
        return None
    module = path.rsplit("/attnguard/", 1)[1].removesuffix(".py").removesuffix("/__init__")
    return "attnguard." + module.replace("/", ".")


def _returns(fn: Any) -> list[tuple[str, str, str | None]]:
    """(module, function, the module returned to) of every attnguard function that returned
    while ``fn()`` ran, in order, and of the kernels (this file's)."""
    seen: list[tuple[str, str, str | None]] = []
    here = __file__

    def profile(frame: Any, event: str, arg: Any) -> None:
        if event != "return":
            return
        code = frame.f_code
        if code.co_filename == here:
            if code.co_name not in ("kernel", "winner_impl"):
                return  # the stand-ins' own (CudaLike.is_cuda, the test's lambda)
            module = "kernel"
        else:
            module = _selection_module(code.co_filename)
            if module is None:
                return
        back = frame.f_back
        seen.append((module, code.co_name, back and _selection_module(back.f_code.co_filename)))

    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return seen


@pytest.mark.parametrize("name", list(CALLS))
@pytest.mark.parametrize("winner", ["torch_flash", "requested"])
def test_a_decided_call_leaves_the_guard_twice(fastest, name, winner):
    """A call of a decided bucket runs through the guard (and its own check, for the entries
    whose signature does not hold the check's facts), one function of the selection (the served
    signatures) and the kernel that serves it: two returns to the guard, nothing else of
    attnguard's on the way (neither a bucket nor a description computed)."""
    fastest.winner = winner
    guarded = fastest.guarded(name)
    args, kwargs = CALLS[name]()
    with events.capture() as seen:
        guarded(*args, **kwargs)  # the bucket's first call: described, decided, said
    assert [e["reason_code"] for e in seen if e["event"] == "kernel_selected"] == [
        "faster_kernel" if winner != "requested" else "requested_kept"
    ]
    assert fastest.raced == 1
    got = _returns(lambda: guarded(*args, **kwargs))
    assert fastest.ran[-1] == winner and fastest.raced == 1
    checked = [] if name == "flash_attn_func" else [("attnguard.callguard", "check")]
    assert [(m, f) for m, f, _ in got] == [
        *checked,
        ("attnguard.selection.served", "served"),
        ("kernel", "winner_impl" if winner != "requested" else "kernel"),
        ("attnguard.callguard", "attnguard_attention"),
    ]


def test_layers_that_differ_in_their_window_are_each_served_by_signature(fastest):
    """Alternating layers of one shape (full attention, a sliding window: Gemma, GPT-OSS) are
    two buckets, each served by its own remembered call, neither pushing the other out."""
    guarded = fastest.guarded("flash_attn_func")
    args, kwargs = CALLS["flash_attn_func"]()
    window = {**kwargs, "window_size": (16, 0)}
    for _ in range(3):
        guarded(*args, **kwargs)
        guarded(*args, **window)
    assert fastest.raced == 2 and fastest.ran == ["torch_flash"] * 6
    for kw in (kwargs, window):
        got = _returns(lambda kw=kw: guarded(*args, **kw))
        assert [m for m, _, _ in got] == [
            "attnguard.selection.served",
            "kernel",
            "attnguard.callguard",
        ]


def test_a_new_shape_of_a_decided_bucket_is_described_in_one_pass(fastest):
    """A call whose signature is new in a decided bucket (a decode step one key longer) is
    described once: one return from the buckets' module to the decisions', none to the race."""
    guarded = fastest.guarded("flash_attn_func")
    args, kwargs = CALLS["flash_attn_func"]()
    guarded(*args, **kwargs)
    longer = (args[0], cuda_like(1, 500, 2, 64), cuda_like(1, 500, 2, 64))
    got = _returns(lambda: guarded(*longer, **kwargs))
    assert fastest.ran[-1] == "torch_flash" and fastest.raced == 1  # the same bucket: decided
    into_decisions = [
        (m, f) for m, f, back in got if back == "attnguard.selection.decisions" and m != back
    ]
    assert [m for m, _ in into_decisions].count("attnguard.selection.buckets") == 1
    assert ("attnguard.selection.buckets", "describe_call") in into_decisions
    assert got[-1][:2] == ("attnguard.callguard", "attnguard_attention")


# --- what a signature holds --------------------------------------------------------------------


def _dense(**kw: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    q, k, v = (kw.pop(n, None) for n in "qkv")
    q = cuda_like(2, 100, 8, 64) if q is None else q
    k = cuda_like(2, 300, 2, 64) if k is None else k
    v = cuda_like(2, 300, 2, 64) if v is None else v
    return (q, k, v), {"causal": True, **kw}


def _packed(most_q: Any = 200, most_k: Any = 200, **kw: Any) -> tuple[tuple, dict[str, Any]]:
    cu = torch.empty(3, dtype=torch.int32, device="meta")
    args = (cuda_like(300, 8, 64), cuda_like(300, 2, 64), cuda_like(300, 2, 64), cu, cu)
    return args, {"max_seqlen_q": most_q, "max_seqlen_k": most_k, "causal": True, **kw}


def _cached(capacity: int = 512, grad: bool = False, **kw: Any) -> tuple[tuple, dict[str, Any]]:
    q = cuda_like(1, 1, 8, 64, grad=grad)
    cache = cuda_like(1, capacity, 2, 64)
    seqlens = torch.empty(1, dtype=torch.int32, device="meta")
    return (q, cache, cache), {"cache_seqlens": seqlens, "causal": True, **kw}


def _bucket(name: str, args: tuple, kwargs: dict) -> Any:
    import inspect

    params = inspect.signature(fallback.FLASH_FUNCTIONS[name]).parameters
    return buckets.bucket(name, {**dict(zip(params, args, strict=False)), **kwargs})


# calls that differ from the first of their row in one fact: the bucket's or the guard's check's
VARIANTS = {
    "flash_attn_func": [
        _dense(),
        _dense(causal=False),  # the bucket's
        _dense(q=cuda_like(2, 100, 8, 128), k=cuda_like(2, 300, 2, 128)),
        _dense(window_size=(16, 0)),
        _dense(return_attn_probs=True),
        _dense(q=cuda_like(2, 100, 8, 64, grad=True)),
        _dense(q=cuda_like(2, 100, 8, 64, dtype=torch.float16)),
        _dense(k=cuda_like(2, 300, 2, 64, dtype=torch.float16)),  # the check's
        _dense(v=cuda_like(2, 300, 2, 64, dtype=torch.float32)),
        _dense(k=cuda_like(2, 300, 2, 64, gpu=1)),
        _dense(v=cuda_like(2, 300, 2, 64, gpu=1)),
        _dense(  # all three on another GPU
            q=cuda_like(2, 100, 8, 64, gpu=1),
            k=cuda_like(2, 300, 2, 64, gpu=1),
            v=cuda_like(2, 300, 2, 64, gpu=1),
        ),
    ],
    "flash_attn_with_kvcache": [
        _cached(),
        _cached(capacity=4096),
        _cached(causal=False),
        _cached(k=cuda_like(1, 1, 2, 64), v=cuda_like(1, 1, 2, 64)),  # new keys appended
        _cached(grad=True),
    ],
    "flash_attn_varlen_func": [
        _packed(),
        _packed(most_q=600),
        _packed(most_k=torch.tensor(600)),  # a 0-d tensor: by its value
        _packed(causal=False),
        _packed(block_table=torch.empty(2, 4, dtype=torch.int32, device="meta")),
    ],
}


def _alike(args: tuple[Any, ...]) -> tuple[Any, ...]:
    """New tensors of the same kind (a decode loop's next layer)."""
    return tuple(
        cuda_like(*a.shape, dtype=a.dtype, grad=a.requires_grad, gpu=a.gpu)
        if isinstance(a, CudaLike)
        else a
        for a in args
    )


@pytest.mark.parametrize("name", list(VARIANTS))
def test_a_call_is_served_where_it_is_alike_in_every_fact_its_bucket_and_the_check_read(name):
    """A remembered call serves calls alike in every fact its bucket and the guard's check read
    (new tensors of the same kind, its keyword arguments in another order), in the mode it was
    remembered in; each call that differs in one of them is not served from it."""
    from attnguard.selection import served

    (args, kwargs), *others = VARIANTS[name]
    kernel = object()
    served.reset()
    try:
        served.remember(name, served.signature(name, args, kwargs), kwargs, [0], kernel, True)
        again = dict(reversed(list(kwargs.items())))
        if name == "flash_attn_func":  # (the others' signatures hold them as passed)
            assert served.served(name, _alike(args), again, True) is kernel
        assert served.served(name, _alike(args), dict(kwargs), True) is kernel
        assert _bucket(name, args, kwargs) == _bucket(name, _alike(args), again)
        assert served.served(name, _alike(args), dict(kwargs), False).__class__ is tuple
        for other, kw in others:
            assert served.served(name, other, kw, True).__class__ is tuple, kw
        with torch.no_grad():  # no backward: a call with gradients is one without
            grad = [(a, kw) for a, kw in others if any(t.requires_grad for t in a[:1])]
            plain = served.signature(name, args, kwargs)
            assert all(served.signature(name, a, kw) == plain for a, kw in grad)
    finally:
        served.reset()


def test_a_packed_call_with_its_longest_length_as_a_tensor_is_served_by_its_value(fastest):
    """transformers' packed rows pass max_seqlen as a 0-d tensor: a call whose value falls in
    another bucket is decided for that bucket, not served from the first one's signature."""
    guarded = fastest.guarded("flash_attn_varlen_func")
    with events.capture() as seen:
        for most in (200, 600, 200, 600):
            args, kwargs = _packed(most_q=torch.tensor(most), most_k=torch.tensor(most))
            guarded(*args, **kwargs)
    said = [e["bucket"] for e in seen if e["event"] == "kernel_selected"]
    assert len(said) == 2 and said[0] != said[1] and fastest.raced == 2
    assert fastest.ran == ["torch_flash"] * 4
    assert not [e for e in seen if e["event"] == "internal_error"]


def test_a_call_with_an_argument_that_cannot_be_hashed_is_served(fastest):
    """A window given as a list (flash_attn_func compares its keyword arguments as a dict): the
    call is decided once and served, nothing fails."""
    guarded = fastest.guarded("flash_attn_func")
    args, kwargs = _dense(window_size=[-1, -1])
    with events.capture() as seen:
        for _ in range(3):
            guarded(*args, **kwargs)
    assert fastest.ran == ["torch_flash"] * 3 and fastest.raced == 1
    assert not [e for e in seen if e["event"] == "internal_error"]


# --- the modes ---------------------------------------------------------------------------------


def test_a_served_signature_follows_the_mode_in_force(fastest):
    """warn / strict: the decision is said (applied: false) and the requested kernel computes,
    also for calls served by signature; back in fix mode the next call gets the faster kernel
    (said once: the event is counted, not repeated)."""
    guarded = fastest.guarded("flash_attn_func")
    args, kwargs = _dense()
    with events.capture() as seen:
        attnguard.configure(mode="warn")
        guarded(*args, **kwargs)
        guarded(*args, **kwargs)
        attnguard.configure(mode="strict")  # said, never raised: nothing is broken
        guarded(*args, **kwargs)
        attnguard.configure(mode="fix")
        guarded(*args, **kwargs)
        guarded(*args, **kwargs)
    assert fastest.ran == ["requested"] * 3 + ["torch_flash"] * 2
    said = [e for e in seen if e["event"] == "kernel_selected"]
    assert [e["applied"] for e in said] == [False] and fastest.raced == 1
    assert not [e for e in seen if e["event"] == "internal_error"]


# --- torch.compile -----------------------------------------------------------------------------


def test_a_compiled_graph_takes_the_decided_kernel_and_says_nothing(fastest, monkeypatch):
    """Inside a trace nothing is decided, said, counted or remembered: a bucket decided by an
    eager call puts its kernel into the graph, whole (fullgraph=True)."""
    from attnguard.selection import served

    def winner(a: tuple[Any, ...], k: dict[str, Any]) -> Any:
        return a[0].float() * 2.0  # traced into the graph: float32 out, where flash-attn's is bf16

    monkeypatch.setattr(race, "implementations", lambda *a: {fastest.winner: winner})
    monkeypatch.setattr(buckets, "bucket", _as_cuda)
    guarded = fastest.guarded("flash_attn_func")
    q, k = torch.ones(1, 1, 4, 64, dtype=BF16), torch.ones(1, 16, 2, 64, dtype=BF16)
    q, k = q.to("meta"), k.to("meta")  # not CPU tensors: flash-attn's guard leaves them be

    def attend(q: Any, k: Any) -> Any:
        return guarded(q, k, k, causal=True) + 1.0

    with events.capture() as seen:
        attend(q, k)  # eager: decided
        remembered = {n: dict(t) for n, t in served._tables.items()}
        counts = [c[0] for c in decisions._state.calls.values()]
        torch._dynamo.reset()
        out = torch.compile(attend, fullgraph=True, backend="eager")(q, k)
    assert out.shape == q.shape and out.dtype == torch.float32  # the decided kernel computed
    assert len([e for e in seen if e["event"] == "kernel_selected"]) == 1
    assert not [e for e in seen if e["event"] == "internal_error"]
    assert {n: dict(t) for n, t in served._tables.items()} == remembered
    assert [c[0] for c in decisions._state.calls.values()] == counts


def _as_cuda(entry: str, call: dict[str, Any]) -> Any:
    """The bucket of a meta call as if it were a CUDA one (a trace cannot keep CudaLike's
    answer: it sees a meta tensor)."""
    q = call["q"]
    return (entry, "bfloat16", q.shape[-1], q.shape[-2], 2, True, (-1, -1), False, False, True)
