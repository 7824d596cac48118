# Inference serving of an image decoder in the style of a latent-diffusion VAE decoder (random
# init): latents of 4 channels and random resolution (32..128 a side) are upsampled 8x to
# 256..1024-pixel images, batch 1..8, fp16, no autograd; requests of different sizes interleave.
# (Recorded where diffusers is not installed, so the decoder is built from torch.nn here.)
import os, sys
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch
import common_torch as ct
MODE = ct.start_recording()


def run():
    import random
    torch.manual_seed(0)
    random.seed(0)
    import torch.nn as nn
    import torch.nn.functional as F

    class Up(nn.Module):
        def __init__(self, ci, co):
            super().__init__()
            self.c1 = nn.Conv2d(ci, co, 3, padding=1); self.c2 = nn.Conv2d(co, co, 3, padding=1)
            self.n = nn.GroupNorm(32, co)

        def forward(self, x):
            x = F.interpolate(x, scale_factor=2.0, mode="nearest")
            return F.silu(self.n(self.c2(F.silu(self.c1(x)))))

    vae = nn.Sequential(nn.Conv2d(4, 512, 3, padding=1), Up(512, 512), Up(512, 256), Up(256, 128), nn.Conv2d(128, 3, 3, padding=1))
    dec = vae
    how = "conv decoder: conv 4->512, three (nearest 2x upsample, conv, conv, GroupNorm, SiLU) blocks 512->512->256->128, conv 128->3"
    vae = vae.cuda().half().eval()

    def step(i):
        s = random.choice([32, 48, 64, 80, 96, 112, 128])
        B = random.randint(1, 8)
        if s >= 112:
            B = min(B, 3)
        z = torch.randn(B, 4, s, s, device="cuda", dtype=torch.float16)
        with torch.no_grad():
            img = dec(z)
            _ = (img.clamp(-1, 1) * 127.5 + 127.5).to(torch.uint8)

    iters, secs = ct.loop(step, target_events=100000, max_iters=3000, time_limit=70)
    return dict(iterations=iters, loop_s=round(secs, 2), model=how,
                batch="1..8 latents of 32..128 a side (256..1024-pixel images), interleaved sizes",
                precision="fp16", mode="inference (no_grad)")


try:
    extra = run()
except Exception as e:  # keep the partial (still real) trace
    import traceback; traceback.print_exc()
    extra = dict(error=repr(e)[:500])
extra["record_mode"] = MODE
ct.finish("vae_decode_varres_fp16", sys.argv[1], extra)
