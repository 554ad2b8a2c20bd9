"""Hugging Face Trainer with checkpoints saved in the background: run it, kill it, run it again.

    pip install '.[transformers]'   # from a checkout of this repository (ckptmgr is not on PyPI yet)

    python examples/hf_trainer_resume.py /tmp/hf-run --steps 40
    python examples/hf_trainer_resume.py /tmp/hf-run --steps 80   # resumes from checkpoint-40

A small Llama built from a config (no download), a checkpoint every 10 steps, the newest 3
kept. ``CkptmgrTrainer`` is ``transformers.Trainer`` whose checkpoints are copied off the
training tensors into reused host memory and written by background threads; each
``checkpoint-<step>/`` appears only once complete, and holds the files the stock Trainer
writes (it resumes from them too). ``resume_from_checkpoint=True`` takes the newest complete
checkpoint whose checksums match.
"""

import argparse
import os

import torch
from transformers import LlamaConfig, LlamaForCausalLM, TrainingArguments

from ckptmgr import KeepLatest
from ckptmgr.integrations.transformers import AsyncSaveOptions, CkptmgrTrainer, get_last_checkpoint

ap = argparse.ArgumentParser()
ap.add_argument("output_dir")
ap.add_argument("--steps", type=int, default=40)
args = ap.parse_args()


class RandomTokens(torch.utils.data.Dataset):
    def __init__(self, n=512, length=32):
        self.x = torch.randint(0, 256, (n, length), generator=torch.Generator().manual_seed(0))

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return {"input_ids": self.x[i], "labels": self.x[i]}


config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
torch.manual_seed(0)
model = LlamaForCausalLM(config)
training_args = TrainingArguments(output_dir=args.output_dir, max_steps=args.steps, save_steps=10,
                                  per_device_train_batch_size=8, learning_rate=1e-3, logging_steps=10,
                                  report_to=[], use_cpu=not torch.cuda.is_available(), disable_tqdm=True)
trainer = CkptmgrTrainer(model=model, args=training_args, train_dataset=RandomTokens(),
                         checkpointing=AsyncSaveOptions(retention=KeepLatest(3)))
resume = get_last_checkpoint(args.output_dir) if os.path.isdir(args.output_dir) else None
print(f"resuming from {resume}" if resume else "starting fresh")
trainer.train(resume_from_checkpoint=resume)
print("global step", trainer.state.global_step)
print("checkpoints:", sorted(n for n in os.listdir(args.output_dir) if n.startswith("checkpoint-")))
