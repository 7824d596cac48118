"""PyTorch workloads whose tensor shapes change every step, on one allocator per process.

    python3 python/bench/torch_workloads.py --workload seg|gpt|generate \
        --allocator torch-default|torch-expandable|go [--steps N] [--seed S]

seg       a small U-Net (hand-written; no torchvision) trained on batches of images of random
          size, fp32, AdamW.
gpt       fine-tuning a small GPT-style transformer at random batch sizes and sequence lengths,
          AdamW, bf16 autocast.
generate  a generation service: random batches of random-length prompts, greedy decoding with a
          KV cache grown by one token per step, bf16.

torch-default is PyTorch's caching allocator, torch-expandable the same with
PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True, go the Go pool (gormm_rmm.use_torch; the
library from the installed package or GORMM_RMM_LIBRARY). The run is deterministic
(torch.use_deterministic_algorithms, CUBLAS_WORKSPACE_CONFIG, cuDNN without benchmarking), so the
hash of the losses or tokens must be equal across allocators. Prints one JSON line: the hash,
the median step time after warm-up (the device synchronised around each step), the peak reserved
(PyTorch's max_memory_reserved, or the Go pool's peak size; for go, what PyTorch's own pool
reserved, which must be 0), the peak allocated where known, and the peak of the device memory in
use (cudaMemGetInfo after each step, less what was in use before the first).
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

WORKLOADS = ("seg", "gpt", "generate")
ALLOCATORS = ("torch-default", "torch-expandable", "go")


def setup_env(a):
    """The environment PyTorch reads when it is imported or starts CUDA."""
    os.environ["CUBLAS_WORKSPACE_CONFIG"] = ":4096:8"
    # PyTorch >= 2.9 reads PYTORCH_ALLOC_CONF as well as the older PYTORCH_CUDA_ALLOC_CONF: an
    # inherited setting under either name would change the baseline (or, for go, be ignored).
    for k in ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF"):
        os.environ.pop(k, None)
        if a.allocator == "torch-expandable":
            os.environ[k] = "expandable_segments:True"


def main(argv=None):
    a = common.parser(__doc__.splitlines()[0], WORKLOADS, ALLOCATORS).parse_args(argv)
    setup_env(a)
    rmm = None
    if a.allocator == "go":
        rmm = common.import_gormm_rmm()
    import torch  # after setup_env: PyTorch reads the variables once
    if rmm is not None:
        rmm.use_torch(pool=a.pool, statistics=a.go_statistics)
    import random
    torch.manual_seed(a.seed)
    torch.use_deterministic_algorithms(True)
    if hasattr(torch.utils, "deterministic"):
        # Deterministic mode also fills each new tensor with NaN, a kernel per allocation that
        # would dilute what the allocators differ in; no result here reads unwritten memory.
        torch.utils.deterministic.fill_uninitialized_memory = False
    torch.backends.cudnn.benchmark = False
    torch.backends.cudnn.deterministic = True
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    dev = torch.device("cuda")
    rng = random.Random(a.seed)  # the shapes
    gen = torch.Generator(device=dev).manual_seed(a.seed + 1)  # the data

    def used():
        free, total = torch.cuda.mem_get_info()
        return total - free

    # What the Go pool took at reinitialize (a plain pool: half the free memory) is in use too.
    pool0 = rmm.pool_stats()["pool_size"] if rmm is not None else 0
    base = used() - pool0
    peak_used = [0]

    def sample():
        peak_used[0] = max(peak_used[0], used() - base)

    steps = common.Steps(torch.cuda.synchronize, sample)
    values, fmt = WORK[a.workload](torch, dev, rng, gen, a.steps, steps)
    rec = {"suite": "torch", "workload": a.workload, "allocator": a.allocator, "steps": a.steps,
           "seed": a.seed, "hash": common.hash_floats(values, fmt), "n_values": len(values),
           "median_step_ms": steps.median_ms(common.warmup_of(a)), "device_used_peak": peak_used[0],
           "torch": torch.__version__, "device": torch.cuda.get_device_name(),
           "alloc_conf": {k: os.environ.get(k) for k in ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF")}}
    if rmm is None:
        rec["peak_reserved"] = torch.cuda.max_memory_reserved()
        rec["peak_allocated"] = torch.cuda.max_memory_allocated()
    else:
        ps = rmm.pool_stats()
        rec["pool"] = a.pool
        rec["peak_reserved"] = ps["peak_pool_size"]
        rec["go_pool_stats"] = ps
        rec["peak_allocated"] = rmm.statistics()["peak_bytes"] if a.go_statistics else None
        try:
            rec["torch_native_reserved"] = torch.cuda.max_memory_reserved()
        except Exception as e:  # PyTorch keeps no figures for a pluggable allocator
            rec["torch_native_reserved"] = None  # unknown, not 0: getDeviceStats raises
            rec["torch_native_note"] = repr(e)[:200]
        rec["go_last_error"] = rmm.last_error()  # the main thread's last failure, if any
        try:
            rmm.check_pool()
            rec["go_pool_invariants"] = "hold"
        except rmm.RMMError as e:
            rec["go_pool_invariants"] = str(e)
    common.emit(rec)


def onehot(torch, target, n, dtype):
    # Elementwise, so deterministic (scatter-based one_hot and NLLLoss may not be on CUDA).
    shape = [1] * target.dim()
    return (target.unsqueeze(-1) == torch.arange(n, device=target.device).view(*shape, n)).to(dtype)


def seg(torch, dev, rng, gen, n, steps):
    nn, F = torch.nn, torch.nn.functional
    classes = 5

    def block(ci, co):
        return nn.Sequential(nn.Conv2d(ci, co, 3, 1, 1, bias=False), nn.BatchNorm2d(co), nn.ReLU(),
                             nn.Conv2d(co, co, 3, 1, 1, bias=False), nn.BatchNorm2d(co), nn.ReLU())

    class UNet(nn.Module):
        def __init__(self, w=32):
            super().__init__()
            self.e1, self.e2, self.e3, self.mid = block(3, w), block(w, 2 * w), block(2 * w, 4 * w), block(4 * w, 8 * w)
            # Transposed convolutions upsample: interpolation's backward is not deterministic on CUDA.
            self.u3, self.d3 = nn.ConvTranspose2d(8 * w, 4 * w, 2, 2), block(8 * w, 4 * w)
            self.u2, self.d2 = nn.ConvTranspose2d(4 * w, 2 * w, 2, 2), block(4 * w, 2 * w)
            self.u1, self.d1 = nn.ConvTranspose2d(2 * w, w, 2, 2), block(2 * w, w)
            self.head = nn.Conv2d(w, classes, 1)

        def forward(self, x):
            e1 = self.e1(x)
            e2 = self.e2(F.max_pool2d(e1, 2))
            e3 = self.e3(F.max_pool2d(e2, 2))
            m = self.mid(F.max_pool2d(e3, 2))
            d3 = self.d3(torch.cat([self.u3(m), e3], 1))
            d2 = self.d2(torch.cat([self.u2(d3), e2], 1))
            d1 = self.d1(torch.cat([self.u1(d2), e1], 1))
            return self.head(d1)

    model = UNet().to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = []
    for _ in range(n):
        b, h, w = rng.randint(2, 8), 16 * rng.randint(8, 32), 16 * rng.randint(8, 32)

        def step():
            x = torch.randn(b, 3, h, w, device=dev, generator=gen)
            y = torch.randint(0, classes, (b, h, w), device=dev, generator=gen)
            logp = F.log_softmax(model(x), 1).permute(0, 2, 3, 1)
            loss = -(logp * onehot(torch, y, classes, logp.dtype)).sum(-1).mean()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            return loss.item()
        losses.append(steps.run(step))
    return losses, "f"


def gpt_model(torch, dev, vocab=1024, d=384, layers=6, heads=6, ctx=1024):
    nn, F = torch.nn, torch.nn.functional

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
            self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
            self.fc, self.out = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

        def forward(self, x, cache=None):
            B, T, _ = x.shape
            q, k, v = self.qkv(self.ln1(x)).view(B, T, 3, heads, d // heads).permute(2, 0, 3, 1, 4)
            if cache is not None:
                if cache:  # the KV cache grows by the new positions: a new tensor each step
                    k, v = torch.cat([cache[0], k], 2), torch.cat([cache[1], v], 2)
                cache[:] = [k, v]
            S = k.shape[2]
            # Written out (no fused attention kernel) so that the backward pass is deterministic.
            att = (q @ k.transpose(-1, -2)) * (d // heads) ** -0.5
            mask = torch.ones(T, S, dtype=torch.bool, device=x.device).tril(S - T)
            att = att.masked_fill(~mask, float("-inf")).softmax(-1)
            y = (att @ v).transpose(1, 2).reshape(B, T, d)
            x = x + self.proj(y)
            return x + self.out(F.gelu(self.fc(self.ln2(x))))

    class GPT(nn.Module):
        def __init__(self):
            super().__init__()
            self.tok = nn.Parameter(torch.randn(vocab, d) * 0.02)
            self.pos = nn.Parameter(torch.randn(ctx, d) * 0.02)
            self.blocks = nn.ModuleList(Block() for _ in range(layers))
            self.ln = nn.LayerNorm(d)

        def forward(self, idx, caches=None, start=0):
            T = idx.shape[1]
            # A one-hot product instead of an embedding lookup, whose backward accumulates.
            x = onehot(torch, idx, vocab, self.tok.dtype) @ self.tok + self.pos[start:start + T]
            for i, blk in enumerate(self.blocks):
                x = blk(x, None if caches is None else caches[i])
            return self.ln(x) @ self.tok.t()

    return GPT().to(dev), vocab


def gpt(torch, dev, rng, gen, n, steps):
    F = torch.nn.functional
    model, vocab = gpt_model(torch, dev)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1)
    losses = []
    for _ in range(n):
        b, t = rng.randint(2, 16), rng.randint(32, 512)

        def step():
            idx = torch.randint(0, vocab, (b, t + 1), device=dev, generator=gen)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = model(idx[:, :-1])
            logp = F.log_softmax(logits.float(), -1)
            loss = -(logp * onehot(torch, idx[:, 1:], vocab, logp.dtype)).sum(-1).mean()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            return loss.item()
        losses.append(steps.run(step))
    return losses, "f"


def generate(torch, dev, rng, gen, n, steps):
    model, vocab = gpt_model(torch, dev)
    model = model.to(torch.bfloat16).eval()
    tokens = []
    for _ in range(n):
        b, prompt, new = rng.randint(1, 16), rng.randint(16, 384), rng.randint(32, 192)

        @torch.no_grad()
        def step():
            idx = torch.randint(0, vocab, (b, prompt), device=dev, generator=gen)
            caches = [[] for _ in model.blocks]
            logits = model(idx, caches)
            out = []
            for i in range(new):
                nxt = logits[:, -1].float().argmax(-1, keepdim=True)
                out.append(nxt)
                logits = model(nxt, caches, start=prompt + i)
            return torch.cat(out, 1).flatten().tolist()
        tokens.extend(steps.run(step))
    return tokens, "q"


WORK = {"seg": seg, "gpt": gpt, "generate": generate}

if __name__ == "__main__":
    main()
