"""Generation throughput, HF `generate` vs a vLLM server, and the cost of the disk weight sync, in one run.

    python benchmarks/generation.py [--reps 3] [--lengths 8 64] [--models tiny smollm2] [--sizes tiny 0.5b smollm2]
                                    [--model-dir DIR] [--markdown FILE] [--json FILE]
    python benchmarks/generation.py --quick      # seconds-scale smoke run (the tests use it: the tiny model only)

Throughput (`--models`): on the tiny model, the offline demo's rollout shape (16 prompts x 8 samples, the demo's
addition prompts) at its completion length (8 tokens) and 8x longer (64, `--lengths`); on SmolLM2-135M-Instruct
(`smollm2`: `or1-trl model smollm2`'s folder, or `--model-dir`), the real-model demo's (4 prompts of the arithmetic
ladder x 8 samples, 48 tokens; the server in bf16, `real_model.BF16_SERVER_ARGS`). The backends
generate exactly that many tokens (EOS is ignored), from the same prompts, interleaved, `--reps` times (median
reported). HF `generate` runs in this process on the fp32 model (one batch of all rows, as `GRPOTrainer` does without
vLLM); on the real model also under bf16 autocast, as the demo's trainer runs it (`bf16=True`: accelerate wraps the
model's forward in autocast, `generate` included). vLLM is the CPU build in its own venv
(`scripts/install_vllm_cpu.sh`), started with `or1-trl serve --weight-sync disk` and asked through TRL's
`VLLMClient.generate`, as the trainer does. Goal on the real model: vLLM ≥ 5× the tokens/s of the trainer's HF
`generate` (bf16 autocast).

Paired rollouts (issue 48): the same rollouts seeded as `OR1Config.rollout_seed` seeds them — on the server one
seeded request per prompt (`seeded.seeded_requests`) against TRL's one request, in HF `generate` the counter-based
Gumbel-max sampler (`seeded.seeded_sampling`, fp32) against plain sampling — interleaved with the unseeded ones; the
cost is the median over reps of seeded ÷ unseeded seconds, each pair from one rep. Goal: ≤ 1.1× on the CPU server.

Weight sync (issue 26): seconds per `DiskWeightSync` push, the step's sync cost, split as `last_breakdown` splits it
(gather: producing the tensors; write: casting and writing the safetensors; load: the server's reload; cache
reset), for the tiny model, a randomly initialised model shaped like Qwen2.5-0.5B and SmolLM2-135M-Instruct's real
weights (`--sizes`), each served by its own server started with `--enable-lora` (tiny: fp32; 0.5B and SmolLM2: bf16,
as a GPU server runs). Rows: the full weights written
as the model holds them (fp32) and in the server's dtype (`vllm_sync_dtype="server"`), to tmpfs (`/dev/shm`, the
default when it has room) and to a directory on disk; and with a LoRA policy (all linear layers) the merged weights
(TRL's iterator: merge, read, unmerge) against the adapter alone (`vllm_sync_peft="adapter"`, loaded with
`/v1/load_lora_adapter`; the base is pushed once before, not counted). End-to-end rate = bytes written / seconds per
push. Below the table: the 7B bf16 projection at the 0.5B bf16 rate.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

import torch

from or1_trl.demos.tiny import addition_dataset
from or1_trl.demos.real_model import (BF16_SERVER_ARGS, CONTEXT, HELD_OUT_PER_RUNG, PROMPTS_PER_STEP,
                                      TRAIN_PER_RUNG)
from or1_trl.demos.ladder import ladder_split
from or1_trl.generation.sampling import prompt_token_ids
from or1_trl.generation.serve import free_port, running_server, start_server
from or1_trl.testing import VLLM_CPU_ARGS, save_tiny_model, tiny_model, tiny_tokenizer, vllm_python
from or1_trl.generation.disk_sync import SYNC_PHASES, DiskWeightSync
from or1_trl.generation.seeded import KEY_FIELD, RolloutKey, seeded_sampling
from or1_trl.generation.vllm_client import http_vllm_client
from or1_trl.generation.weight_files import user_dir

PROMPTS, GROUP = 16, 8
MODEL_LABELS = {"tiny": "tiny (test model)", "smollm2": "SmolLM2-135M-Instruct"}
REAL_MODEL_GOAL = 5.0  # vLLM / HF generate tokens/s on the real model (issue 34)
HF_AUTOCAST = "HF generate, bf16 autocast (the trainer's)"
HF_SEEDED, VLLM_SEEDED = "HF generate, seeded", "vLLM server, seeded"  # paired rollouts (`rollout_seed`), fp32
PAIRED_KEY = RolloutKey(seed=0, step=0)
PAIRED_GOAL = 1.1  # seeded / unseeded seconds of a rollout on the CPU server (issue 48)
# Qwen2.5-0.5B's shape (random weights): what "0.5b" means below.
QWEN_05B = dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True, max_position_embeddings=1024)
QWEN_7B_PARAMS = 7.62e9  # Qwen2.5-7B / DeepSeek-R1-Distill-Qwen-7B
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
LORA_RANK = 16


def hf_generate(model, tokenizer, prompt_ids, length, autocast=False, seeded=False):
    """One batch of len(prompt_ids) x GROUP rows, left-padded, sampling exactly `length` new tokens each; with
    `autocast`, under bf16 autocast (how the trainer's HF `generate` runs with `bf16=True`: accelerate wraps the
    model's forward in it); `seeded`: through `seeded_sampling` (paired rollouts, `rollout_seed`)."""
    rows = [ids for ids in prompt_ids for _ in range(GROUP)]
    width = max(map(len, rows))
    pad = tokenizer.pad_token_id
    input_ids = torch.tensor([[pad] * (width - len(r)) + r for r in rows])
    attention = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
    keyed = seeded_sampling(model, PAIRED_KEY, pad_token_id=pad) if seeded else contextlib.nullcontext()
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast), keyed:
        out = model.generate(input_ids=input_ids, attention_mask=attention, do_sample=True, temperature=1.0,
                             max_new_tokens=length, min_new_tokens=length, pad_token_id=pad)
    return out[:, width:].numel()


def vllm_generate(client, prompt_ids, length, seeded=False):
    """TRL's request of the rollout; `seeded`: keyed as `OR1Trainer` keys it with `rollout_seed` (one seeded request
    per prompt, `seeded.seeded_requests`)."""
    key = {KEY_FIELD: PAIRED_KEY.as_field()} if seeded else {}
    out = client.generate(prompts=prompt_ids, n=GROUP, temperature=1.0, max_tokens=length,
                          generation_kwargs={"ignore_eos": True, **key})
    return sum(len(c) for c in out["completion_ids"])


def timed(fn, *args):
    start = time.perf_counter()
    tokens = fn(*args)
    return time.perf_counter() - start, tokens


def serve(model_path, workdir, log_name, extra_args=()):
    log = open(os.path.join(workdir, log_name), "w")
    return start_server(model_path, "disk", port=free_port(), python=vllm_python(),
                        extra_args=VLLM_CPU_ARGS + list(extra_args), log_file=log, enable_lora=True,
                        max_lora_rank=LORA_RANK, sync_roots=[user_dir(), workdir])  # it loads from tmpfs and workdir


def smollm2_model(model_dir):
    """SmolLM2-135M-Instruct in fp32 (as the trainer holds it) and its tokenizer, from `model_dir`."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval(), AutoTokenizer.from_pretrained(model_dir)


def throughput_setup(name, args, workdir):
    """(model, tokenizer, its folder, prompt ids, server flags, lengths, HF backends) of throughput model `name`."""
    if name == "tiny":
        tokenizer = tiny_tokenizer()
        model = tiny_model(tokenizer, seed=0).eval()
        path = save_tiny_model(os.path.join(workdir, "tiny"), model=model, tokenizer=tokenizer)
        prompt_ids = [tokenizer(row["prompt"])["input_ids"] for row in addition_dataset(PROMPTS, seed=0)]
        return model, tokenizer, path, prompt_ids, VLLM_CPU_ARGS, args.lengths, {"HF generate": False}
    model, tokenizer = smollm2_model(args.model_dir)
    train, _ = ladder_split(TRAIN_PER_RUNG, HELD_OUT_PER_RUNG, seed=0)  # the real-model demo's training prompts
    prompt_ids = [prompt_token_ids(tokenizer, row["prompt"]) for row in train.select(range(PROMPTS_PER_STEP))]
    return model, tokenizer, args.model_dir, prompt_ids, BF16_SERVER_ARGS, [CONTEXT], {"HF generate": False,
                                                                                  HF_AUTOCAST: True}


def throughput(args, workdir, lines, figures):
    if not args.models:
        return
    lines += ["| model | completion tokens | backend | completions/s | tokens/s | vs HF |", "|---|---|---|---|---|---|"]
    for name in args.models:
        model, tokenizer, path, prompt_ids, server_args, lengths, hf = throughput_setup(name, args, workdir)
        with running_server(path, "disk", log_path=os.path.join(workdir, f"server_{name}.log"), python=vllm_python(),
                            extra_args=server_args) as url:
            client = http_vllm_client(base_url=url, connection_timeout=60)
            vllm_generate(client, prompt_ids, 4)  # warm-up all
            for autocast in hf.values():
                hf_generate(model, tokenizer, prompt_ids, 4, autocast)
            vllm_generate(client, prompt_ids, 4, seeded=True)
            for length in lengths:
                runs = {backend: [] for backend in [*hf, HF_SEEDED, "vLLM server", VLLM_SEEDED]}
                for _ in range(args.reps):  # interleaved
                    for backend, autocast in hf.items():
                        runs[backend].append(timed(hf_generate, model, tokenizer, prompt_ids, length, autocast))
                    runs[HF_SEEDED].append(timed(hf_generate, model, tokenizer, prompt_ids, length, False, True))
                    runs["vLLM server"].append(timed(vllm_generate, client, prompt_ids, length))
                    runs[VLLM_SEEDED].append(timed(vllm_generate, client, prompt_ids, length, True))
                for plain, keyed in (("HF generate", HF_SEEDED), ("vLLM server", VLLM_SEEDED)):  # paired by rep
                    ratios = [s / p for (s, _), (p, _) in zip(runs[keyed], runs[plain])]
                    figures["paired"].append({"model": name, "length": length, "backend": plain,
                                              "seeded_over_unseeded": ratios,
                                              "median": statistics.median(ratios)})
                hf_rate = None
                for backend, measured in runs.items():
                    seconds = statistics.median(s for s, _ in measured)
                    tokens = measured[0][1]
                    rate = len(prompt_ids) * GROUP / seconds
                    hf_rate = hf_rate or rate
                    lines.append(f"| {MODEL_LABELS[name]} | {length} | {backend} | {rate:.1f} | {tokens / seconds:.0f} | "
                                 f"{rate / hf_rate:.2f}x |")
                    figures["throughput"].append({"model": name, "length": length, "backend": backend,
                                                  "seconds": seconds, "tokens": tokens, "completions_per_s": rate,
                                                  "tokens_per_s": tokens / seconds, "vs_hf": rate / hf_rate})
                    print(f"{name} length {length}: {backend} {seconds:.3f} s for {tokens} tokens", file=sys.stderr)
        del model
    if figures["paired"]:
        lines += ["", f"Paired rollouts (`rollout_seed`): seconds of a seeded rollout over an unseeded one, the median of "
                  f"{args.reps} interleaved pairs (goal on the vLLM server ≤ {PAIRED_GOAL:g}×):", ""]
        for row in figures["paired"]:
            verdict = ("" if row["backend"] != "vLLM server" else
                       " (met)" if row["median"] <= PAIRED_GOAL else " (**missed**)")
            each = ", ".join(f"{ratio:.2f}" for ratio in row["seeded_over_unseeded"])
            lines.append(f"- {MODEL_LABELS[row['model']]}, {row['length']} tokens, {row['backend']}: "
                         f"{row['median']:.2f}×{verdict} (each pair: {each})")
    real = {row["backend"]: row for row in figures["throughput"] if row["model"] == "smollm2"}
    if real:  # issue 34's goal on the real model: vLLM against the trainer's own HF generate (bf16 autocast)
        vllm, fp32, trainer = real["vLLM server"], real["HF generate"], real[HF_AUTOCAST]
        figures["real_model_vs_trainer_hf"] = ratio = vllm["tokens_per_s"] / trainer["tokens_per_s"]
        verdict = "met" if ratio >= REAL_MODEL_GOAL else "**missed**"
        lines += ["", f"SmolLM2-135M-Instruct at the real-model demo's rollout shape ({PROMPTS_PER_STEP} prompts × {GROUP}, "
                  f"{vllm['length']} tokens): the bf16 vLLM server generates {ratio:.1f}× the tokens/s of HF `generate` "
                  f"as the demo's trainer runs it (bf16 autocast; goal ≥ {REAL_MODEL_GOAL:g}×: {verdict}), "
                  f"{vllm['tokens_per_s'] / fp32['tokens_per_s']:.1f}× those of HF `generate` in fp32."]


def merged_params(peft):
    """TRL's `_iter_named_params` for a PEFT model without sharding: merge, read under vLLM's names, unmerge."""
    peft.merge_adapter()
    try:
        for name, param in peft.named_parameters():
            if peft.prefix not in name:
                yield name.removeprefix("base_model.model.").replace(".base_layer", ""), param.data
    finally:
        peft.unmerge_adapter()


def base_params(peft):
    for name, param in peft.named_parameters():
        if peft.prefix not in name:
            yield name.removeprefix("base_model.model.").replace(".base_layer", ""), param.data


def measure(sync, reps, push):
    """`push()` `reps` times, new weights each time; the median of each phase and of the total."""
    runs = []
    for _ in range(reps):
        push()
        runs.append({**sync.last_breakdown, "total": sync.last_seconds})
    return {key: statistics.median(run[key] for run in runs) for key in runs[0]}


def sync_cost(args, workdir, lines, figures):
    from peft import LoraConfig, get_peft_model, get_peft_model_state_dict

    if not args.sizes:
        return
    lines += ["", "| model | sent | server | written as | sync dir | MiB written | gather | write | load | cache reset | "
              "per sync (median) | end to end |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    projection = None
    for size in args.sizes:
        if size == "smollm2":
            model, path = smollm2_model(args.model_dir)[0], args.model_dir
        else:
            tokenizer = tiny_tokenizer()
            model = tiny_model(tokenizer, seed=0, **(QWEN_05B if size == "0.5b" else {}))
            path = save_tiny_model(os.path.join(workdir, size), model=model, tokenizer=tokenizer)
        server_dtype = "float32" if size == "tiny" else "bfloat16"
        process, url = serve(path, workdir, f"server_{size}.log", ["--dtype", server_dtype])
        name = {"0.5b": "Qwen2.5-0.5B shape, random", "smollm2": "SmolLM2-135M-Instruct (real)"}.get(size, MODEL_LABELS[size])
        params = sum(p.numel() for p in model.parameters())
        label = f"{name}, {params / 1e6:.1f} M"
        tmpfs_dir = tempfile.mkdtemp(prefix="or1-bench-", dir=user_dir())
        disk_dir = os.path.join(workdir, f"sync_{size}")  # the system's temp dir, on disk here (ext4)

        def row(sent, written_as, where, sync, timing):
            rate = sync.last_bytes / timing["total"] / 1e9
            lines.append(f"| {label} | {sent} | {server_dtype} | {written_as} | {where} | {sync.last_bytes / 2**20:.1f} | "
                         + " | ".join(f"{timing[phase]:.2f} s" for phase in SYNC_PHASES)
                         + f" | {timing['total']:.2f} s | {rate:.2f} GB/s |")
            print(f"sync {size} {sent} {written_as} {where}: {timing}", file=sys.stderr)
            figures["sync"].append({"model": label, "sent": sent, "written_as": written_as, "where": where,
                                    "bytes": sync.last_bytes, "seconds": timing, "gb_per_s": rate})
            return rate

        def step():
            with torch.no_grad():
                next(model.parameters()).add_(1e-3)  # new weights each push, as after an optimizer step

        try:
            cases = [("model", tmpfs_dir, "tmpfs"), ("server", tmpfs_dir, "tmpfs")]
            if not args.quick:
                cases.append(("server", disk_dir, "disk (ext4)"))
            for dtype, directory, where in cases:
                sync = DiskWeightSync(url, directory, dtype=dtype)
                sync.check_server()
                timing = measure(sync, args.reps, lambda: (step(), sync.push(model.named_parameters())))
                written_as = str(sync.dtype or next(model.parameters()).dtype).removeprefix("torch.")
                rate = row("full weights", f"{written_as} ({dtype!r})", where, sync, timing)
                if size == "0.5b" and dtype == "server" and where == "tmpfs":
                    projection = (rate, timing)
                shutil.rmtree(sync.sync_dir, ignore_errors=True)
            peft = get_peft_model(model, LoraConfig(r=LORA_RANK, lora_alpha=2 * LORA_RANK, target_modules=LORA_TARGETS))

            def lora_step():
                with torch.no_grad():
                    for pname, param in peft.named_parameters():
                        if "lora_B" in pname:
                            param.normal_(0, 1e-3)

            sync = DiskWeightSync(url, tmpfs_dir, dtype="server")
            sync.check_server()
            timing = measure(sync, args.reps, lambda: (lora_step(), sync.push(merged_params(peft))))
            row(f"LoRA r={LORA_RANK}: merged", f"{server_dtype} ('server')", "tmpfs", sync, timing)
            shutil.rmtree(sync.sync_dir, ignore_errors=True)
            sync = DiskWeightSync(url, tmpfs_dir, dtype="server")
            sync.check_server()
            config = peft.peft_config["default"].to_dict()
            sync.push_adapter(get_peft_model_state_dict(peft).items(), config, base=base_params(peft))
            timing = measure(sync, args.reps, lambda: (
                lora_step(), sync.push_adapter(get_peft_model_state_dict(peft).items(), config)))
            row(f"LoRA r={LORA_RANK}: adapter only", f"{server_dtype} ('server')", "tmpfs", sync, timing)
            model = peft.unload()
        finally:
            shutil.rmtree(tmpfs_dir, ignore_errors=True)
            process.terminate()
            process.wait()
        del model
    if projection is not None:
        rate, timing = projection
        size_7b = QWEN_7B_PARAMS * 2
        shares = ", ".join(f"{phase} {timing[phase] / timing['total']:.0%}" for phase in SYNC_PHASES)
        lines += ["", f"7B in bf16 ({size_7b / 1e9:.1f} GB a push) at the 0.5B bf16 tmpfs rate ({rate:.2f} GB/s end to "
                  f"end): about {size_7b / (rate * 1e9):.0f} s per sync on this machine, if it scales with the bytes "
                  f"(the 0.5B push: {shares})."]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--lengths", type=int, nargs="+", default=[8, 64], help="completion lengths (tokens)")
    parser.add_argument("--models", nargs="*", default=["tiny", "smollm2"], choices=["tiny", "smollm2"],
                        help="throughput on these models")
    parser.add_argument("--sizes", nargs="*", default=["tiny", "0.5b", "smollm2"], choices=["tiny", "0.5b", "smollm2"],
                        help="weight sync of these models")
    parser.add_argument("--model-dir", help="the SmolLM2 folder (default: or1-trl model smollm2's, built if missing)")
    parser.add_argument("--quick", action="store_true", help="1 rep, length 4, tiny model only")
    parser.add_argument("--markdown", help="also write the tables to this file")
    parser.add_argument("--json", metavar="FILE", help="also write the tables' figures, unrounded, to FILE")
    args = parser.parse_args(argv)
    if args.quick:
        args.reps, args.lengths, args.models, args.sizes = 1, [4], ["tiny"], ["tiny"]
    if "smollm2" in args.models + args.sizes and args.model_dir is None:
        from or1_trl.models import model_folder

        args.model_dir = model_folder("smollm2")
    if vllm_python() is None:
        sys.exit("no vLLM CPU venv: run scripts/install_vllm_cpu.sh (or set OR1_VLLM_PYTHON)")
    lines, figures = [], {"throughput": [], "sync": [], "paired": []}
    with tempfile.TemporaryDirectory() as workdir:
        throughput(args, workdir, lines, figures)
        sync_cost(args, workdir, lines, figures)
    text = "\n".join(lines) + "\n"
    print(text)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(text)
    if args.json:  # what the tables were computed from (the tests read these, not the rounded text)
        with open(args.json, "w") as f:
            json.dump(figures, f, indent=1)


if __name__ == "__main__":
    main()
