# A small diffusion transformer (DiT-style: patch embedding, adaLN-conditioned attention blocks)
# trained at changing resolutions and batch sizes, so the token count of every step differs
# (64 to 1024 tokens), with bf16 autocast, AdamW and gradient accumulation over two steps.
import os, sys
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch
import common_torch as ct
MODE = ct.start_recording()


def run():
    import math
    import random
    import torch.nn as nn
    import torch.nn.functional as F
    torch.manual_seed(1)
    random.seed(1)
    D, H, L, P = 512, 8, 8, 2

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.n1 = nn.LayerNorm(D, elementwise_affine=False)
            self.qkv, self.proj = nn.Linear(D, 3 * D), nn.Linear(D, D)
            self.n2 = nn.LayerNorm(D, elementwise_affine=False)
            self.mlp = nn.Sequential(nn.Linear(D, 4 * D), nn.GELU(approximate="tanh"), nn.Linear(4 * D, D))
            self.ada = nn.Linear(D, 6 * D)

        def forward(self, x, c):
            s1, b1, g1, s2, b2, g2 = self.ada(F.silu(c))[:, None].chunk(6, -1)
            h = self.n1(x) * (1 + s1) + b1
            B, N, _ = h.shape
            q, k, v = self.qkv(h).view(B, N, 3, H, D // H).permute(2, 0, 3, 1, 4)
            a = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(B, N, D)
            x = x + g1 * self.proj(a)
            return x + g2 * self.mlp(self.n2(x) * (1 + s2) + b2)

    class DiT(nn.Module):
        def __init__(self):
            super().__init__()
            self.patch = nn.Conv2d(4, D, P, stride=P)
            self.temb = nn.Sequential(nn.Linear(256, D), nn.SiLU(), nn.Linear(D, D))
            self.yemb = nn.Embedding(1001, D)
            self.blocks = nn.ModuleList(Block() for _ in range(L))
            self.out = nn.Linear(D, P * P * 4)

        def forward(self, x, t, y):
            B, C, R, _ = x.shape
            h = self.patch(x).flatten(2).transpose(1, 2)
            pos = torch.arange(h.shape[1], device=x.device)[:, None] / 10000 ** (torch.arange(0, D, 2, device=x.device) / D)
            h = h + torch.cat([pos.sin(), pos.cos()], 1)[None]
            f = torch.exp(-math.log(10000) * torch.arange(128, device=x.device) / 128)
            e = t[:, None].float() * f[None]
            c = self.temb(torch.cat([e.sin(), e.cos()], 1)) + self.yemb(y)
            for b in self.blocks:
                h = b(h, c)
            h = self.out(h).view(B, R // P, R // P, P, P, C).permute(0, 5, 1, 3, 2, 4)
            return h.reshape(B, C, R, R)

    model = DiT().cuda().train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    abar = torch.cumprod(1 - torch.linspace(1e-4, 0.02, 1000, device="cuda"), 0)
    shapes = [(64, 16), (32, 32), (16, 48), (8, 64), (48, 24), (24, 40)]  # (batch, latent side)

    def step(i):
        B, R = shapes[random.randrange(len(shapes))]
        x0 = torch.randn(B, 4, R, R, device="cuda")
        t = torch.randint(0, 1000, (B,), device="cuda")
        y = torch.randint(0, 1001, (B,), device="cuda")
        noise = torch.randn_like(x0)
        a = abar[t][:, None, None, None]
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = F.mse_loss(model(a.sqrt() * x0 + (1 - a).sqrt() * noise, t, y).float(), noise) / 2
        loss.backward()
        if i % 2 == 1:
            opt.step()
            opt.zero_grad(set_to_none=True)

    iters, secs = ct.loop(step, target_events=100000, max_iters=600, time_limit=60)
    return dict(iterations=iters, loop_s=round(secs, 2), shapes=shapes, model="DiT, 8 blocks, d=512, patch 2, random init",
                precision="fp32 weights, bf16 autocast", optimizer="AdamW, gradients accumulated over 2 steps")


try:
    extra = run()
except Exception as e:  # keep the partial (still real) trace
    import traceback; traceback.print_exc()
    extra = dict(error=repr(e)[:500])
extra["record_mode"] = MODE
ct.finish("dit_varres_train_accum_bf16", sys.argv[1], extra)
