"""The one exception attnguard raises on purpose (strict mode)."""

from __future__ import annotations


class AttnGuardError(RuntimeError):
    """Raised in strict mode instead of applying a remedy.

    ``reason_code`` / ``reason`` say what is wrong; ``remedy`` says what fix mode would have done.
    """

    def __init__(self, reason_code: str, reason: str, remedy: str) -> None:
        super().__init__(f"[{reason_code}] {reason} (attnguard fix mode would: {remedy})")
        self.reason_code = reason_code
        self.reason = reason
        self.remedy = remedy
