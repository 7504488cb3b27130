"""The peer of `trellis bench learners`: PyTorch DistributedDataParallel over gloo on this host.

The same model shape (the reference config: Qwen2, vocab 8192, hidden 512, intermediate 1408,
8 heads, `--layers` layers, untied head) and the same update (a policy-gradient loss over the
response half of `--batch` rows × `--seq` tokens, AdamW, global-norm clip 1.0), first in one
process, then on `--ranks` processes with DDP (each on its share of the rows, the threads split
between them). Prints the median step of each, and the median of a bare `all_reduce` of a
gradient-sized f32 tensor (GB/s as NCCL counts the algorithm bandwidth: bytes / time).

    python tests/peers/torch_ddp.py --ranks 2 --batch 8 --seq 128 --layers 2 --steps 3
"""

import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F


class Block(nn.Module):
    def __init__(self, h, inter, heads):
        super().__init__()
        self.heads = heads
        self.n1, self.n2 = nn.RMSNorm(h, eps=1e-6), nn.RMSNorm(h, eps=1e-6)
        self.q, self.k, self.v = (nn.Linear(h, h) for _ in range(3))
        self.o = nn.Linear(h, h, bias=False)
        self.gate, self.up = nn.Linear(h, inter, bias=False), nn.Linear(h, inter, bias=False)
        self.down = nn.Linear(inter, h, bias=False)

    def forward(self, x, cos, sin):
        b, t, h = x.shape
        y = self.n1(x)
        q, k, v = (p(y).view(b, t, self.heads, -1).transpose(1, 2) for p in (self.q, self.k, self.v))

        def rope(z):
            z1, z2 = z.chunk(2, dim=-1)
            return z * cos + torch.cat((-z2, z1), dim=-1) * sin

        a = F.scaled_dot_product_attention(rope(q), rope(k), v, is_causal=True)
        x = x + self.o(a.transpose(1, 2).reshape(b, t, h))
        y = self.n2(x)
        return x + self.down(F.silu(self.gate(y)) * self.up(y))


class Model(nn.Module):
    def __init__(self, layers, vocab=8192, h=512, inter=1408, heads=8):
        super().__init__()
        self.embed = nn.Embedding(vocab, h)
        self.blocks = nn.ModuleList(Block(h, inter, heads) for _ in range(layers))
        self.norm = nn.RMSNorm(h, eps=1e-6)
        self.head = nn.Linear(h, vocab, bias=False)
        d = h // heads
        self.inv = 1.0 / (1e6 ** (torch.arange(0, d, 2).float() / d))

    def forward(self, ids):
        t = ids.shape[1]
        f = torch.outer(torch.arange(t).float(), self.inv)
        emb = torch.cat((f, f), dim=-1)
        cos, sin = emb.cos(), emb.sin()
        x = self.embed(ids)
        for blk in self.blocks:
            x = blk(x, cos, sin)
        return self.head(self.norm(x))


def data(batch, seq, vocab=8192):
    """Tokens spread over the vocabulary and advantages in [-1, 1], as the Rust bench makes them."""
    ids = torch.tensor([[(r * 7919 + t * 104_729) % vocab for t in range(seq)] for r in range(batch)])
    half = seq // 2
    adv = torch.tensor([((i * 7919) % 2001) / 1000.0 - 1.0 for i in range(batch * half)]).view(batch, half)
    return ids, adv


def step(model, opt, ids, adv, total_tokens):
    half = ids.shape[1] // 2
    logits = model(ids[:, :-1])[:, half - 1 :]
    logp = torch.log_softmax(logits.float(), dim=-1).gather(-1, ids[:, half:, None]).squeeze(-1)
    # Token-mean over the whole mini-batch (each rank divides by all ranks' tokens; DDP averages
    # over ranks, so scale back up by their number).
    loss = -(adv * torch.exp(logp - logp.detach())).sum() / total_tokens
    if dist.is_initialized():
        loss = loss * dist.get_world_size()
    opt.zero_grad(set_to_none=False)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()


def timed(fn, steps):
    fn()
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def rank_main(rank, a, out):
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29517")
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // a.ranks))
    dist.init_process_group("gloo", rank=rank, world_size=a.ranks)
    torch.manual_seed(1)
    model = nn.parallel.DistributedDataParallel(Model(a.layers))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    ids, adv = data(a.batch, a.seq)
    share = a.batch // a.ranks
    rows = slice(rank * share, (rank + 1) * share)
    total = adv.numel()
    step_s = timed(lambda: step(model, opt, ids[rows], adv[rows], total), a.steps)
    numel = sum(p.numel() for p in model.parameters())
    buf = torch.ones(numel)
    reduce_s = timed(lambda: dist.all_reduce(buf), a.steps)
    if rank == 0:
        out.put((numel, step_s, reduce_s))
    dist.destroy_process_group()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--steps", type=int, default=3)
    a = p.parse_args()
    torch.manual_seed(1)
    model = Model(a.layers)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    ids, adv = data(a.batch, a.seq)
    one = timed(lambda: step(model, opt, ids, adv, adv.numel()), a.steps)
    ctx = mp.get_context("spawn")
    out = ctx.SimpleQueue()
    mp.spawn(rank_main, args=(a, out), nprocs=a.ranks, join=True)
    numel, step_s, reduce_s = out.get()
    gb = numel * 4 / 1e9
    print(f"torch {torch.__version__}, {numel / 1e6:.1f}M params, {gb * 1e3:.0f} MB gradient, "
          f"batch {a.batch} x seq {a.seq}, {a.ranks} ranks")
    print(f"  one process                step {one:.3f} s (median of {a.steps})")
    print(f"  {a.ranks} ranks, DDP over gloo     step {step_s:.3f} s ({step_s / one:.2f}x one process); "
          f"bare all_reduce {reduce_s:.3f} s = {gb / reduce_s:.2f} GB/s, {100 * reduce_s / step_s:.0f}% of the step")


if __name__ == "__main__":
    main()
