"""The paper's pieces, pure and testable without a trainer: MAGIC's token-level loss and adaptive entropy control
(§3.1), rejection sampling, the 80/20 token mask, prompt filtering and the stage schedule, rollout correction, and the
valid range of every knob.

Imports nothing of `or1_trl` outside `recipe/` (torch, numpy and the standard library only:
`tests/test_layout.py::test_recipe_imports_only_the_standard_library_torch_and_numpy`); what drives a trainer with
these pieces (the stages' walk, the rollout's record, the accelerator's gathers) is `trainer/`'s.
"""
