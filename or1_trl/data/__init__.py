"""Training and evaluation data: the released format and its difficulty filter, pre-flight checks, loading files,
`or1-trl prepare`, difficulty estimation and the 1-shot RLVR example selection.

May import `recipe/`, `rewards/` and `generation/` (difficulty estimation samples); never `trainer/`, `eval/` or
`cli/`.
"""
