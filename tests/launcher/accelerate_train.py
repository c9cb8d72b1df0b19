"""An Accelerate training loop as its docs write one; `accelerate launch --config_file fsdp2.yaml` makes it FSDP."""

import torch
from _gpt2 import tiny_gpt2, token_batches
from _record import record
from accelerate import Accelerator

accelerator = Accelerator()
model = tiny_gpt2()
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
model, optimizer = accelerator.prepare(model, optimizer)
losses = []
for ids in token_batches(4, accelerator.process_index):
    loss = model(input_ids=ids, labels=ids).loss
    accelerator.backward(loss)
    accelerator.clip_grad_norm_(model.parameters(), 0.5)
    optimizer.step()
    optimizer.zero_grad()
    losses.append(loss.item())
record(losses, model)
