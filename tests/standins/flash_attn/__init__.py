"""STAND-IN for flash-attn 2.8.3 (attnguard tests only; not the real package).

See ``tests/standins/README.md``: enforces the real input contract and error messages, computes
with torch SDPA, never imports attnguard.
"""

__version__ = "2.8.3"
IS_ATTNGUARD_STANDIN = True

from flash_attn.flash_attn_interface import (  # noqa: E402
    flash_attn_func,
    flash_attn_kvpacked_func,
    flash_attn_qkvpacked_func,
    flash_attn_varlen_func,
    flash_attn_with_kvcache,
)

__all__ = [
    "flash_attn_func",
    "flash_attn_kvpacked_func",
    "flash_attn_qkvpacked_func",
    "flash_attn_varlen_func",
    "flash_attn_with_kvcache",
]
