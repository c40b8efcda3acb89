"""Quick start: a small model over 2 pipeline stages with 4 micro-batches, on the CPU, no launcher needed."""

import torch
from torch import nn

import pipetrain


def train(spec: pipetrain.RankSpec) -> None:
    torch.manual_seed(0)  # every rank must start from the same weights
    model = pipetrain.ModuleListModel(
        [nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 2)],
        example_input=torch.zeros(1, 16),
    )
    layout = pipetrain.ParallelConfig(pipeline=pipetrain.PipelineConfig(pp=2, schedule="1f1b", n_microbatches=4))
    session = pipetrain.open_session(spec, model, layout)
    optimizer = torch.optim.AdamW(session.engine.parameters(), lr=1e-2)
    data = torch.Generator().manual_seed(1)
    for step in range(1, 101):
        x = torch.randn(32, 16, generator=data)
        y = (x[:, 0] > 0).long()  # every rank sees the same batch: stage 0 reads x, the last stage y
        optimizer.zero_grad()
        result = session.engine.step(x, y)  # loss and accuracy are known on every rank
        optimizer.step()
        if step % 25 == 0 and session.is_main:
            print(f"step {step}: loss {result.loss:.4f}, accuracy {result.accuracy:.2f}")
    pipetrain.close_session()


if __name__ == "__main__":
    pipetrain.launch_local(train, world_size=2)
