"""Evaluation with intervals (pass@k, avg@k), the Hub model card and the plots of a run.

May import `recipe/`, `rewards/`, `generation/` and `data/`; never `trainer/` or `cli/`.
"""
