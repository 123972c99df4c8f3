"""zen with PyTorch Lightning: zen's communication hook on the DDP model that Lightning wraps.

Two models: an embedding model, whose gradient has a few non-zero rows per step (zen sends only those), and a
dense MLP with top-k (each large parameter sends its largest quarter, the rest kept for the next step).
Lightning launches the second process itself (its own launcher), on CPU over gloo:

    python examples/lightning_ddp.py           # train both, print zen's summary()
    python examples/lightning_ddp.py --check   # and check the embedding model against plain DDP's training
    python examples/lightning_ddp.py --strategy ddp_spawn --check   # Trainer(strategy="ddp_spawn") alike

The hook times dense against sparse per bucket: on one machine's loopback dense may win (bytes near 1x);
``--check`` decides by density instead, so that sparse travel is checked.
On GPUs: accelerator="gpu", nothing else changes. There ``DDPStrategy(ddp_comm_state=zen.ZenState(),
ddp_comm_hook=zen.zen_hook)`` does what the callback ``ZenHook`` does, but Lightning (2.6) registers a strategy's
hook on CUDA devices only and ignores it elsewhere, silently; ``ZenHook`` registers it on every device.

With ``ddp_spawn`` Lightning spawns the training processes from this one and sends them copies of what the
Trainer holds: ``ZenHook``'s ZenState included, so its summary() is read there (``on_fit_end``, which hands the
byte ratio back in ``trainer.callback_metrics``), not from the state in this process; and all of it must pickle
(the optimizers are ``functools.partial``, not lambdas). The parameters come back as with any strategy.
"""
import argparse
import functools

import lightning as L
import torch
from lightning.pytorch.strategies import DDPStrategy
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import zen

VOCAB, DIM = 50_000, 32


class ZenHook(L.Callback):
    """Registers zen's hook on the DDP model once Lightning has wrapped it (before the first backward); at the
    end prints zen's summary() from rank 0, and hands its byte ratio back as ``zen_bytes_vs_dense``."""

    def __init__(self, state: zen.ZenState, name: str):
        self.state, self.name = state, name

    def on_fit_start(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        trainer.strategy.model.register_comm_hook(self.state, zen.zen_hook)

    def on_fit_end(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        s = self.state.summary()
        trainer.callback_metrics["zen_bytes_vs_dense"] = torch.tensor(s["bytes_vs_dense"])
        if trainer.is_global_zero:
            print(f"{self.name}: loss {module.last_loss:.4f}, zen sent {s['bytes_vs_dense']:.3f}x the bytes of a "
                  f"dense all-reduce ({s['bytes_sent']:,.0f} of {s['dense_bytes']:,.0f}), schemes {s['schemes']}",
                  flush=True)


class Regressor(L.LightningModule):
    def __init__(self, net: nn.Module, optimizer):
        super().__init__()
        self.net, self.optimizer, self.last_loss = net, optimizer, None

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        self.last_loss = loss.item()
        return loss

    def configure_optimizers(self):
        return self.optimizer(self.parameters())


def embedding_model() -> Regressor:
    torch.manual_seed(0)
    net = nn.Sequential(nn.EmbeddingBag(VOCAB, DIM, mode="sum"), nn.Linear(DIM, 1))
    return Regressor(net, functools.partial(torch.optim.SGD, lr=0.05))


def embedding_data(steps: int) -> DataLoader:
    """Bags of 8 tokens, 64 per rank and step: about 1% of the embedding's rows get a gradient on each rank.
    Lightning gives each rank its share (a DistributedSampler); no shuffling, so every run sees the same."""
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, VOCAB, (2 * 64 * steps, 8), generator=g)
    return DataLoader(TensorDataset(tokens, torch.randn(len(tokens), 1, generator=g)), batch_size=64)


def dense_model() -> Regressor:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 1))
    return Regressor(net, functools.partial(torch.optim.AdamW, lr=1e-3))


def dense_data(steps: int) -> DataLoader:
    x = torch.randn(2 * 32 * steps, 256, generator=torch.Generator().manual_seed(2))
    return DataLoader(TensorDataset(x, x[:, :1].sin()), batch_size=32)


def fit(module: Regressor, data: DataLoader, steps: int, spawn: bool, state=None, name="") -> L.Trainer:
    """``steps`` steps at 2 CPU processes (spawned from this one where ``spawn``); with zen's hook where
    ``state`` is given."""
    strategy = DDPStrategy(start_method="spawn") if spawn else DDPStrategy()  # "ddp_spawn" or "ddp"
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=steps,
                        callbacks=[ZenHook(state, name)] if state is not None else [], logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(module, data)
    return trainer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=30, help="embedding model steps (the MLP runs 3x as many)")
    parser.add_argument("--check", action="store_true", help="also train the embedding model without the hook "
                        "and check that the parameters are equal and that zen sent under 0.5x dense's bytes")
    parser.add_argument("--strategy", choices=["ddp", "ddp_spawn"], default="ddp")
    args = parser.parse_args()
    spawn = args.strategy == "ddp_spawn"

    # Embedding model. The hook decides dense or sparse per bucket by timing both ways; a check must see
    # sparse travel whatever this machine's timings say, so it decides by density instead (dense above 50%).
    state = zen.ZenState(dense_threshold=0.5) if args.check else zen.ZenState()
    module = embedding_model()
    trainer = fit(module, embedding_data(args.steps), args.steps, spawn, state, "embedding")

    # Dense model: top-k, the README's setting for AdamW (the ratio falls from 1 to 0.25 over 50 steps).
    topk, dense = zen.ZenState(topk_ratio=0.25, density_ramp=50), dense_model()
    fit(dense, dense_data(3 * args.steps), 3 * args.steps, spawn, topk, "dense top-k")

    if args.check:
        plain = embedding_model()
        fit(plain, embedding_data(args.steps), args.steps, spawn)
        diff = max((a - b).abs().max().item() for a, b in zip(module.parameters(), plain.parameters()))
        ratio = trainer.callback_metrics["zen_bytes_vs_dense"].item()  # from the training processes
        # At 2 ranks a sum has one order of addition, so zen's equals dense's bit for bit.
        assert diff == 0.0, f"parameters differ from plain DDP's by {diff}"
        start = embedding_model()  # (with ddp_spawn: the trained parameters came back to this process)
        assert any((a != b).any() for a, b in zip(module.parameters(), start.parameters())), "no parameter moved"
        assert ratio < 0.5, f"zen sent {ratio:.3f}x dense's bytes, not under 0.5x"
        if trainer.is_global_zero:
            print(f"check: embedding parameters equal plain DDP's; bytes {ratio:.3f}x dense (< 0.5x): OK", flush=True)


if __name__ == "__main__":
    main()
