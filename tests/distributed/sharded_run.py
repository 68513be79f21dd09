"""Run by tests/trainer/test_sharding.py: one OR1 run, under `accelerate launch` (2 CPU processes with gloo, or one
process per GPU; DDP, DeepSpeed ZeRO-2/3 or FSDP2) or in one plain process (the reference of the same global batch).

    python tests/distributed/sharded_run.py OUTPUT_DIR '{"features": "all", ...}'

Rollouts come from `or1_trl.testing.rank_independent_sampling`, so the one-process run samples the same completions
as the ranks together, and the rewards are a function of the completion's text, so they agree too. Step 3's rewards
are all equal: every group is rejected everywhere, and its update is skipped. With every feature ("all"), step 2's
gradient of one parameter is NaN on the last rank (`plant_nan`): the non-finite sentinel does not apply that step.
After each optimizer step the main process saves what the comparison needs, gathered whole from the shards
(`state_step<N>.pt`, `tests/helpers.gathered_state`): the parameters, Adam's moments and step counts, the learning
rate, DeepSpeed's engine counters; at the end `result.json` (the backend obtained, the log history, the share of the
parameters a rank holds).

Options (the JSON):
- "features": "all" (rejection with refill, the entropy controller, packing, two stages that change the completion
  length, the batch and the accumulation steps, a checkpoint each step); "lora" (a LoRA adapter, rejection with
  refill, the controller, 80/20: TRL takes its entropy quantile over each micro-step's tokens, so it is compared where
  an optimizer step is one micro-step); "vllm" with "vllm_url" and "vllm_model" (2 steps with rollouts from that vLLM
  server and the weights pushed through a directory, once more at the end; `result.json` then says how far the
  server's log-probs are from those of the weights gathered whole).
- "resume": `resume_from_checkpoint` (a copy of a run cut short); "force_fsdp2": accelerate's FSDP2 state forced on
  CPUs (`tests/helpers.force_fsdp2`); "device": "cpu" (default) or "cuda".
"""

import json
import os
import sys
import zlib

import torch
from datasets import Dataset
from transformers import TrainerCallback

from or1_trl import OR1Config, OR1Trainer
from or1_trl.testing import rank_independent_sampling, tiny_model_and_tokenizer, tiny_training_args
from tests.helpers import force_fsdp2, gathered_state

SKIPPED_STEP = 3  # every group of this step's rollouts (refills too) solved by all its samples
NAN_STEP, NAN_PARAM = 2, "model.norm.weight"  # "all": this step's gradient of this parameter is NaN on the last rank


def reward(prompts, completions, trainer_state, **kwargs):
    if trainer_state.global_step + 1 == SKIPPED_STEP:
        return [1.0] * len(completions)
    return [float(zlib.crc32(c.encode()) % 3 == 0) for c in completions]  # the same on every rank and in one process


def settings(output_dir: str, options: dict, world_size: int) -> dict:
    cpu = options.get("device", "cpu") == "cpu"
    common = dict(
        per_device_train_batch_size=16 // world_size, max_completion_length=6, learning_rate=1e-3, max_steps=4,
        lr_scheduler_type="linear", ddp_backend="gloo" if world_size > 1 and cpu else None, use_cpu=cpu,
        entropy_target=100.0, entropy_coef_delta=0.05,  # the controller raises c every step: α active from step 2
        rejection_refill_rounds=1, save_strategy="steps", save_steps=1, seed=0,
    )
    if options["features"] == "vllm":  # rollouts from the vLLM CPU server, the weights pushed through a directory
        return tiny_training_args(
            output_dir, **{**common, "max_steps": 2, "save_strategy": "no"}, use_vllm=True, vllm_mode="server",
            vllm_server_base_url=options["vllm_url"], vllm_weight_sync="disk", generation_kwargs={"ignore_eos": True})
    if options["features"] == "lora":  # 80/20: its entropy quantile is per micro-step, one micro-step per step here
        return tiny_training_args(output_dir, **common, top_entropy_quantile=0.2)
    return tiny_training_args(
        output_dir, **common, padding_free=True, max_tokens_per_microbatch=48,
        stages=[{"until_step": 2, "batch_size": 4, "mini_batch_size": 4, "max_completion_length": 4},
                {"until_step": 4, "batch_size": 8, "mini_batch_size": 8}],  # 1 then 2 micro-steps per step
    )


def main(output_dir: str, options: dict) -> None:
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    vllm = options["features"] == "vllm"
    model, tokenizer = tiny_model_and_tokenizer(seed=0, tie_word_embeddings=vllm)  # the server's model is tied
    if options["features"] == "lora":
        from peft import LoraConfig, get_peft_model

        torch.manual_seed(0)  # LoRA's A matrices: the same on every rank and in the one-process run
        model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0))
    if not vllm:
        rank_independent_sampling(model, num_generations=4, pad_token_id=tokenizer.pad_token_id)
    args = OR1Config(**settings(output_dir, options, world_size))
    if options.get("force_fsdp2"):
        force_fsdp2(args)
    dataset = Dataset.from_dict({"prompt": [f"Q: {i}+{i}=? A:" for i in range(10, 42)]})  # one length: no padding
    trainer = OR1Trainer(model, reward, args=args, train_dataset=dataset, processing_class=tokenizer)
    if options.get("force_fsdp2"):
        force_fsdp2(args, trainer)

    class Snapshot(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            snapshot = gathered_state(trainer)  # a collective: every rank
            if trainer.accelerator.is_main_process:
                torch.save(snapshot, os.path.join(output_dir, f"state_step{state.global_step}.pt"))

    trainer.add_callback(Snapshot())
    if options["features"] == "all":
        plant_nan(trainer, fsdp2=bool(options.get("force_fsdp2")))
    trainer.train(resume_from_checkpoint=options.get("resume"))
    server_vs_trainer = None
    if vllm:  # the final weights pushed (gathered from the shards), then the server scores as they do
        trainer.vllm_generation.sync_weights()
        final = gathered_state(trainer)["params"]
        if trainer.accelerator.is_main_process:
            server_vs_trainer = pushed_weights_scored_alike(options, final, tokenizer)
    if trainer.accelerator.is_main_process:
        with open(os.path.join(output_dir, "result.json"), "w") as f:
            json.dump({
                "distributed_type": trainer.accelerator.distributed_type.value,
                "model_class": type(trainer.model_wrapped).__name__,
                "skipped_steps": trainer.or1_skipped_steps,
                "logprob_backend": trainer.logprob_backend,
                "local_fraction": local_fraction(trainer.model),
                "log_history": trainer.state.log_history,
                "server_vs_trainer": server_vs_trainer,
            }, f)


def plant_nan(trainer, fsdp2: bool) -> None:
    """Step `NAN_STEP`'s gradient of `NAN_PARAM` all NaN on the last rank (the only one in one process), as a NaN from
    a kernel would be, where the non-finite sentinel must catch it: a tensor hook registered before the sentinel's
    (hooks run in that order). FSDP2's module parameters are shards autograd never differentiates: there the last
    rank's reduced shard is filled instead, just before the sentinel looks at it."""
    param = dict(trainer.model.named_parameters())[NAN_PARAM]
    last_rank = trainer.accelerator.process_index == trainer.accelerator.num_processes - 1

    def planted(grad):
        return torch.full_like(grad, float("nan")) if trainer.state.global_step + 1 == NAN_STEP else grad

    class FillShards(TrainerCallback):
        def on_pre_optimizer_step(self, args, state, control, **kwargs):
            shard = dict(trainer.model.named_parameters())[NAN_PARAM].grad
            if state.global_step + 1 == NAN_STEP and last_rank:
                shard.to_local().fill_(float("nan"))

    if fsdp2:
        trainer.callback_handler.callbacks.insert(0, FillShards())  # before the sentinel's on_pre_optimizer_step
    elif last_rank:
        param.register_hook(planted)


def local_fraction(model) -> float:
    """The share of the parameters' elements this rank holds: 1 whole, about 1/2 sharded over 2 ranks."""
    local = full = 0
    for param in model.parameters():
        if hasattr(param, "ds_numel"):  # ZeRO-3: the rank's partition
            local, full = local + param.ds_tensor.numel(), full + param.ds_numel
        elif hasattr(param, "to_local"):  # FSDP2: a DTensor shard
            local, full = local + param.to_local().numel(), full + param.numel()
        else:
            local, full = local + param.numel(), full + param.numel()
    return local / full


def pushed_weights_scored_alike(options: dict, params: dict, tokenizer) -> float:
    """Largest difference between the server's log-probs of a text and those of a plain model holding `params`."""
    from types import SimpleNamespace

    from or1_trl.generation.serve import API_KEY_ENV
    from tests.helpers import model_logprobs, server_logprobs

    model, _ = tiny_model_and_tokenizer(seed=0, tie_word_embeddings=True)
    missing, unexpected = model.load_state_dict(params, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)  # tied to the embedding
    server = SimpleNamespace(url=options["vllm_url"], model_path=options["vllm_model"],
                             headers={"Authorization": f"Bearer {os.environ[API_KEY_ENV]}"})
    tokens = tokenizer("12 + 30 = 42 and 7 + 5 = 12")["input_ids"]
    return (server_logprobs(server, tokens) - model_logprobs(model, tokens)).abs().max().item()


if __name__ == "__main__":
    main(sys.argv[1], json.loads(sys.argv[2]))
    if torch.distributed.is_initialized():
        torch.distributed.barrier()  # every rank's part done, result.json written
    # The outputs are complete and on disk: end without the interpreter's teardown. Twice in CI a ZeRO-3 rank aborted
    # there ("terminate called without an active exception", SIGABRT) after its run had finished, the second time
    # after destroying its process group first, and the launcher then failed the run.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
