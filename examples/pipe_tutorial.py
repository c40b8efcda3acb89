"""The PyTorch `Pipe` tutorial's model-parallel training loop, migrated to pipetrain (see docs/migrating-from-pipe.md).

The model and the loop keep the tutorial's structure (Encoder, TransformerEncoderLayer blocks grouped into one
`nn.Sequential` per device, Decoder; `Pipe(..., chunks=...)`; `model(data).local_value()`; a loss on
`output.view(-1, ntokens)`; clip, SGD). Sized for a CPU, on a synthetic token stream instead of WikiText-2,
dropout 0 so that runs can be compared exactly, learning rate 2.0 instead of 5.0 (at this size 5.0 makes
the loss jump up and down, which amplifies float rounding between runs). The lines that differ from the tutorial say `# pipetrain`.

    torchrun --nproc-per-node 2 examples/pipe_tutorial.py     # 2 stages, one process each
    python examples/pipe_tutorial.py                          # the same loop in one process
"""

import math

import torch
from torch import nn

from pipetrain import Pipe  # pipetrain: was `from torch.distributed.pipeline.sync import Pipe`


class Encoder(nn.Module):
    def __init__(self, ntoken: int, ninp: int, dropout: float) -> None:
        super().__init__()
        self.embed = nn.Embedding(ntoken, ninp)
        self.dropout = nn.Dropout(dropout)
        position = torch.arange(512).unsqueeze(1)
        scale = torch.exp(torch.arange(0, ninp, 2) * (-math.log(10000.0) / ninp))
        table = torch.zeros(512, 1, ninp)
        table[:, 0, 0::2], table[:, 0, 1::2] = torch.sin(position * scale), torch.cos(position * scale)
        self.register_buffer("positions", table)
        self.ninp = ninp

    def forward(self, src: torch.Tensor) -> torch.Tensor:
        src = self.embed(src.t()) * math.sqrt(self.ninp)  # (batch, seq) -> (seq, batch, emsize)
        return self.dropout(src + self.positions[: src.size(0)])


class Decoder(nn.Module):
    def __init__(self, ntoken: int, ninp: int) -> None:
        super().__init__()
        self.decoder = nn.Linear(ninp, ntoken)

    def forward(self, inp: torch.Tensor) -> torch.Tensor:
        return self.decoder(inp).permute(1, 0, 2)  # batch first again: (batch, seq, ntokens)


def synthetic_stream(length: int, ntokens: int) -> torch.Tensor:
    """A token stream with a learnable rule (each token follows from the previous one), batchified (seq, batch)."""
    gen = torch.Generator().manual_seed(0)
    start = torch.randint(0, ntokens, (1,), generator=gen)
    stream = (start + 7 * torch.arange(length)) % ntokens
    return stream.view(batch_size, -1).t().contiguous()


torch.manual_seed(0)
ntokens, emsize, nhid, nlayers, nhead, dropout = 50, 32, 64, 4, 4, 0.0
batch_size, bptt, steps = 8, 12, 6
train_data = synthetic_stream(batch_size * (bptt * steps + 1), ntokens)


def get_batch(source: torch.Tensor, i: int) -> tuple[torch.Tensor, torch.Tensor]:
    seq_len = min(bptt, len(source) - 1 - i)
    data = source[i:i + seq_len]
    target = source[i + 1:i + 1 + seq_len].t().flatten()  # batch first, like the output (`.view(-1, ntokens)`)
    return data.t(), target


num_gpus = 2
partition_len = ((nlayers - 1) // num_gpus) + 1
tmp_list = [Encoder(ntokens, emsize, dropout)]
module_list = []
for i in range(nlayers):
    transformer_block = nn.TransformerEncoderLayer(emsize, nhead, nhid, dropout)
    if i != 0 and i % partition_len == 0:
        module_list.append(nn.Sequential(*tmp_list))
        tmp_list = []
    tmp_list.append(transformer_block)
tmp_list.append(Decoder(ntokens, emsize))
module_list.append(nn.Sequential(*tmp_list))

chunks = 4
model = Pipe(torch.nn.Sequential(*module_list), chunks=chunks)

criterion = nn.CrossEntropyLoss()
lr = 2.0
optimizer = torch.optim.SGD(model.parameters(), lr=lr)

model.train()
for batch, i in enumerate(range(0, bptt * steps, bptt)):
    data, targets = get_batch(train_data, i)
    optimizer.zero_grad()
    output = model(data).local_value()
    loss = criterion(output.view(-1, ntokens), targets)
    loss.backward()
    model.clip_grad_norm_(0.5)  # pipetrain: was `torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)`
    optimizer.step()
    print(f"| batch {batch:3d} | loss {loss.item():.6f}", flush=True)

model.eval()  # the tutorial's evaluate(): a forward-only pass under no_grad
with torch.no_grad():
    data, targets = get_batch(train_data, bptt * steps - 5)  # the stream's short last slice: 5 tokens
    output = model(data).local_value()
    print(f"| eval      | loss {criterion(output.view(-1, ntokens), targets).item():.6f}", flush=True)
