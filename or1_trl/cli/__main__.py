"""`python -m or1_trl.cli ARGS`: the `or1-trl` console script (`accelerate launch -m or1_trl.cli demo` too)."""

from . import main

raise SystemExit(main())
