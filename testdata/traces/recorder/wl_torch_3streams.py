# A three-stream PyTorch pipeline: a loader stream copies pinned batches of changing size to the
# GPU and resizes them; two model streams run a ResNet-18 and a Transformer encoder (fp16) on each
# batch at the same time; tensors that cross streams are handed over with events and
# record_stream, and results come back to the host without blocking.
import os, random, sys
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch
import common_torch as ct
MODE = ct.start_recording()


def run():
    import torch.nn.functional as F
    import torchvision
    torch.manual_seed(0)
    cnn = torchvision.models.resnet18(num_classes=1000).half().cuda().eval()
    layer = torch.nn.TransformerEncoderLayer(d_model=512, nhead=8, dim_feedforward=2048, batch_first=True)
    enc = torch.nn.TransformerEncoder(layer, num_layers=6, enable_nested_tensor=False).half().cuda().eval()
    patch = torch.nn.Conv2d(3, 512, kernel_size=16, stride=16).half().cuda().eval()
    load, sa, sb = torch.cuda.Stream(), torch.cuda.Stream(), torch.cuda.Stream()
    rng = random.Random(7)
    pending = []

    def step(i):
        B = rng.choice([8, 16, 24, 32, 48, 64])
        H = rng.choice([160, 192, 224, 256, 288, 320])
        host = torch.randint(0, 256, (B, 3, H, H), dtype=torch.uint8).pin_memory()
        with torch.cuda.stream(load), torch.inference_mode():
            x = host.cuda(non_blocking=True).half().div_(255)
            x = F.interpolate(x, size=(224, 224), mode="bilinear", align_corners=False)
            x = (x - 0.45) / 0.225
            ready = torch.cuda.Event()
            ready.record(load)
        outs = []
        for s, f in ((sa, lambda t: cnn(t).float().softmax(1)),
                     (sb, lambda t: enc(patch(t).flatten(2).transpose(1, 2)).mean(1).float())):
            s.wait_event(ready)
            with torch.cuda.stream(s), torch.inference_mode():
                x.record_stream(s)
                y = f(x)
                outs.append((y.to("cpu", non_blocking=True), torch.cuda.Event()))
                outs[-1][1].record(s)
        del x
        pending.append(outs)
        while len(pending) > 2:  # two batches in flight
            for _, e in pending.pop(0):
                e.synchronize()

    iters, secs = ct.loop(step, target_events=110000, max_iters=3000, time_limit=60)
    return dict(iterations=iters, loop_s=round(secs, 2),
                models="torchvision resnet18 fp16 on stream A; 6-layer Transformer encoder (d 512, 8 heads) on 16x16 patches fp16 on stream B",
                loader="pinned uint8 batches, batch in {8..64}, side 160..320, resized to 224 on the loader stream",
                torchvision=torchvision.__version__)


try:
    extra = run()
except Exception as e:
    import traceback; traceback.print_exc()
    extra = dict(error=repr(e)[:500])
extra["record_mode"] = MODE
ct.finish("torch_3streams_resnet18_encoder_fp16", sys.argv[1], extra)
