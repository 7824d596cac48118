# A small 3D-convolutional video classifier (R(2+1)D-style: factorised spatial and temporal
# convolutions, residual stages) trained on clips of random length (8-32 frames), resolution
# (96-160 px) and batch (2-8), so every step's activations differ in all three; bf16 autocast,
# SGD with momentum.
import os, sys
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch
import common_torch as ct
MODE = ct.start_recording()


def run():
    import random
    import torch.nn as nn
    import torch.nn.functional as F
    torch.manual_seed(3)
    random.seed(3)

    class Conv2p1(nn.Sequential):
        def __init__(self, cin, cout, stride=1):
            mid = (cin + cout) // 2
            super().__init__(
                nn.Conv3d(cin, mid, (1, 3, 3), (1, stride, stride), (0, 1, 1), bias=False), nn.BatchNorm3d(mid), nn.ReLU(inplace=True),
                nn.Conv3d(mid, cout, (3, 1, 1), (stride, 1, 1), (1, 0, 0), bias=False))

    class Block(nn.Module):
        def __init__(self, cin, cout, stride):
            super().__init__()
            self.a, self.bn1 = Conv2p1(cin, cout, stride), nn.BatchNorm3d(cout)
            self.b, self.bn2 = Conv2p1(cout, cout), nn.BatchNorm3d(cout)
            self.skip = None if stride == 1 and cin == cout else nn.Sequential(nn.Conv3d(cin, cout, 1, stride, bias=False), nn.BatchNorm3d(cout))

        def forward(self, x):
            h = F.relu(self.bn1(self.a(x)))
            h = self.bn2(self.b(h))
            return F.relu(h + (x if self.skip is None else self.skip(x)))

    class Net(nn.Module):
        def __init__(self, classes=400):
            super().__init__()
            self.stem = nn.Sequential(nn.Conv3d(3, 32, (3, 7, 7), (1, 2, 2), (1, 3, 3), bias=False), nn.BatchNorm3d(32), nn.ReLU(inplace=True))
            chans, layers, cin = [32, 64, 128, 256], [], 32
            for i, c in enumerate(chans):
                layers += [Block(cin, c, 1 if i == 0 else 2), Block(c, c, 1)]
                cin = c
            self.layers = nn.Sequential(*layers)
            self.fc = nn.Linear(cin, classes)

        def forward(self, x):
            h = self.layers(self.stem(x))
            return self.fc(F.adaptive_avg_pool3d(h, 1).flatten(1))

    net = Net().cuda().to(memory_format=torch.channels_last_3d)
    opt = torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9)

    def step(i):
        b, t, s = random.choice([2, 4, 6, 8]), random.choice([8, 12, 16, 24, 32]), random.choice([96, 112, 128, 144, 160])
        x = torch.randn(b, 3, t, s, s, device="cuda").to(memory_format=torch.channels_last_3d)
        y = torch.randint(0, 400, (b,), device="cuda")
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = F.cross_entropy(net(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    iters, secs = ct.loop(step, target_events=100000, max_iters=3000, time_limit=90)
    return dict(iterations=iters, loop_s=round(secs, 2), model="R(2+1)D-style 3D CNN, 8 residual blocks, random init",
                precision="bf16 autocast", data="clips of 8-32 frames, 96-160 px, batch 2-8", optimizer="SGD momentum")


try:
    extra = run()
except Exception as e:  # keep the partial (still real) trace
    import traceback; traceback.print_exc()
    extra = dict(error=repr(e)[:500])
extra["record_mode"] = MODE
ct.finish("video3d_r2p1d_train_varclip_bf16", sys.argv[1], extra)
