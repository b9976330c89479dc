"""A small transformer LM on variable-length sequences padded per batch (logits dominate memory)."""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.data import Dataset
from trainloop import loader_factory, parse_args, sample_generator, train

from memtui import hooks

SEQ_LEN = 192
VOCAB = 4096
WIDTH = 32


class VarLenTokens(Dataset[torch.Tensor]):
    """Random-walk token sequences of SEQ_LEN / 2 to SEQ_LEN tokens."""

    def __len__(self) -> int:
        return 1_000_000

    def __getitem__(self, index: int) -> torch.Tensor:
        generator = sample_generator(index)
        length = int(torch.randint(SEQ_LEN // 2, SEQ_LEN + 2, (1,), generator=generator))
        steps = torch.randint(-2, 3, (length,), generator=generator)
        return (steps.cumsum(0) + index) % (VOCAB - 1) + 1  # 0 is the padding


def pad(batch: list[torch.Tensor]) -> torch.Tensor:
    """The batch padded with zeros to its longest sequence."""
    return nn.utils.rnn.pad_sequence(batch, batch_first=True)


class TinyLM(nn.Module):
    """Embedding, one pre-norm encoder layer with a causal and a padding mask, a vocabulary head."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH, padding_idx=0)
        self.position = nn.Parameter(torch.zeros(SEQ_LEN + 1, WIDTH))
        self.block = nn.TransformerEncoderLayer(
            WIDTH, 2, 4 * WIDTH, dropout=0.0, batch_first=True, norm_first=True
        )
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, padded: torch.Tensor) -> torch.Tensor:
        """The mean next-token cross-entropy over the real (unpadded) tokens."""
        tokens, targets = padded[:, :-1], padded[:, 1:]
        length = tokens.shape[1]
        hidden = self.embed(tokens) + self.position[:length]
        causal = torch.ones(length, length, dtype=torch.bool).triu(1)  # True: masked
        hidden = self.block(hidden, src_mask=causal, src_key_padding_mask=tokens == 0)
        logits = self.head(hidden)
        return nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=0)


args = parse_args(__doc__.splitlines()[0], batch_size=8)
model = TinyLM()
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
dataset = VarLenTokens()
tuner = hooks.install(args, model=model, optimizer=optimizer, state_dir=args.out, name="truth-lm")
loader = tuner.loader(loader_factory(dataset, pad, args.slow_data_ms))
raise SystemExit(train(args, tuner, loader, model, optimizer, model))
