# Semantic-segmentation training (a SegFormer-style model: a four-stage mix transformer encoder
# with spatial-reduction attention and an all-MLP decoder, 150 classes, random init) at a crop
# size and batch drawn every step, bf16 autocast, AdamW. Batches come from pinned host memory:
# a side CUDA stream copies the next batch (non_blocking) and normalises/flips it while the
# default stream trains on the current one; the default stream waits on an event, the tensors
# made on the side stream are marked with record_stream, and every fourth step the side stream
# also takes the predictions back (record_stream again) to update a confusion matrix. So the
# trace has allocations on two streams.
import os, sys
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch
import common_torch as ct
MODE = ct.start_recording()


def run():
    import random
    import torch.nn as nn
    import torch.nn.functional as F
    torch.manual_seed(4)
    rng = random.Random(4)
    NC, E = 150, 256  # classes (ADE20K-sized), decoder width
    DIMS, HEADS, SR, DEPTHS = (64, 128, 320, 512), (1, 2, 5, 8), (8, 4, 2, 1), (2, 2, 2, 2)

    class Attn(nn.Module):
        def __init__(self, d, h, sr):
            super().__init__()
            self.h = h
            self.q, self.kv, self.o = nn.Linear(d, d), nn.Linear(d, 2 * d), nn.Linear(d, d)
            self.sr = nn.Conv2d(d, d, sr, stride=sr) if sr > 1 else None
            self.n = nn.LayerNorm(d) if sr > 1 else None

        def forward(self, x, H, W):
            B, N, C = x.shape
            q = self.q(x).view(B, N, self.h, C // self.h).transpose(1, 2)
            r = x
            if self.sr is not None:  # keys and values from a spatially reduced map
                r = self.n(self.sr(x.transpose(1, 2).reshape(B, C, H, W)).flatten(2).transpose(1, 2))
            k, v = self.kv(r).view(B, r.shape[1], 2, self.h, C // self.h).permute(2, 0, 3, 1, 4)
            a = F.scaled_dot_product_attention(q, k, v)
            return self.o(a.transpose(1, 2).reshape(B, N, C))

    class MixFFN(nn.Module):
        def __init__(self, d):
            super().__init__()
            self.fc1, self.fc2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)
            self.dw = nn.Conv2d(4 * d, 4 * d, 3, padding=1, groups=4 * d)

        def forward(self, x, H, W):
            B, N, _ = x.shape
            h = self.fc1(x)
            h = self.dw(h.transpose(1, 2).reshape(B, -1, H, W)).flatten(2).transpose(1, 2)
            return self.fc2(F.gelu(h))

    class Block(nn.Module):
        def __init__(self, d, h, sr):
            super().__init__()
            self.n1, self.n2 = nn.LayerNorm(d), nn.LayerNorm(d)
            self.attn, self.ffn = Attn(d, h, sr), MixFFN(d)

        def forward(self, x, H, W):
            x = x + self.attn(self.n1(x), H, W)
            return x + self.ffn(self.n2(x), H, W)

    class Stage(nn.Module):
        def __init__(self, cin, d, h, sr, depth, k, s):
            super().__init__()
            self.embed = nn.Conv2d(cin, d, k, stride=s, padding=k // 2)  # overlapping patch embedding
            self.n0, self.n1 = nn.LayerNorm(d), nn.LayerNorm(d)
            self.blocks = nn.ModuleList(Block(d, h, sr) for _ in range(depth))

        def forward(self, x):
            x = self.embed(x)
            B, C, H, W = x.shape
            t = self.n0(x.flatten(2).transpose(1, 2))
            for b in self.blocks:
                t = b(t, H, W)
            return self.n1(t).transpose(1, 2).reshape(B, C, H, W)

    class SegFormer(nn.Module):
        def __init__(self):
            super().__init__()
            cins = (3,) + DIMS[:-1]
            self.stages = nn.ModuleList(
                Stage(cins[i], DIMS[i], HEADS[i], SR[i], DEPTHS[i], 7 if i == 0 else 3, 4 if i == 0 else 2) for i in range(4))
            self.proj = nn.ModuleList(nn.Conv2d(d, E, 1) for d in DIMS)
            self.fuse = nn.Sequential(nn.Conv2d(4 * E, E, 1, bias=False), nn.BatchNorm2d(E), nn.ReLU(inplace=True))
            self.drop = nn.Dropout2d(0.1)
            self.cls = nn.Conv2d(E, NC, 1)

        def forward(self, x):
            feats = []
            for s in self.stages:
                x = s(x)
                feats.append(x)
            size = feats[0].shape[-2:]
            ups = [F.interpolate(p(f), size=size, mode="bilinear", align_corners=False) if j else p(f)
                   for j, (p, f) in enumerate(zip(self.proj, feats))]
            return self.cls(self.drop(self.fuse(torch.cat(ups[::-1], 1))))

    model = SegFormer().cuda().train()
    opt = torch.optim.AdamW(model.parameters(), lr=6e-5, weight_decay=0.01)
    # (batch, crop height, crop width): every side a multiple of 32
    shapes = [(16, 512, 512), (8, 640, 640), (32, 384, 384), (24, 448, 448), (12, 512, 768),
              (48, 256, 320), (6, 768, 768), (20, 384, 640), (40, 320, 320), (10, 576, 704)]
    maxpix = max(b * h * w for b, h, w in shapes)
    g = torch.Generator().manual_seed(4)
    # two pinned staging buffers of random pixels and labels (255 = ignore), sliced to each batch's size
    host_img = [torch.randint(0, 256, (3 * maxpix,), dtype=torch.uint8, generator=g).pin_memory() for _ in range(2)]
    host_lbl = []
    for _ in range(2):
        lbl = torch.randint(0, NC, (maxpix,), dtype=torch.uint8, generator=g)
        lbl[::13] = 255
        host_lbl.append(lbl.pin_memory())
    mean = torch.tensor([0.485, 0.456, 0.406], device="cuda").view(1, 3, 1, 1)
    std = torch.tensor([0.229, 0.224, 0.225], device="cuda").view(1, 3, 1, 1)
    side = torch.cuda.Stream()
    main = torch.cuda.current_stream()
    with torch.cuda.stream(side):
        conf = torch.zeros(NC * NC + 1, dtype=torch.long, device="cuda")  # last bin takes ignored pixels
    used = []
    stats = dict(metric_updates=0)

    def load(k):
        B, H, W = shapes[rng.randrange(len(shapes))]
        n = B * H * W
        with torch.cuda.stream(side):
            xu = host_img[k % 2][:3 * n].view(B, 3, H, W).to("cuda", non_blocking=True)
            yu = host_lbl[k % 2][:n].view(B, H, W).to("cuda", non_blocking=True)
            x = xu.float().div_(255).sub_(mean).div_(std)
            y = yu.long()
            del xu, yu
            if rng.random() < 0.5:  # random horizontal flip, on the loader stream
                x, y = x.flip(3), y.flip(2)
            ready = torch.cuda.Event()
            ready.record(side)
        return x, y, ready, (B, H, W)

    torch.cuda.synchronize()  # parameters, mean and std are ready before the side stream reads any of them
    state = dict(next=load(0))

    def step(i):
        x, y, ready, shp = state["next"]
        state["next"] = None
        used.append(shp)
        main.wait_event(ready)
        x.record_stream(main)  # made on the side stream, used (and freed) on the main one
        y.record_stream(main)
        state["next"] = load(i + 1)  # prefetch: the side stream copies the next batch during this step
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(x)
            logits = F.interpolate(logits, size=x.shape[-2:], mode="bilinear", align_corners=False)
            loss = F.cross_entropy(logits, y, ignore_index=255)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if i % 4 == 3:  # metrics on the side stream, off the training stream's critical path
            with torch.no_grad():
                pred = logits.detach().argmax(1)
            done = torch.cuda.Event()
            done.record(main)
            side.wait_event(done)
            with torch.cuda.stream(side), torch.no_grad():
                pred.record_stream(side)
                idx = (y * NC + pred).masked_fill_(y == 255, NC * NC).flatten()
                conf.scatter_add_(0, idx, torch.ones_like(idx))
                del idx
            stats["metric_updates"] += 1
            del pred
        del x, y, logits, loss

    iters, secs = ct.loop(step, target_events=100000, max_iters=1000, time_limit=50)
    state["next"] = None
    torch.cuda.synchronize()
    pix = int(conf[:-1].sum().item())
    return dict(iterations=iters, loop_s=round(secs, 2), shapes_drawn=used[:20],
                shapes=shapes, classes=NC,
                model="SegFormer-style: 4-stage mix transformer (dims 64/128/320/512, heads 1/2/5/8, spatial reduction 8/4/2/1, depths 2/2/2/2, Mix-FFN with 3x3 depthwise conv), all-MLP decoder (256), random init",
                precision="fp32 weights, bf16 autocast", optimizer="AdamW",
                streams="default stream: forward/backward/optimizer; one side stream: pinned non_blocking H2D copies, normalise, flip, prefetching the next batch (event + record_stream onto the default stream), and every 4th step a confusion-matrix update from the predictions (record_stream onto the side stream)",
                pixels_scored=pix, **stats)


try:
    extra = run()
except Exception as e:  # keep the partial (still real) trace
    import traceback; traceback.print_exc()
    extra = dict(error=repr(e)[:500])
extra["record_mode"] = MODE
ct.finish("segformer_mit_train_varcrop_2streams_bf16", sys.argv[1], extra)
