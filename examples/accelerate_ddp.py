"""zen with Hugging Face Accelerate: ``accelerator.prepare`` hands back the DDP model; zen's hook goes on it.

Two models: an embedding model, whose gradient has a few non-zero rows per step (zen sends only those), and a
dense MLP with top-k (each large parameter sends its largest quarter, the rest kept for the next step).

    accelerate launch --multi_gpu --num_processes 2 examples/accelerate_ddp.py           # train both, print
    accelerate launch --multi_gpu --num_processes 2 examples/accelerate_ddp.py --check   # zen's summary(); and
                                                                 # check the embedding model against plain DDP's
The hook times dense against sparse per bucket: on one machine's loopback dense may win (bytes near 1x);
``--check`` decides by density instead, so that sparse travel is checked.
``--multi_gpu`` starts the processes (with torchrun); without a GPU the script asks for CPU processes over gloo
(``Accelerator(cpu=True)``; ``accelerate launch --cpu`` starts one process only, unless through mpirun). On
GPUs nothing changes. ``DistributedDataParallelKwargs(comm_hook=...)`` takes only Accelerate's own hooks:
register zen's on the prepared model, as here.
"""
import argparse

import torch
from accelerate import Accelerator
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset

import zen

VOCAB, DIM = 50_000, 32


def embedding_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.EmbeddingBag(VOCAB, DIM, mode="sum"), nn.Linear(DIM, 1))


def embedding_data(steps: int, world: int) -> DataLoader:
    """Bags of 8 tokens, 64 per rank and step: about 1% of the embedding's rows get a gradient on each rank.
    ``prepare`` gives each rank its share; no shuffling, so every run sees the same."""
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, VOCAB, (world * 64 * steps, 8), generator=g)
    return DataLoader(TensorDataset(tokens, torch.randn(len(tokens), 1, generator=g)), batch_size=64)


def dense_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 1))


def dense_data(steps: int, world: int) -> DataLoader:
    x = torch.randn(world * 32 * steps, 256, generator=torch.Generator().manual_seed(2))
    return DataLoader(TensorDataset(x, x[:, :1].sin()), batch_size=32)


def train(accelerator: Accelerator, model: nn.Module, optimizer, data: DataLoader, state=None):
    """One pass over ``data``; with zen's hook where ``state`` is given. Returns (model, last loss)."""
    model, opt, data = accelerator.prepare(model, optimizer(model.parameters()), data)
    if state is not None:
        assert isinstance(model, DDP), "zen's hook needs a DDP model: launch with 2 or more processes"
        model.register_comm_hook(state, zen.zen_hook)  # before the first backward
    for x, y in data:
        loss = nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        accelerator.backward(loss)
        opt.step()
    return accelerator.unwrap_model(model), loss.item()


def report(accelerator: Accelerator, name: str, loss: float, state) -> None:
    s = state.summary()
    accelerator.print(f"{name}: loss {loss:.4f}, zen sent {s['bytes_vs_dense']:.3f}x the bytes of a dense all-reduce "
                      f"({s['bytes_sent']:,.0f} of {s['dense_bytes']:,.0f}), schemes {s['schemes']}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=30, help="embedding model steps (the MLP runs 3x as many)")
    parser.add_argument("--check", action="store_true", help="also train the embedding model without the hook "
                        "and check that the parameters are equal and that zen sent under 0.5x dense's bytes")
    args = parser.parse_args()
    accelerator = Accelerator(cpu=not torch.cuda.is_available())
    world = accelerator.num_processes
    sgd = lambda params: torch.optim.SGD(params, lr=0.05)  # noqa: E731

    # Embedding model. The hook decides dense or sparse per bucket by timing both ways; a check must see
    # sparse travel whatever this machine's timings say, so it decides by density instead (dense above 50%).
    state = zen.ZenState(dense_threshold=0.5) if args.check else zen.ZenState()
    model, loss = train(accelerator, embedding_model(), sgd, embedding_data(args.steps, world), state)
    report(accelerator, "embedding", loss, state)

    # Dense model: top-k, the README's setting for AdamW (the ratio falls from 1 to 0.25 over 50 steps).
    topk = zen.ZenState(topk_ratio=0.25, density_ramp=50)
    adamw = lambda params: torch.optim.AdamW(params, lr=1e-3)  # noqa: E731
    _, dense_loss = train(accelerator, dense_model(), adamw, dense_data(3 * args.steps, world), topk)
    report(accelerator, "dense top-k", dense_loss, topk)

    if args.check:
        plain, _ = train(accelerator, embedding_model(), sgd, embedding_data(args.steps, world))
        diff = max((a - b).abs().max().item() for a, b in zip(model.parameters(), plain.parameters()))
        ratio = state.summary()["bytes_vs_dense"]
        # At 2 ranks a sum has one order of addition, so zen's equals dense's bit for bit; at more ranks
        # zen adds in another order than the ring: equal to rounding.
        exact = world == 2
        assert (diff == 0.0) if exact else diff < 1e-5, f"parameters differ from plain DDP's by {diff}"
        assert ratio < 0.5, f"zen sent {ratio:.3f}x dense's bytes, not under 0.5x"
        accelerator.print(f"check: embedding parameters {'equal' if diff == 0 else f'within {diff:.1e} of'} "
                          f"plain DDP's; bytes {ratio:.3f}x dense (< 0.5x): OK")
    accelerator.end_training()


if __name__ == "__main__":
    main()
