"""The patch ledger (exact restore, only what is still ours) and the fail-open call helper."""

from __future__ import annotations

import types

import pytest

from attnguard.failopen import fail_open
from attnguard.integrations.ledger import Ledger
from attnguard.observability import events


class Owner:
    @classmethod
    def load(cls, x: int) -> int:
        return x + 1

    def plain(self) -> str:
        return "plain"


def test_patch_then_unpatch_restores_the_exact_objects() -> None:
    mod = types.ModuleType("m")
    mod.f = lambda x: x * 2
    orig_f, orig_load = mod.f, vars(Owner)["load"]
    ledger = Ledger("t")
    ledger.patch(mod, "f", lambda o: lambda x: o(x) + 100)
    ledger.patch(Owner, "load", lambda o: classmethod(lambda cls, x: o.__func__(cls, x) * 10))
    assert mod.f(1) == 102 and Owner.load(1) == 20
    assert ledger.unpatch_all() == []
    assert mod.f is orig_f and vars(Owner)["load"] is orig_load and Owner.load(1) == 2


def test_inherited_attribute_is_removed_again_not_copied() -> None:
    class Child(Owner):
        pass

    ledger = Ledger("t")
    ledger.patch(Child, "plain", lambda o: lambda self: "wrapped " + o(self))
    assert Child().plain() == "wrapped plain"
    ledger.unpatch_all()
    assert "plain" not in vars(Child) and Child().plain() == "plain"


def test_patching_twice_is_idempotent() -> None:
    mod = types.ModuleType("m")
    mod.f = lambda: 1
    ledger = Ledger("t")
    w1 = ledger.patch(mod, "f", lambda o: lambda: o() + 1)
    w2 = ledger.patch(mod, "f", lambda o: lambda: o() + 1)
    assert w1 is w2 and mod.f() == 2 and len(ledger.records) == 1


def test_unpatch_leaves_a_later_patch_by_someone_else_alone() -> None:
    mod = types.ModuleType("m")
    mod.f = lambda: "orig"
    ledger = Ledger("t")
    ledger.patch(mod, "f", lambda o: lambda: "ours")

    def theirs() -> str:
        return "theirs"

    mod.f = theirs
    skipped = ledger.unpatch_all()
    assert mod.f is theirs and [r.attr for r in skipped] == ["f"]


def test_internal_error_returns_the_original_result_and_reports_once(guard, captured) -> None:
    calls: list[int] = []

    def original(x: int) -> int:
        calls.append(x)
        return x * 3

    def broken_guard(call, x: int) -> int:
        raise KeyError("bug in attnguard")

    for _ in range(3):
        assert fail_open("site.a", original, broken_guard, (2,), {}) == 6
    assert calls == [2, 2, 2]
    errs = [e for e in captured if e["event"] == "internal_error"]
    assert len(errs) == 1 and errs[0]["reason_code"] == "KeyError" and errs[0]["level"] == "error"
    assert events.counts()[("internal_error", "site.a", "KeyError")] == 3


def test_the_originals_own_error_propagates_untouched(guard, captured) -> None:
    boom = RuntimeError("kernel says no")

    def original() -> None:
        raise boom

    with pytest.raises(RuntimeError) as err:
        fail_open("site.b", original, lambda call: call(), (), {})
    assert err.value is boom
    assert not [e for e in captured if e["event"] == "internal_error"]


def test_a_failed_recovery_still_shows_the_users_the_original_error(guard, captured) -> None:
    boom = RuntimeError("kernel says no")

    def original() -> None:
        raise boom

    def recovering_guard(call) -> None:
        try:
            call()
        except RuntimeError:
            raise ZeroDivisionError("our fallback broke") from None

    with pytest.raises(RuntimeError) as err:
        fail_open("site.c", original, recovering_guard, (), {})
    assert err.value is boom
    assert [e["reason_code"] for e in captured if e["event"] == "internal_error"] == [
        "ZeroDivisionError"
    ]


def test_dict_items_are_patched_and_restored_like_attributes() -> None:
    registry = {"sdpa": lambda: "sdpa", "flash": lambda: "flash"}
    orig = dict(registry)
    ledger = Ledger("t")
    ledger.patch_item(registry, "sdpa", lambda o: lambda: "guarded " + o())
    again = ledger.patch_item(registry, "sdpa", lambda o: lambda: "twice " + o())
    assert registry["sdpa"]() == "guarded sdpa" and again is registry["sdpa"]

    def theirs() -> str:
        return "theirs"

    registry["flash"] = theirs  # someone registers their own after us...
    ledger.patch_item(registry, "flash", lambda o: lambda: "guarded " + o())
    assert registry["flash"]() == "guarded theirs"
    assert ledger.unpatch_all() == []
    # ...and gets theirs back; the untouched entry gets its very original
    assert registry["flash"] is theirs and registry["sdpa"] is orig["sdpa"]


def test_a_replaced_dict_item_is_left_alone() -> None:
    registry = {"sdpa": lambda: "sdpa"}
    ledger = Ledger("t")
    ledger.patch_item(registry, "sdpa", lambda o: lambda: "ours")
    registry["sdpa"] = replacement = lambda: "theirs"  # noqa: E731
    assert [r.attr for r in ledger.unpatch_all()] == ["sdpa"]
    assert registry["sdpa"] is replacement
