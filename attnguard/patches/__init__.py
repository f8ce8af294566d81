"""One module per patched library, each a ``patch(module)`` / ``unpatch()`` pair with a ledger.

Each patch module is imported only when its library is imported (a post-import hook on the
target module below), so activating attnguard imports neither torch nor any patched library.
"""

# integration name (as in ATTNGUARD_DISABLE) -> (patch module, import that triggers its patch)
INTEGRATIONS = {
    "transformers": ("attnguard.patches.transformers", "transformers.modeling_utils"),
    "flash_attn": ("attnguard.patches.flash_attn", "flash_attn"),
    "xformers": ("attnguard.patches.xformers", "xformers.ops"),
}
