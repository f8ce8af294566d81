"""The transformers integration: everything attnguard knows about transformers.

Two parts: :mod:`.availability` is patched as soon as ``transformers.utils.import_utils`` exists
(before ``transformers.utils`` binds its availability checks, and long before
``transformers.modeling_utils``, whose import runs those checks on 4.49-4.54), :mod:`.modeling`
(model loading, the attention registry and the flash code path) when
``transformers.modeling_utils`` is imported. This package stays light: nothing is imported until
a part is patched.
"""

from __future__ import annotations

from ..protocol import LibraryIntegration, Part

INTEGRATION = LibraryIntegration(
    name="transformers",
    distribution="transformers",
    package="transformers",
    low=(4, 49),
    high=(6,),
    parts=(
        Part(
            module="attnguard.integrations.transformers.availability",
            trigger="transformers.utils.import_utils",
        ),
        Part(
            module="attnguard.integrations.transformers.modeling",
            trigger="transformers.modeling_utils",
        ),
    ),
)
