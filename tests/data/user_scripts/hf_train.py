"""An HF Trainer script: a tiny GPT-2 built from a config (no download), every optimizer setting its own."""

import sys

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments


class Tokens(torch.utils.data.Dataset):
    def __len__(self):
        return 64

    def __getitem__(self, i):
        ids = torch.arange(i, i + 16) % 64
        return {"input_ids": ids, "labels": ids}


model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64, n_positions=32))
args = TrainingArguments(
    output_dir=sys.argv[1],
    per_device_train_batch_size=4,
    gradient_accumulation_steps=2,
    learning_rate=5e-4,
    warmup_steps=3,
    max_steps=8,
    weight_decay=0.01,
    adam_beta1=0.85,
    adam_beta2=0.97,
    adam_epsilon=1e-7,
    max_grad_norm=0.7,
    lr_scheduler_type="linear",
    logging_steps=1,
    report_to=[],
    save_strategy="no",
    use_cpu=True,
    dataloader_num_workers=0,
    seed=3,
    disable_tqdm=True,
)
Trainer(model=model, args=args, train_dataset=Tokens()).train()
