"""The paper's pieces, pure and testable without a trainer: MAGIC's token-level loss and adaptive entropy control
(§3.1), rejection sampling, the 80/20 token mask, prompt filtering and the stage schedule, rollout records and
rollout correction, and the valid range of every knob.

Imports nothing of `or1_trl` outside `recipe/` (torch, numpy and the standard library only).
"""
