# A mixture-of-experts transformer layer stack trained on random tokens: a router sends each
# token to its top-2 of 8 experts, so every expert's batch (and every buffer behind it) changes
# size at every step, beside the fixed-size attention part.
import os, sys
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch
import common_torch as ct
MODE = ct.start_recording()


def run():
    import torch.nn as nn
    import torch.nn.functional as F
    torch.manual_seed(0)
    D, E, K, L = 768, 8, 2, 6

    class MoE(nn.Module):
        def __init__(self):
            super().__init__()
            self.router = nn.Linear(D, E)
            self.w1 = nn.Parameter(torch.randn(E, D, 4 * D) * 0.02)
            self.w2 = nn.Parameter(torch.randn(E, 4 * D, D) * 0.02)

        def forward(self, x):
            T = x.shape[0]
            gate = F.softmax(self.router(x), -1)
            w, idx = gate.topk(K, -1)
            out = torch.zeros_like(x)
            for e in range(E):
                rows, slot = (idx == e).nonzero(as_tuple=True)
                if rows.numel() == 0:
                    continue
                h = F.gelu(x[rows] @ self.w1[e]) @ self.w2[e]
                out.index_add_(0, rows, h * w[rows, slot][:, None])
            return out

    class Layer(nn.Module):
        def __init__(self):
            super().__init__()
            self.n1, self.n2 = nn.LayerNorm(D), nn.LayerNorm(D)
            self.attn = nn.MultiheadAttention(D, 12, batch_first=True)
            self.moe = MoE()

        def forward(self, x):
            h = self.n1(x)
            x = x + self.attn(h, h, h, need_weights=False)[0]
            B, S, _ = x.shape
            return x + self.moe(self.n2(x).reshape(B * S, D)).reshape(B, S, D)

    model = nn.Sequential(*[Layer() for _ in range(L)]).cuda().train()
    head = nn.Linear(D, 8192).cuda()
    opt = torch.optim.AdamW(list(model.parameters()) + list(head.parameters()), lr=1e-4)
    B, S = 16, 512

    def step(i):
        x = torch.randn(B, S, D, device="cuda")
        y = torch.randint(0, 8192, (B * S,), device="cuda")
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = F.cross_entropy(head(model(x)).reshape(B * S, -1).float(), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    iters, secs = ct.loop(step, target_events=100000, max_iters=200, time_limit=60)
    return dict(iterations=iters, loop_s=round(secs, 2), batch=B, seq=S, experts=E, top_k=K, layers=L, d_model=D,
                model="MoE transformer (6 layers, 8 experts top-2), random init", precision="fp32 weights, bf16 autocast", optimizer="AdamW")


try:
    extra = run()
except Exception as e:  # keep the partial (still real) trace
    import traceback; traceback.print_exc()
    extra = dict(error=repr(e)[:500])
extra["record_mode"] = MODE
ct.finish("moe_top2_train_bf16", sys.argv[1], extra)
