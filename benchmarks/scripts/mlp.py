"""A parameter-heavy MLP (9.4M parameters, AdamW): mostly static memory, little per sample."""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.data import Dataset
from trainloop import loader_factory, parse_args, sample_generator, train

from memtui import hooks

FEATURES = 512
HIDDEN = 2048
CLASSES = 10


class Features(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Gaussian features whose class is the argmax of a few of them."""

    def __len__(self) -> int:
        return 1_000_000

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.randn(FEATURES, generator=sample_generator(index))
        return x, x[:CLASSES].argmax()


class WideMLP(nn.Module):
    """Three hidden layers of 2048 with LayerNorm and GELU."""

    def __init__(self) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        width = FEATURES
        for _ in range(3):
            layers += [nn.Linear(width, HIDDEN), nn.LayerNorm(HIDDEN), nn.GELU()]
            width = HIDDEN
        self.body = nn.Sequential(*layers)
        self.head = nn.Linear(HIDDEN, CLASSES)

    def forward(self, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """The cross-entropy of the batch."""
        x, labels = batch
        return nn.functional.cross_entropy(self.head(self.body(x)), labels)


args = parse_args(__doc__.splitlines()[0], batch_size=32)
model = WideMLP()
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
dataset = Features()
tuner = hooks.install(args, model=model, optimizer=optimizer, state_dir=args.out, name="truth-mlp")
loader = tuner.loader(loader_factory(dataset, slow_data_ms=args.slow_data_ms))
raise SystemExit(train(args, tuner, loader, model, optimizer, model))
