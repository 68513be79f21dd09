"""Train a reasoning model with the Skywork-OR1 MAGIC recipe (OR1Trainer = TRL's GRPOTrainer + the paper).

    accelerate launch examples/train_or1.py                    # no arguments: the offline demo (tiny model, CPU;
                                                               # starts over in outputs/or1-demo every run)
    accelerate launch examples/train_or1.py --config examples/recipes/skywork_or1_math_7b.yaml
    accelerate launch --config_file configs/accelerate/cpu_2proc.yaml examples/train_or1.py \
        --model_name_or_path <model> --dataset_name <dataset> --output_dir outputs/run

With arguments it is `or1-trl train`: every `OR1Config` / `GRPOConfig` field and TRL's `ModelConfig` fields are
flags (`python examples/train_or1.py --help`); the code is `or1_trl/cli/train.py` and `or1_trl/cli/run.py`. The demo with options: `or1-trl demo
--help`.
"""

import sys

from or1_trl.cli import demo, train

if __name__ == "__main__":
    if len(sys.argv) > 1:
        train(sys.argv[1:], prog=None)  # prog=None: the usage line names this script
    else:
        demo([], prog=None)
