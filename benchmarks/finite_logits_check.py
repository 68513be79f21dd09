"""Non-finite logits at sampling on a device (issue 47, point 3; `or1_trl/generation/finite_logits.py`): what plain
`generate` does with a NaN in one row's logits, and what it does under the check.

    python benchmarks/finite_logits_check.py [--device cuda] [--json FILE]

The tiny model (`or1_trl.testing`) samples 6 tokens for 4 left-padded prompts, three times from the same seed: (1)
as it is (the reference); (2) with NaN in row 1's logits at the second sampled step (`testing.planted_nan_logits`),
plain `generate`, in a child process, since on CUDA `torch.multinomial` then dies in a device-side assert that leaves
the process's CUDA context unusable: its exit status and the last line it printed; (3) the same NaN under
`finite_sampling`: the rows flagged (expected: [1]), whether every other row's tokens equal the reference's, and row
1's tokens from the NaN on (expected: EOS, then padding). On the CPU (2) raises a RuntimeError ("probability tensor
contains either inf, nan or element < 0"); the point of running it on a GPU is that (3) ends as cleanly there.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys

import torch
from transformers import GenerationConfig

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # or1_trl from this checkout
from or1_trl.generation.finite_logits import finite_sampling  # noqa: E402
from or1_trl.testing import planted_nan_logits, tiny_model_and_tokenizer  # noqa: E402

NAN_ROW, NAN_STEP, NEW_TOKENS = 1, 2, 6


def batch(tokenizer, device: str):
    """4 prompts, the third cut to 2 tokens: `[4, P]` left-padded ids and their attention mask."""
    prompts = [tokenizer(f"{i} + {i} = ")["input_ids"] for i in range(4)]
    prompts[2] = prompts[2][:2]
    width, pad = max(map(len, prompts)), tokenizer.pad_token_id
    input_ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device=device)  # [4, P]
    attention_mask = (input_ids != pad).long()  # [4, P]
    return input_ids, attention_mask


def sample(model, input_ids, attention_mask):
    config = GenerationConfig(max_new_tokens=NEW_TOKENS, do_sample=True, eos_token_id=model.config.eos_token_id,
                              pad_token_id=model.config.pad_token_id, top_k=0)
    torch.manual_seed(0)
    return model.generate(input_ids=input_ids, attention_mask=attention_mask, generation_config=config)


def tiny(device: str):
    model, tokenizer = tiny_model_and_tokenizer(seed=0)
    model.config.eos_token_id, model.config.pad_token_id = tokenizer.eos_token_id, tokenizer.pad_token_id
    return model.to(device).eval(), tokenizer


def plain_with_nan(device: str) -> None:
    """(2), in the child process: plain `generate` with the NaN; the device's own error ends it."""
    model, tokenizer = tiny(device)
    input_ids, attention_mask = batch(tokenizer, device)
    with planted_nan_logits(model, row=NAN_ROW, step=NAN_STEP):
        tokens = sample(model, input_ids, attention_mask)
        print(f"plain generate returned {tokens.shape[0]} rows")
        if device == "cuda":
            torch.cuda.synchronize()  # an asynchronous device-side assert surfaces here


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--json", metavar="FILE")
    parser.add_argument("--plain-child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.plain_child:
        plain_with_nan(args.device)
        return {}
    model, tokenizer = tiny(args.device)
    input_ids, attention_mask = batch(tokenizer, args.device)
    reference = sample(model, input_ids, attention_mask)  # [4, P + 6]
    child = subprocess.run([sys.executable, os.path.abspath(__file__), "--plain-child", "--device", args.device],
                           capture_output=True, text=True, timeout=600)
    lines = [line for line in (child.stdout + child.stderr).splitlines() if line.strip()]
    with planted_nan_logits(model, row=NAN_ROW, step=NAN_STEP), finite_sampling(
            model, end_token_id=tokenizer.eos_token_id) as guard:
        checked = sample(model, input_ids, attention_mask)
    width = input_ids.size(1)
    others = [row for row in range(len(reference)) if row != NAN_ROW]
    result = {
        "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu", "torch": torch.__version__,
        "plain_exit_status": child.returncode, "plain_last_line": lines[-1] if lines else "",
        "checked_bad_rows": guard.bad_rows(),
        "checked_other_rows_as_reference": bool(torch.equal(checked[others], reference[others])),
        "checked_nan_row_from_the_nan": checked[NAN_ROW, width + NAN_STEP:].tolist(),
        "eos_token_id": tokenizer.eos_token_id, "pad_token_id": tokenizer.pad_token_id,
    }
    print(f"{result['device']}: plain generate with a NaN in row {NAN_ROW} exited {child.returncode} "
          f"({result['plain_last_line'][:160]}); under the check: rows {result['checked_bad_rows']} flagged, the "
          f"others as sampled without the NaN: {result['checked_other_rows_as_reference']}, row {NAN_ROW} from the "
          f"NaN on: {result['checked_nan_row_from_the_nan']} (EOS {tokenizer.eos_token_id})")
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
