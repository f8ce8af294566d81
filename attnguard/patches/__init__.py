"""One module per patched library, each a ``patch(module)`` / ``unpatch()`` pair with a ledger.

``TARGET_MODULE`` in each names the import that triggers its patch (a post-import hook).
"""

# integration name (as in ATTNGUARD_DISABLE) -> patch module
INTEGRATIONS = {
    "transformers": "attnguard.patches.transformers",
    "flash_attn": "attnguard.patches.flash_attn",
    "xformers": "attnguard.patches.xformers",
}
