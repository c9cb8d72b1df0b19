"""A small LightningModule: a stack of residual MLP blocks on seeded regression data, its losses kept."""

import lightning as L
import torch
from torch import nn
from torch.nn import functional as F


class Block(nn.Module):
    def __init__(self, width=12):
        super().__init__()
        self.up, self.down = nn.Linear(width, 2 * width + 1), nn.Linear(2 * width + 1, width)

    def forward(self, x):
        return x + self.down(torch.relu(self.up(x)))


class Regression(L.LightningModule):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.Sequential(*[Block() for _ in range(3)])
        self.losses = []

    def training_step(self, batch, index):
        inputs, targets = batch
        loss = F.mse_loss(self.blocks(inputs), targets)
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)

    def train_dataloader(self):
        generator = torch.Generator().manual_seed(self.global_rank)
        data = torch.utils.data.TensorDataset(torch.randn(8, 12, generator=generator), torch.randn(8, 12, generator=generator))
        return torch.utils.data.DataLoader(data, batch_size=2)
