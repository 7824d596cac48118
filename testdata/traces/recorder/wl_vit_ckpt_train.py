# ViT-B/16 training with activation checkpointing: every block's activations are dropped in the
# forward pass and recomputed in the backward pass, so memory rises and falls block by block.
import os, sys
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch
import common_torch as ct
MODE = ct.start_recording()


def run():
    import timm
    import torch.nn.functional as F
    torch.manual_seed(0)
    model = timm.create_model("vit_base_patch16_224", pretrained=False, num_classes=1000).cuda().train()
    how = "timm set_grad_checkpointing"
    try:
        model.set_grad_checkpointing(True)
    except Exception as e:  # older timm: checkpoint each block by hand
        from torch.utils.checkpoint import checkpoint
        for blk in model.blocks:
            f = blk.forward
            blk.forward = lambda x, f=f: checkpoint(f, x, use_reentrant=False)
        how = "torch.utils.checkpoint per block (%r)" % (e,)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.05)
    B = 128

    def step(i):
        x = torch.randn(B, 3, 224, 224, device="cuda")
        y = torch.randint(0, 1000, (B,), device="cuda")
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    iters, secs = ct.loop(step, target_events=100000, max_iters=80, time_limit=60)
    return dict(iterations=iters, loop_s=round(secs, 2), batch=B, model="timm vit_base_patch16_224 (86M), random init",
                precision="fp32 weights, bf16 autocast", optimizer="AdamW", checkpointing=how, timm=timm.__version__)


try:
    extra = run()
except Exception as e:  # keep the partial (still real) trace
    import traceback; traceback.print_exc()
    extra = dict(error=repr(e)[:500])
extra["record_mode"] = MODE
ct.finish("vit_b16_train_ckpt_b128_bf16", sys.argv[1], extra)
