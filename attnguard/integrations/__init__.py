"""One package per patched library, each owning everything attnguard knows about that library."""
