"""A small CNN with BatchNorm on synthetic 64x64 images (feature maps dominate memory)."""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.data import Dataset
from trainloop import loader_factory, parse_args, sample_generator, train

from memtui import hooks

SIZE = 64
CLASSES = 10


class Shapes(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Noisy images whose class is a bright square's position."""

    def __len__(self) -> int:
        return 1_000_000

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        generator = sample_generator(index)
        label = index % CLASSES
        image = 0.3 * torch.randn(3, SIZE, SIZE, generator=generator)
        row, col = divmod(label, 5)
        image[:, 8 + 24 * row : 24 + 24 * row, 4 + 12 * col : 12 + 12 * col] += 1.0
        return image, torch.tensor(label)


def block(cin: int, cout: int) -> nn.Sequential:
    """Convolution, BatchNorm, ReLU."""
    return nn.Sequential(
        nn.Conv2d(cin, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout), nn.ReLU()
    )


class SmallCNN(nn.Module):
    """Four convolution blocks at 64, 64, 32 and 16 pixels, a pooled linear head."""

    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(
            block(3, 8),
            block(8, 16),
            nn.MaxPool2d(2),
            block(16, 32),
            nn.MaxPool2d(2),
            block(32, 64),
            nn.AdaptiveAvgPool2d(1),
            nn.Flatten(),
        )
        self.head = nn.Linear(64, CLASSES)

    def forward(self, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """The cross-entropy of the batch."""
        images, labels = batch
        return nn.functional.cross_entropy(self.head(self.features(images)), labels)


args = parse_args(__doc__.splitlines()[0], batch_size=8)
model = SmallCNN()
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
dataset = Shapes()
tuner = hooks.install(args, model=model, optimizer=optimizer, state_dir=args.out, name="truth-cnn")
loader = tuner.loader(loader_factory(dataset, slow_data_ms=args.slow_data_ms))
raise SystemExit(train(args, tuner, loader, model, optimizer, model))
