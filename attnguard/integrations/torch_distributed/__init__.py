"""The process group as the job summary sees it (:mod:`.process_group`). Light until patched.

Not switchable: nothing it does changes what the program computes, so ATTNGUARD_DISABLE does not
name it, nor ``attnguard.runtime.patched_integrations()``; it is patched whatever torch's version.
"""

from __future__ import annotations

from ..protocol import LibraryIntegration, Part

INTEGRATION = LibraryIntegration(
    name="torch_distributed",
    distribution="torch",
    package="torch",
    low=(0,),
    high=None,
    parts=(
        Part(
            module="attnguard.integrations.torch_distributed.process_group",
            trigger="torch.distributed",
        ),
    ),
    switchable=False,
)
