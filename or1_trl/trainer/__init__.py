"""`OR1Trainer` and `OR1Config` (TRL's names: `or1_trainer.py`, `or1_config.py`): the recipe wired into TRL's
`GRPOTrainer` hooks, and what only a training run needs: the stages as it walks them, the rollout's record, verified
checkpoints, metrics and callbacks, reward checks, the log-probability backends, packing and several processes.

May import `recipe/`, `rewards/`, `generation/`, `data/` and `eval/`; nothing imports it but `cli/` and the package
root. Importing this package loads nothing: `from or1_trl import OR1Trainer` loads torch and TRL on first use.
"""
