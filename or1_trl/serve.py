"""Moved to `or1_trl.generation.serve` (`or1-trl serve`); this alias stays for one release.

`import or1_trl.serve` gives the module `or1_trl.generation.serve` itself (its names, and what a test patches on it).
"""

import sys
import warnings

from .generation import serve as _module

warnings.warn("or1_trl.serve moved to or1_trl.generation.serve; the old path goes in the next release",
              DeprecationWarning, stacklevel=2)
sys.modules[__name__] = _module
