"""Moved to `or1_trl.generation.sampling` (Sampling for evaluation and difficulty estimation); this alias stays for one release.

`import or1_trl.sampling` gives the module `or1_trl.generation.sampling` itself (its names, and what a test patches on it).
"""

import sys
import warnings

from .generation import sampling as _module

warnings.warn("or1_trl.sampling moved to or1_trl.generation.sampling; the old path goes in the next release",
              DeprecationWarning, stacklevel=2)
sys.modules[__name__] = _module
