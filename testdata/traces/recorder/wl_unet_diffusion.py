# A small diffusion UNet trained at changing resolutions and batch sizes (multi-scale training):
# every step has a different activation shape, convolutions with skip connections, and the
# noise-schedule bookkeeping of a DDPM step.
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
    torch.manual_seed(0)
    random.seed(0)

    class Block(nn.Module):
        def __init__(self, cin, cout, tdim):
            super().__init__()
            self.n1, self.c1 = nn.GroupNorm(8, cin), nn.Conv2d(cin, cout, 3, padding=1)
            self.t = nn.Linear(tdim, cout)
            self.n2, self.c2 = nn.GroupNorm(8, cout), nn.Conv2d(cout, cout, 3, padding=1)
            self.skip = nn.Conv2d(cin, cout, 1) if cin != cout else nn.Identity()

        def forward(self, x, t):
            h = self.c1(F.silu(self.n1(x))) + self.t(t)[:, :, None, None]
            h = self.c2(F.silu(self.n2(h)))
            return h + self.skip(x)

    class UNet(nn.Module):
        def __init__(self, ch=(128, 256, 384, 512), tdim=512):
            super().__init__()
            self.tdim = tdim
            self.temb = nn.Sequential(nn.Linear(tdim, tdim), nn.SiLU(), nn.Linear(tdim, tdim))
            self.inp = nn.Conv2d(3, ch[0], 3, padding=1)
            self.down, self.up = nn.ModuleList(), nn.ModuleList()
            c = ch[0]
            for co in ch:
                self.down.append(Block(c, co, tdim)); c = co
            self.mid = Block(c, c, tdim)
            for co in reversed(ch):
                self.up.append(Block(c + co, co, tdim)); c = co
            self.out = nn.Conv2d(c, 3, 3, padding=1)

        def forward(self, x, t):
            half = self.tdim // 2
            f = torch.exp(-math.log(10000) * torch.arange(half, device=x.device) / half)
            e = t[:, None].float() * f[None]
            temb = self.temb(torch.cat([e.sin(), e.cos()], 1))
            h = self.inp(x)
            skips = []
            for i, b in enumerate(self.down):
                h = b(h, temb); skips.append(h)
                if i < len(self.down) - 1:
                    h = F.avg_pool2d(h, 2)
            h = self.mid(h, temb)
            for i, b in enumerate(self.up):
                s = skips.pop()
                if h.shape[-1] != s.shape[-1]:
                    h = F.interpolate(h, size=s.shape[-2:], mode="nearest")
                h = b(torch.cat([h, s], 1), temb)
            return self.out(h)

    model = UNet().cuda().train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    betas = torch.linspace(1e-4, 0.02, 1000, device="cuda")
    abar = torch.cumprod(1 - betas, 0)
    shapes = [(64, 64), (32, 96), (16, 128), (48, 80), (24, 112)]  # (batch, resolution)

    def step(i):
        B, R = shapes[random.randrange(len(shapes))]
        x0 = torch.randn(B, 3, R, R, device="cuda")
        t = torch.randint(0, 1000, (B,), device="cuda")
        noise = torch.randn_like(x0)
        a = abar[t][:, None, None, None]
        xt = a.sqrt() * x0 + (1 - a).sqrt() * noise
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = F.mse_loss(model(xt, t).float(), noise)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    iters, secs = ct.loop(step, target_events=100000, max_iters=400, time_limit=60)
    return dict(iterations=iters, loop_s=round(secs, 2), shapes=shapes, model="DDPM UNet, 4 levels (128-512 channels), random init",
                precision="fp32 weights, bf16 autocast", optimizer="AdamW")


try:
    extra = run()
except Exception as e:  # keep the partial (still real) trace
    import traceback; traceback.print_exc()
    extra = dict(error=repr(e)[:500])
extra["record_mode"] = MODE
ct.finish("unet_diffusion_multiscale_bf16", sys.argv[1], extra)
