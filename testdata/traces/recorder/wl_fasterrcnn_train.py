# Object-detection training: torchvision's Faster R-CNN (ResNet-50 FPN, random init) on batches of
# 2..8 images whose sizes change every step (320..800 pixels a side, as detection loaders keep the
# aspect ratio) with 1..30 boxes each. Region proposals, NMS and RoI pooling make sizes that depend
# on the data, not only on the input shape.
import os, sys
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch
import common_torch as ct
MODE = ct.start_recording()


def run():
    import random
    import torchvision
    torch.manual_seed(0)
    random.seed(0)
    model = torchvision.models.detection.fasterrcnn_resnet50_fpn(
        weights=None, weights_backbone=None, num_classes=91, min_size=320, max_size=800).cuda().train()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9, weight_decay=1e-4)

    def step(i):
        imgs, targets = [], []
        for _ in range(random.randint(2, 8)):
            h, w = random.randint(320, 800), random.randint(320, 800)
            imgs.append(torch.rand(3, h, w, device="cuda"))
            n = random.randint(1, 30)
            xy = torch.rand(n, 2, device="cuda") * torch.tensor([w * 0.7, h * 0.7], device="cuda")
            wh = 16 + torch.rand(n, 2, device="cuda") * torch.tensor([w * 0.3, h * 0.3], device="cuda")
            targets.append(dict(boxes=torch.cat([xy, xy + wh], 1),
                                labels=torch.randint(1, 91, (n,), device="cuda")))
        with torch.autocast("cuda", dtype=torch.bfloat16):
            losses = model(imgs, targets)
        sum(losses.values()).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    iters, secs = ct.loop(step, target_events=100000, max_iters=400, time_limit=70)
    return dict(iterations=iters, loop_s=round(secs, 2),
                model="torchvision fasterrcnn_resnet50_fpn, random init, min_size 320, max_size 800",
                batch="2..8 images of 320..800 x 320..800, 1..30 boxes each",
                precision="fp32 weights, bf16 autocast", optimizer="SGD momentum 0.9")


try:
    extra = run()
except Exception as e:  # keep the partial (still real) trace
    import traceback; traceback.print_exc()
    extra = dict(error=repr(e)[:500])
extra["record_mode"] = MODE
ct.finish("fasterrcnn_r50fpn_train_varsize_bf16", sys.argv[1], extra)
